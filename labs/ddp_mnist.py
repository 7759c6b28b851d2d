#!/usr/bin/env python
"""The lab's MNIST networks on PyTorch DDP instead of Horovod, with the same compression flags
and the same run records, so the lab's table can have a DDP column.

    torchrun --nproc-per-node 2 labs/ddp_mnist.py                     # DDP's own allreduce
    torchrun --nproc-per-node 2 labs/ddp_mnist.py --bit8-allreduce    # hvd_compress's hook
    torchrun --nproc-per-node 4 labs/ddp_mnist.py --bit16-allreduce --route allgather
    torchrun --nproc-per-node 2 labs/ddp_mnist.py --ddp-powersgd 1    # DDP's own PowerSGD hook
    torchrun --nproc-per-node 2 labs/ddp_mnist.py --ddp-fp16          # DDP's fp16_compress_hook

labs/mnist.py is the course's page (Horovod); this is its twin on torch.distributed (Gloo on
the CPU, NCCL with --cuda GPUs), in as few lines as the twin needs: the flags, networks, data
shards, learning rate and evaluation are labs/mnist.py's, the books are the lab kit's
RunRecorder (run folder, steps/epochs CSV, manifest, checkpoint with the hook's state,
--resume, the watchdog), given torch.distributed's collectives (hvd_compress/engine/). With no
compression flag DDP runs without a hook (its own allreduce); any flag registers
hvd_compress.ddp's hook. Runs are named as the Horovod ones with '-ddp' (np2-bit8-ddp).

DDP's own flags: --bucket-cap-mb (DDP's bucket_cap_mb), --ddp-fp16 (DDP's fp16_compress_hook)
and --ddp-powersgd RANK, DDP's powerSGD_hook (start_powerSGD_iter 2, as labs/bench/ddp.py) in place of ours, to compare
with --powersgd-allreduce RANK (with --powersgd-like-ddp ours runs the hook's variant: the
first 2 steps uncompressed, its min_compression_rate 2 and its first Q's; or set each with
--powersgd-start-iter, --powersgd-min-compression-rate, --powersgd-init); it runs with every parameter in one bucket unless
--bucket-cap-mb says otherwise (with two buckets it launches collectives from Gloo's threads in
an order the ranks do not share, and Gloo aborts: labs/bench/ddp.py).
"""
import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim

import hvd_compress.ddp as hcd                                   # noqa: E402
from hvd_compress.compression import Compression                 # noqa: E402
from hvd_compress.methods.powersgd import INITS                  # noqa: E402
from hvd_compress.engine.distributed import TorchEngine          # noqa: E402
from hvd_compress.registry import Route, run_name                # noqa: E402
from labs import mnist                                           # noqa: E402
from labs.kit import data as lab_data                            # noqa: E402
from labs.kit.flags import DEFAULTS, compression_of              # noqa: E402
from labs.kit.ranks import load_data                             # noqa: E402
from labs.kit.recorder import RunRecorder                        # noqa: E402
from labs.kit.table import MODEL_SUFFIX                          # noqa: E402


class HookedOptimizer:
    """The SGD the loop steps, with what the recorder asks of hvd_compress's optimizer: the
    hook's counters and plan, its state in the checkpoint. DDP exchanges inside backward, so
    all of the exchange's time is reported as in_backward_s (the recorder moves it out of
    forward_backward_s into compress/communicate/decompress)."""

    def __init__(self, base, state, restarted=False):
        self._base, self._state, self._restarted = base, state, restarted
        # DDP's own allreduce (no hook): what the manifest asks of a communicator
        self.communicator = state.communicator if state is not None else SimpleNamespace(
            route=Route.ALLREDUCE, codec_path=lambda: "none")
        self._memory = state.memory if state is not None else None

    def __getattr__(self, name):
        return getattr(self._base, name)

    def step(self, closure=None):
        return self._base.step(closure)

    def zero_grad(self, set_to_none=True):
        return self._base.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self._base.state_dict()

    def load_state_dict(self, state):
        return self._base.load_state_dict(state)

    def pop_stats(self):
        if self._state is None:        # DDP's own allreduce: nothing of ours to count
            return {"copy_s": 0.0, "compress_s": 0.0, "communicate_s": float("nan"),
                    "decompress_s": 0.0,
                    "bytes_sent": float("nan"), "in_backward_s": 0.0,
                    "exchange_s": float("nan"), "launch_span_s": float("nan")}
        stats = self._state.pop_stats()
        stats["in_backward_s"] = sum(stats[k] for k in ("copy_s", "compress_s", "communicate_s",
                                                         "decompress_s"))
        return stats

    def plan_report(self):
        return self._state.plan_report() if self._state is not None else None

    def pause_step_clock(self):
        pause = getattr(self.communicator, "pause_step_clock", None)
        if pause is not None:
            pause()

    def compression_state_dict(self):
        return self._state.compression_state_dict() if self._state is not None else None

    def load_compression_state_dict(self, state):
        """The hook's state from the checkpoint; after torchrun restarted the job (the ranks
        changed) without auto's plan, which is measured and made again."""
        if self._state is not None and state is not None:
            self._state.load_compression_state_dict(state, plan=not self._restarted)


# DDP's bucket cap (MiB) that puts either lab network in one bucket (--ddp-powersgd's default)
ONE_BUCKET_MB = 1024
# --ddp-powersgd's settings of DDP's hook (its random_seed 0 is our seed's default), as our
# PowerSGD's options: what --powersgd-like-ddp sets
DDP_VARIANT = {"start_iter": 2, "min_compression_rate": 2.0, "init": "ddp"}


def parse_args(argv=None):
    """labs/mnist.py's flags, and DDP's own: --bucket-cap-mb, --ddp-powersgd RANK."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--bucket-cap-mb", type=float, default=None, metavar="MB",
                     help="DDP's bucket_cap_mb (default: DDP's 25, one bucket for "
                          "--ddp-powersgd)")
    own.add_argument("--ddp-powersgd", type=int, default=None, metavar="RANK",
                     help="DDP's own powerSGD_hook at this rank instead of hvd_compress's "
                          "hook (compare with --powersgd-allreduce RANK)")
    own.add_argument("--ddp-fp16", action="store_true",
                     help="DDP's own fp16_compress_hook instead of hvd_compress's hook "
                          "(compare with --fp16-allreduce)")
    own.add_argument("--powersgd-start-iter", type=int, default=None, metavar="N",
                     help="with --powersgd-allreduce: the first N steps uncompressed (DDP's "
                          "start_powerSGD_iter; default 0)")
    own.add_argument("--powersgd-min-compression-rate", type=float, default=None,
                     metavar="RATE", help="with --powersgd-allreduce: leave a matrix "
                     "uncompressed unless its factors are RATE times smaller (DDP's "
                     "min_compression_rate; default 0: every matrix)")
    own.add_argument("--powersgd-init", choices=INITS, default=None,
                     help="with --powersgd-allreduce: the first Q by tensor name (default) or "
                          "drawn as DDP's powerSGD_hook draws it")
    own.add_argument("--powersgd-like-ddp", action="store_true",
                     help="with --powersgd-allreduce: DDP's hook's variant as --ddp-powersgd "
                          "runs it (start iter 2, min compression rate 2, init ddp)")
    extra, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        own.print_help()
    args = mnist.parse_args(rest)
    args.bucket_cap_mb, args.ddp_powersgd = extra.bucket_cap_mb, extra.ddp_powersgd
    args.ddp_fp16 = extra.ddp_fp16
    if args.ddp_fp16 and (args.ddp_powersgd is not None or args.compression != "none"
                          or args.route is not None):
        sys.exit("error: --ddp-fp16 is DDP's own hook: no compression flag or --ddp-powersgd "
                 "with it")
    args.powersgd_options = powersgd_options(extra, args)
    if args.ddp_powersgd is not None:
        if args.ddp_powersgd < 1:
            sys.exit(f"error: --ddp-powersgd RANK must be at least 1, got {args.ddp_powersgd}")
        if args.compression != "none" or args.route is not None:
            sys.exit("error: --ddp-powersgd is DDP's own hook: no compression flag with it")
        if args.bucket_cap_mb is None:
            args.bucket_cap_mb = ONE_BUCKET_MB
    if args.powersgd_options.get("init") == "ddp" and args.bucket_cap_mb is None:
        args.bucket_cap_mb = ONE_BUCKET_MB          # DDP's buckets, hence its draws, as its hook's
    if args.bucket_cap_mb is not None and args.bucket_cap_mb <= 0:
        sys.exit(f"error: --bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    return args


def powersgd_options(extra, args):
    """Our PowerSGD's options from the flags ({} for the method's defaults); refused without
    --powersgd-allreduce."""
    options = dict(DDP_VARIANT) if extra.powersgd_like_ddp else {}
    for key, value in (("start_iter", extra.powersgd_start_iter),
                       ("min_compression_rate", extra.powersgd_min_compression_rate),
                       ("init", extra.powersgd_init)):
        if value is not None:
            options[key] = value
    if options and args.compression != "powersgd":
        sys.exit("error: the --powersgd-* options go with --powersgd-allreduce RANK")
    if options.get("start_iter", 0) < 0 or not options.get("min_compression_rate", 0) >= 0:
        sys.exit("error: --powersgd-start-iter and --powersgd-min-compression-rate must be >= 0")
    return options


def ddp_powersgd(ddp, rank):
    """DDP's own PowerSGD hook on `ddp`; its state (error feedback and warm start are per
    bucket, kept by DDP's hook state: not in the lab's checkpoint)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=DDP_VARIANT["start_iter"])
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def config_name(args, world_size):
    """The run's name: the Horovod run's with the variant 'ddp' (np2-bit8-ddp); DDP's own
    PowerSGD hook 'np2-powersgd-ddphook'; ours in DDP's variant 'np2-powersgd-ddp-ddplike', in
    other settings 'np2-powersgd-ddp-start2-rate2-initddp' (those that differ from ours)."""
    if getattr(args, "ddp_powersgd", None) is not None:
        name = run_name(world_size, "powersgd", variant="ddphook")
    elif getattr(args, "ddp_fp16", False):
        name = run_name(world_size, "fp16", variant="ddphook")
    else:
        name = run_name(world_size, args.compression, args.route,
                        error_feedback=bool(args.error_feedback), variant="ddp")
        options = getattr(args, "powersgd_options", {})
        if options == DDP_VARIANT:
            name += "-ddplike"
        elif options:
            name += "".join(f"-{label}{options[key]:g}" if key != "init" else f"-init{options[key]}"
                            for key, label in (("start_iter", "start"),
                                               ("min_compression_rate", "rate"), ("init", ""))
                            if key in options)
    return name if args.model == DEFAULTS["model"] else f"{name}-{MODEL_SUFFIX[args.model]}"


def attempt_store():
    """Under torchrun's agent store, the group's rendezvous under a prefix of its own for each
    restart: with the agent's one store the keys of the attempt before are still there, and a
    restarted rank read the dead attempt's addresses (Gloo: 'Connection refused', or a hang)
    in 2 tries of 5 here. {} elsewhere (env:// as usual)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=300))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"ddp_mnist/attempt{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def elastic_restart(args, engine):
    """True if torchrun restarted this job after a failure (--max-restarts): then the run in
    --out is continued from its last checkpoint, as --resume does (the hook's state with it,
    auto's plan made again). Without --out the restarted job starts a new run folder."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    found = bool(args.out) and (Path(args.out) / "manifest.json").is_file()
    if engine.broadcast_object(found, root_rank=0, name="restart_resume"):   # rank 0's disk
        args.resume = True
    elif engine.rank() == 0:
        print("torchrun restarted this job: pass --out RUN_FOLDER to continue the same run; "
              "starting a new one", file=sys.stderr, flush=True)
    return True


def train(epoch, model, optimizer, data, args, run, engine):
    model.train()
    shard = lab_data.train_shard(len(data.train_y), run.rank, run.size, args.seed, epoch)
    batches = lab_data.batches(shard, args.batch_size)[:args.steps_per_epoch]
    validate = None if data.holdout_x is None else (
        lambda: evaluate(model, data.holdout_x, data.holdout_y, args, run, engine, "holdout"))
    for step in run.steps(epoch, batches, validate):
        with step.timer("forward_backward"):
            x, y = data.train_x[step.index], data.train_y[step.index]
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()             # DDP exchanges the buckets here (our hook, or its own)
        with step.timer("optimizer"):
            optimizer.step()
        step.loss = loss.item()


def evaluate(model, images, labels, args, run, engine, split):
    """labs/mnist.py's evaluation: each rank scores its block, the sums added across ranks."""
    model.eval()
    start = time.perf_counter()
    shard = lab_data.eval_shard(len(labels), run.rank, run.size)
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for index in lab_data.batches(shard, args.test_batch_size):
            output = model(images[index])
            loss_sum += F.nll_loss(output, labels[index], reduction="sum").item()
            correct += int((output.argmax(dim=1) == labels[index]).sum())
    totals = engine.allreduce(torch.tensor([loss_sum, correct, len(shard)], dtype=torch.float64),
                              f"{split}_totals.{run.step}", "sum")
    model.train()
    return {f"{split}_samples": int(totals[2]), f"{split}_loss": float(totals[0] / totals[2]),
            f"{split}_accuracy": float(totals[1] / totals[2]),
            "eval_s": time.perf_counter() - start}


def test(epoch, model, data, args, run, engine):
    return evaluate(model, data.test_x, data.test_y, args, run, engine, "test")


def main(argv=None):
    args = parse_args(argv)
    if args.use_adasum or args.optimizer == "horovod":
        sys.exit("error: --use-adasum and --optimizer horovod are Horovod's; this is DDP")
    if "RANK" not in os.environ:        # python labs/ddp_mnist.py: a job of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    dist.init_process_group("nccl" if args.cuda else "gloo", timeout=timedelta(seconds=300),
                            **attempt_store())
    engine = TorchEngine()
    restarted = elastic_restart(args, engine)
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    data = load_data(args, device, engine)
    run = RunRecorder(args, config_name(args, engine.size()), engine)
    model = mnist.MODELS[args.model]().to(device)
    base = optim.SGD(model.parameters(), lr=args.lr * engine.size(), momentum=args.momentum)
    state = None
    if args.compression != "none" or args.route is not None:
        compression = compression_of(args)
        if args.powersgd_options:
            compression = Compression.powersgd(compression.rank, compression.error_feedback,
                                               **args.powersgd_options)
        state = hcd.HookState(compression, args.route, error_feedback=args.error_feedback,
                              scale_block=args.scale_block, model=model)
    optimizer = HookedOptimizer(base, state, restarted)
    first_epoch = run.resume(model, optimizer)
    # DDP broadcasts rank 0's parameters and buffers when it wraps the model
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, **({} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}))
    if state is not None:
        ddp.register_comm_hook(state, hcd.hook)
    elif args.ddp_powersgd is not None:
        ddp_powersgd(ddp, args.ddp_powersgd)
    elif args.ddp_fp16:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    try:
        with run.recording(optimizer, data):
            for epoch in range(first_epoch, args.epochs + 1):
                train(epoch, ddp, optimizer, data, args, run, engine)
                run.end_epoch(epoch, test(epoch, ddp, data, args, run, engine), model, optimizer)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
