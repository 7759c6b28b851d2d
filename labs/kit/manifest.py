"""manifest.json: what a run was (flags, machine, software, network) and how it ended.

Rank 0 writes it when the run starts ('running'), after every epoch (epochs_completed) and
when it ends ('complete', 'interrupted' or 'failed', with the reason).  The run matrix, the
report and --resume read it.
"""
import os
import time
from pathlib import Path

import horovod.torch as hvd

from . import runlog
from .flags import AUTO
from .ranks import horovod_settings


def plans(args):
    """Does this run's optimizer choose a plan per bucket (--auto-allreduce)?"""
    return args.compression == AUTO


def plan_report(optimizer, args):
    """The optimizer's plan report (buckets and their scheme:route, predicted and measured
    step, measurements, refused candidates, calibration time, events) for --auto-allreduce,
    None for a fixed scheme; an optimizer that plans but cannot report is an error, never a
    blank."""
    if not plans(args):
        return None
    report = getattr(optimizer, "plan_report", None)
    if report is None:
        raise RuntimeError("--auto-allreduce: the optimizer has no plan_report(); this "
                           "hvd_compress's Compression.auto cannot say what it chose")
    report = report()
    return None if report is None else report.to_dict()     # the manifest's JSON


def collective(optimizer, args, world_size):
    """The collective that really carries the gradients (the compressor's default included);
    'auto' where the plan picks one per bucket (the manifest's plan_report names them)."""
    if args.use_adasum:
        return "adasum"
    if plans(args):
        return AUTO
    if args.optimizer == "horovod":
        if world_size == 1:
            return "none"               # Horovod's optimizer skips the exchange at size 1
        return "allgather" if args.compression in ("bit8", "bit16") else "allreduce"
    return optimizer.communicator.route.value


def codec_path(optimizer, args):
    """Which implementation coded the gradients: 'native' (the C++ kernel) or 'torch' (its
    fallback, about 5x slower: a kernel not built for this torch warns once and shows here)."""
    comm = getattr(optimizer, "communicator", None)
    if comm is not None and hasattr(comm, "codec_path"):
        return comm.codec_path()
    if plans(args):                     # the plan's codecs: the kernel bit8 and bit16 share
        from hvd_compress.codecs import E4M3, blocks
        return blocks.codec_path(E4M3)
    from hvd_compress import registry           # Horovod's own optimizer: the course's patch
    compression = registry.scheme(args.compression).load()   # codes with the plugin's classes
    path = getattr(compression, "codec_path", None)
    return path() if path is not None else "torch"


def error_feedback_on(optimizer):
    """Does this run carry residuals (asked for, or the method's default)?"""
    comm = getattr(optimizer, "communicator", None)
    return comm is not None and (getattr(optimizer, "_memory", None) is not None
                                 or getattr(comm, "memory", None) is not None)


def emulated_network(environ=os.environ):
    """The link labs.netem gave this rank (it sets HVDC_NETEM*), or None: loopback."""
    if environ.get("HVDC_NETEM") != "1":
        return None
    rate = environ.get("HVDC_NETEM_RATE_BPS", "")
    return {"emulated": True, "rate_bps": float(rate) if rate else None,
            "delay_s": float(environ.get("HVDC_NETEM_DELAY_S", "0")),
            "delay_via": environ.get("HVDC_NETEM_DELAY_VIA") or None,
            "mtu": int(environ.get("HVDC_NETEM_MTU", "1500"))}


def start(run_dir, args, config, world_size, optimizer, data, first_epoch, dropped,
          controller=None):
    """Write the manifest of a starting (or resumed: `dropped` rows) run; returns it."""
    manifest = runlog.read_manifest(run_dir) if args.resume else None
    resumes = (manifest or {}).get("resumes", [])
    if args.resume:
        resumes.append({"time": runlog.now_iso(), "from_epoch": first_epoch,
                        "rows_dropped_rank0": dropped})
    env = runlog.environment(Path(__file__).parent)
    fresh = {
        "config": config, "status": "running", "reason": None,
        "args": dict(vars(args)), "world_size": world_size,
        "compression": args.compression,
        "optimizer": "horovod" if args.use_adasum else args.optimizer,
        # the collective; "route" and "reduction" are the first records' names (the optimizer
        # and the collective), kept so that runs recorded before and after read alike
        "collective": collective(optimizer, args, world_size),
        "route": "horovod" if args.use_adasum else args.optimizer,
        "reduction": collective(optimizer, args, world_size),
        "horovod_env": horovod_settings(), "step_timeout_s": args.step_timeout,
        "network": emulated_network(),
        "error_feedback": error_feedback_on(optimizer), "adasum": args.use_adasum,
        "codec_path": codec_path(optimizer, args),
        "method_parameter": args.topk_allreduce if args.compression == "topk" else
        args.powersgd_allreduce if args.compression == "powersgd" else None,
        # in the order the optimizer holds them; the cost model plans buckets from these
        "parameter_shapes": [list(p.shape) for group in optimizer.param_groups
                             for p in group["params"] if p.requires_grad],
        "lr_effective": args.lr * (1 if args.use_adasum else world_size),
        "controller": controller or ("mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled()
                                     else "none"),
        "versions": {k: env[k] for k in ("python", "torch", "horovod", "mpi", "numpy",
                                         "cuda", "hvd_compress")},
        "cpu_model": env["cpu_model"], "hostname": env["hostname"],
        "git_commit": env["git_commit"], "environment": env,
        "data": data.describe(), "run_dir": str(Path(run_dir).resolve()),
        "start_time": runlog.now_iso(), "start_unix": time.time(),
        # this attempt's rank 0 process: its time to accuracy counts start-up from there
        "process_start_unix": runlog.process_start_unix(), "end_time": None,
        "end_unix": None, "epochs_completed": first_epoch - 1,
        "resumes": resumes,
        # --auto-allreduce: what the plan is (rewritten after every epoch and at the end)
        "plan_report": plan_report(optimizer, args),
    }
    if manifest:                       # keep when the run first started
        fresh["start_time"] = manifest.get("start_time", fresh["start_time"])
        fresh["start_unix"] = manifest.get("start_unix", fresh["start_unix"])
    runlog.write_manifest(run_dir, fresh)
    return fresh


def finish(run_dir, status, reason, plan=None):
    """Merge the ranks' step files into steps.csv and record how the run ended (and, with
    --auto-allreduce, the last plan report)."""
    run_dir = Path(run_dir)
    parts = sorted(run_dir.glob("steps_rank*.csv"),
                   key=lambda p: int(p.stem.replace("steps_rank", "")))
    if parts:
        runlog.merge_csvs(parts, run_dir / "steps.csv")
    fields = {"plan_report": plan} if plan is not None else {}
    runlog.update_manifest(run_dir, status=status, reason=reason,
                           end_time=runlog.now_iso(), end_unix=time.time(), **fields)
