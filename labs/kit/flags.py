"""The trainer's flags that argparse cannot check by itself (labs/mnist.py parse_args): value
ranges and combinations, each refused with a message that says what to do instead."""
import argparse
import math

from hvd_compress import registry

__all__ = ["DEFAULTS", "AUTO", "AUTO_FLAG", "compression_flags", "scale_block",
           "add_compression_flags", "add_auto_flags", "check_args", "compression_of",
           "auto_compression"]

# The lab's defaults where they differ from Horovod's pytorch_mnist.py (model: its small net,
# lr 0.01, momentum 0.5, 10 epochs): pytorch/examples' larger network with momentum 0.9, which
# learns in 2 epochs what the small net takes several for, at 1 to 4 processes alike (the runs
# that chose them: the lab's results, "The defaults, measured").
# The run matrix and the elastic trainer take them from here.
DEFAULTS = {"model": "basic", "lr": 0.02, "momentum": 0.9, "epochs": 2}


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")


def compression_flags():
    """Each compression scheme (hvd_compress.registry, plugins included) and the attribute of
    the trainer's flag that picks it: {'bit8': 'bit8_allreduce', ...}."""
    return {s.name: _dest(s.flag) for s in registry.schemes().values() if s.flag}


# Compression.auto (docs/planner.md): not one scheme but a per-bucket plan the
# optimizer measures and chooses inside the job, so it has no registry entry of its own (no
# bits, no bytes formula); its name is a run name all the same ('np2-auto'), and its switch
# sits beside the schemes' in the same exclusive group.
AUTO, AUTO_FLAG = "auto", "--auto-allreduce"


def add_compression_flags(group):
    """One flag per registered scheme (its registry entry's), into an argparse group: a switch,
    or a value for a method with a parameter (top-k's RATIO, PowerSGD's RANK)."""
    for s in registry.schemes().values():
        if not s.flag:
            continue
        if s.parameter is None:
            group.add_argument(s.flag, action="store_true", default=False, help=s.summary)
        else:
            kind = type(s.parameter)
            group.add_argument(s.flag, type=kind, default=None,
                               metavar="RATIO" if kind is float else "RANK",
                               help=f"{s.summary} (e.g. {s.parameter})")
    if AUTO not in registry.SCHEMES:    # unless the runtime registers it itself
        group.add_argument(AUTO_FLAG, action="store_true", default=False,
                           help="per-bucket plan measured and chosen inside the job: float32, "
                                "fp16, bit16 or bit8 and their route, bucket by bucket "
                                "(hc.Compression.auto, docs/planner.md)")


def add_auto_flags(parser):
    """--auto-allreduce's own options (Compression.auto(objective=..., step_s=...))."""
    parser.add_argument("--auto-objective", choices=("step_time", "time_to_accuracy"),
                        default=None, help="with --auto-allreduce: what auto minimises "
                        "(default step_time; time_to_accuracy also weighs PowerSGD, top-k, "
                        "1-bit and int8 by their measured progress, docs/planner.md)")
    parser.add_argument("--auto-step-s", default=None, metavar="JSON",
                        help="with --auto-objective time_to_accuracy: a JSON file of each "
                        "mode's seconds per step ({'value': s, 'topk0.1': s, ...}: a link's "
                        "step cells) instead of the job's own measurement")


def scale_block(text):
    """--scale-block: a positive number of values, or 'tensor' (None: one scale per tensor)."""
    if text == "tensor":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of values or 'tensor', "
                                         f"got {text!r}")
    return int(text)


def check_args(parser, args):
    """Values and combinations argparse cannot check; adds args.compression."""
    for flag in ("epochs", "batch_size", "test_batch_size", "log_interval", "num_threads",
                 "max_steps", "split_test", "steps_per_epoch", "holdout", "eval_every"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("eval_every", "target_accuracy"):
        if getattr(args, flag, None) is not None and not getattr(args, "holdout", None):
            parser.error(f"--{flag.replace('_', '-')} needs --holdout K: the evaluations score "
                         f"images held out of the training set, never the test set")
    target = getattr(args, "target_accuracy", None)
    if target is not None and not 0 < target <= 1:
        parser.error(f"--target-accuracy must be a fraction in (0, 1], got {target}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    if not (0 <= args.momentum < 1):
        parser.error(f"--momentum must be in [0, 1), got {args.momentum}")
    timeout = args.step_timeout
    if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
        parser.error(f"--step-timeout must be >= 0 seconds (0 disables), got {args.step_timeout}")
    floor = getattr(args, "step_timeout_floor", None)
    if floor is not None and not (floor > 0 and math.isfinite(floor)):
        parser.error(f"--step-timeout-floor must be > 0 seconds, got {floor}")
    flags = compression_flags()
    args.compression = next((name for name, flag in flags.items()
                             if getattr(args, flag, None) not in (None, False)), "none")
    if getattr(args, _dest(AUTO_FLAG), False):
        args.compression = AUTO
    if args.compression == AUTO and AUTO not in registry.SCHEMES:
        check_auto(parser, args)
        return
    for flag in ("auto_objective", "auto_step_s"):
        if getattr(args, flag, None) is not None:
            parser.error(f"--{flag.replace('_', '-')} needs {AUTO_FLAG}")
    entry = registry.scheme(args.compression)
    if args.topk_allreduce is not None and not 0 < args.topk_allreduce <= 1:
        parser.error(f"--topk-allreduce RATIO must be in (0, 1], got {args.topk_allreduce}")
    if args.powersgd_allreduce is not None and args.powersgd_allreduce < 1:
        parser.error(f"--powersgd-allreduce RANK must be at least 1, got {args.powersgd_allreduce}")
    packets = entry.packet
    if args.use_adasum and args.compression not in ("none", "fp16"):
        parser.error(f"--use-adasum cannot be combined with {entry.flag} "
                     "(Adasum needs full gradients; use it alone or with --fp16-allreduce)")
    if args.use_adasum and args.error_feedback:
        parser.error("--error-feedback is not available with --use-adasum")
    routes = [r.value for r in entry.routes] if packets else []
    if args.route and args.route not in routes:
        parser.error("--route only applies to --bit8/--bit16/--int8/--bf16-allreduce (allgather "
                     "or alltoall) and --onebit-allreduce (allgather), not to "
                     f"{args.compression} with {args.route}")
    if args.error_feedback is not None and not (packets or entry.parameter is not None):
        parser.error("--error-feedback needs a compressed exchange (--bit8, --bit16, --int8, "
                     "--onebit, --topk or --powersgd-allreduce)")
    if args.optimizer == "horovod" and args.compression not in registry.COURSE_SCHEMES:
        parser.error("--optimizer horovod is Horovod's own optimizer with the course's patch: it "
                     "knows --fp16, --bit16 and --bit8-allreduce; the other methods need "
                     "--optimizer plugin")
    if args.optimizer == "horovod" and (args.route == "alltoall" or args.error_feedback):
        parser.error("--optimizer horovod is Horovod's own optimizer with the course's allgather "
                     "route: --route alltoall and --error-feedback need --optimizer plugin")
    if args.resume and not args.out:
        parser.error("--resume needs --out RUN_FOLDER (the run to continue)")


def check_auto(parser, args):
    """--auto-allreduce: the plan picks each bucket's scheme, route and error feedback, so the
    flags that fix them for the whole model are refused, and so is a build of hvd_compress
    without the runtime (before Horovod starts, exit code 2, no run folder)."""
    for flag, given in (("--route", args.route is not None),
                        ("--error-feedback", args.error_feedback is not None),  # or --no-...
                        ("--use-adasum", args.use_adasum)):
        if given:
            parser.error(f"{flag} cannot be combined with {AUTO_FLAG}: the plan chooses "
                         f"each bucket's scheme, route and error feedback (docs/planner.md)")
    if args.optimizer == "horovod":
        parser.error(f"{AUTO_FLAG} needs --optimizer plugin: Horovod's own optimizer has one "
                     f"fixed compression")
    try:
        auto_compression()
    except RuntimeError as err:
        parser.error(str(err))
    if args.resume and not args.out:
        parser.error("--resume needs --out RUN_FOLDER (the run to continue)")
    try:
        compression_of(args)
    except ValueError as err:
        parser.error(str(err))


def auto_compression():
    """hc.Compression.auto, or a RuntimeError saying that this hvd_compress has none."""
    from hvd_compress.compression import Compression
    auto = getattr(Compression, AUTO, None)
    if auto is None:
        raise RuntimeError(f"{AUTO_FLAG}: this hvd_compress has no Compression.auto (the "
                           f"per-bucket planner's runtime); update the checkout")
    return auto


def compression_of(args):
    """The hvd_compress compression the parsed flags ask for (top-k and PowerSGD with their
    ratio or rank, and error feedback unless --no-error-feedback)."""
    if args.compression == AUTO and AUTO not in registry.SCHEMES:
        options = {k: v for k, v in (("objective", getattr(args, "auto_objective", None)),
                                     ("step_s", getattr(args, "auto_step_s", None)))
                   if v is not None}
        return auto_compression()(**options) if options else auto_compression()
    entry = registry.scheme(args.compression)
    if entry.parameter is not None:
        value = getattr(args, _dest(entry.flag))
        return entry.load()(value, error_feedback=args.error_feedback is not False)
    return entry.load()
