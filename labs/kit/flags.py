"""The trainer's flags that argparse cannot check by itself (labs/mnist.py parse_args): value
ranges and combinations, each refused with a message that says what to do instead."""
import argparse
import math

__all__ = ["scale_block", "check_args"]


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
                 "max_steps", "split_test"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    if not (0 <= args.momentum < 1):
        parser.error(f"--momentum must be in [0, 1), got {args.momentum}")
    timeout = args.step_timeout
    if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
        parser.error(f"--step-timeout must be >= 0 seconds (0 disables), got {args.step_timeout}")
    args.compression = ("fp16" if args.fp16_allreduce else "bit16" if args.bit16_allreduce
                        else "bit8" if args.bit8_allreduce else "none")
    packets = args.compression in ("bit8", "bit16")
    if args.use_adasum and packets:
        parser.error("--use-adasum cannot be combined with --bit8-allreduce/--bit16-allreduce "
                     "(Adasum needs full gradients; use it alone or with --fp16-allreduce)")
    if args.use_adasum and args.error_feedback:
        parser.error("--error-feedback is not available with --use-adasum")
    if args.reduction and not packets:
        parser.error("--reduction only applies to --bit8-allreduce or --bit16-allreduce")
    if args.error_feedback and not packets:
        parser.error("--error-feedback needs --bit8-allreduce or --bit16-allreduce")
    if args.route == "horovod" and (args.reduction == "alltoall" or args.error_feedback):
        parser.error("--route horovod is Horovod's own optimizer with the course's allgather "
                     "route: --reduction alltoall and --error-feedback need --route plugin")
    if args.resume and not args.out:
        parser.error("--resume needs --out RUN_FOLDER (the run to continue)")
