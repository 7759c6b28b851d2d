#!/usr/bin/env python
"""Course lab: Horovod's PyTorch MNIST example with compressed gradients, timed step by step.

    python labs/mnist.py                                         # serial (world size 1)
    horovodrun -np 2 --gloo python labs/mnist.py --bit8-allreduce  # 2 processes, 8-bit gradients
    horovodrun -np 4 --gloo python labs/mnist.py --bit16-allreduce

Same model and flags as Horovod's examples/pytorch/pytorch_mnist.py, plus the course's
compression switches.  Every configuration except --use-adasum goes through one code path:
hvd_compress.DistributedOptimizer, which reports how long compression, communication and
decompression took, and how many bytes this rank sent.  `--route horovod` trains instead with
Horovod's own hvd.DistributedOptimizer(compression=hvd.Compression.bit8) of the patched Horovod
(the course's in-tree route): the same numbers, bit for bit, but only whole-step times.

A rank that dies ends the job within seconds; one that hangs (stopped, deadlocked) is caught by
a watchdog: no step for --step-timeout seconds and the job ends with a clear error
(exit code 75), recorded as failed.  Each rank writes its pid to <run>/pids/rank<r>.pid.

Everything a run produces goes to --out (default runs/<configuration>-<time>):
    steps_rank<r>.csv  one row per training step of rank r (written while training)
    steps.csv          all ranks' rows, merged by rank 0 at the end
    epochs.csv         one row per epoch: test loss/accuracy, epoch time, samples/s
    manifest.json      arguments, world size, versions, machine, status
    checkpoint.pt      model + optimizer + RNG state after the last finished epoch

--resume continues an interrupted run from its last checkpoint (end of an epoch): rows
written after that checkpoint (the unfinished epoch) are dropped from the CSV files and that
epoch is run again, so every row appears once.  See docs/lab.md.
"""
import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too
import hvd_compress as hc  # noqa: E402
from hvd_compress.codecs import SCALE_BLOCK  # noqa: E402
from hvd_compress import data as lab_data  # noqa: E402
from hvd_compress import runlog  # noqa: E402
from hvd_compress.compressors import packet_bytes  # noqa: E402
from hvd_compress.watchdog import StepWatchdog  # noqa: E402


# =============================================================================================
# 1. Flags
# =============================================================================================

def build_parser():
    parser = argparse.ArgumentParser(
        description="Horovod MNIST with 8/16-bit gradient compression (course lab)")
    # --- the flags of Horovod's pytorch_mnist.py ---
    parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                        help="input batch size for training, per rank (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N",
                        help="input batch size for testing (default: 1000)")
    parser.add_argument("--epochs", type=int, default=10, metavar="N",
                        help="number of epochs to train (default: 10)")
    parser.add_argument("--lr", type=float, default=0.01, metavar="LR",
                        help="learning rate, multiplied by the world size (default: 0.01)")
    parser.add_argument("--momentum", type=float, default=0.5, metavar="M",
                        help="SGD momentum (default: 0.5)")
    parser.add_argument("--seed", type=int, default=42, metavar="S",
                        help="random seed (default: 42)")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                        help="batches between progress updates (default: 10)")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="use Horovod's Adasum reduction (stock optimizer, not timed)")
    compression = parser.add_mutually_exclusive_group()
    compression.add_argument("--fp16-allreduce", action="store_true", default=False,
                             help="fp16 compression during allreduce (Horovod's cast)")
    compression.add_argument("--bit16-allreduce", action="store_true", default=False,
                             help="16-bit float gradients (hvd_compress Bit16Compressor)")
    compression.add_argument("--bit8-allreduce", action="store_true", default=False,
                             help="8-bit float gradients (hvd_compress Bit8Compressor)")
    # --- the course's additions ---
    parser.add_argument("--route", choices=["plugin", "horovod"], default="plugin",
                        help="plugin: hvd_compress.DistributedOptimizer, timed phase by phase "
                             "(default); horovod: the course's in-tree route, Horovod's own "
                             "hvd.DistributedOptimizer(compression=hvd.Compression.<c>) of the "
                             "patched Horovod (whole-step times only)")
    parser.add_argument("--reduction", choices=["allgather", "alltoall"], default=None,
                        help="how 8/16-bit packets travel (default: the compressor's own)")
    parser.add_argument("--scale-block", type=scale_block, default=SCALE_BLOCK,
                        metavar="N|tensor",
                        help="bit8/bit16: values per power-of-two scale in a bucket (default "
                             f"{SCALE_BLOCK}); 'tensor': one scale per tensor, no "
                             "fusion, the course's packets (what --route horovod sends)")
    parser.add_argument("--error-feedback", action="store_true", default=False,
                        help="keep each rank's compression error and add it to the next step")
    parser.add_argument("--dataset", choices=sorted(lab_data.DATASETS), default="mnist",
                        help="mnist (needs --data-dir or torchvision online) or fashion-mnist "
                             "(Debian's dataset-fashion-mnist)")
    parser.add_argument("--data-dir", default=None,
                        help="folder holding the IDX .gz files")
    parser.add_argument("--split-test", type=int, default=None, metavar="N",
                        help="train on the first N test images, evaluate on the rest")
    parser.add_argument("--out", default=None,
                        help="run folder (default: runs/<configuration>-<time>)")
    parser.add_argument("--resume", action="store_true", default=False,
                        help="continue the interrupted run in --out from its last checkpoint")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="stop after N training steps in total (smoke tests); the run is "
                             "then recorded as interrupted and can be resumed")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show a progress bar on rank 0 (default: on)")
    parser.add_argument("--num-threads", type=int, default=1, metavar="N",
                        help="torch CPU threads per rank (default: 1, like Horovod's example)")
    parser.add_argument("--step-timeout", type=float, default=300, metavar="SECONDS",
                        help="end the job if no training step or evaluation finishes for this "
                             "long: another rank is dead or wedged (default: 300; 0 disables)")
    return parser


def scale_block(text):
    """--scale-block: a positive number of values, or 'tensor' (None: one scale per tensor)."""
    if text == "tensor":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of values or 'tensor', got {text!r}")
    return int(text)


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    positive = {"--epochs": args.epochs, "--batch-size": args.batch_size,
                "--test-batch-size": args.test_batch_size, "--log-interval": args.log_interval,
                "--num-threads": args.num_threads}
    if args.max_steps is not None:
        positive["--max-steps"] = args.max_steps
    if args.split_test is not None:
        positive["--split-test"] = args.split_test
    for flag, value in positive.items():
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    if not (0 <= args.momentum < 1):
        parser.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if not (args.step_timeout >= 0 and math.isfinite(args.step_timeout)):
        parser.error(f"--step-timeout must be >= 0 seconds (0 disables), got {args.step_timeout}")
    args.compression = ("fp16" if args.fp16_allreduce else "bit16" if args.bit16_allreduce
                        else "bit8" if args.bit8_allreduce else "none")
    if args.use_adasum and args.compression in ("bit8", "bit16"):
        parser.error("--use-adasum cannot be combined with --bit8-allreduce/--bit16-allreduce "
                     "(Adasum needs full gradients; use it alone or with --fp16-allreduce)")
    if args.use_adasum and args.error_feedback:
        parser.error("--error-feedback is not available with --use-adasum")
    if args.reduction and args.compression not in ("bit8", "bit16"):
        parser.error("--reduction only applies to --bit8-allreduce or --bit16-allreduce")
    if args.error_feedback and args.compression not in ("bit8", "bit16"):
        parser.error("--error-feedback needs --bit8-allreduce or --bit16-allreduce")
    if args.route == "horovod" and (args.reduction == "alltoall" or args.error_feedback):
        parser.error("--route horovod is Horovod's own optimizer with the course's allgather "
                     "route: --reduction alltoall and --error-feedback need --route plugin")
    if args.resume and not args.out:
        parser.error("--resume needs --out RUN_FOLDER (the run to continue)")
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


def config_name(args, world_size):
    """A short name for a configuration, e.g. 'np4-bit8-alltoall-ef' or 'serial-none'."""
    parts = ["serial" if world_size == 1 else f"np{world_size}", args.compression]
    if args.use_adasum:
        parts.append("adasum")
    elif args.route == "horovod":
        parts.append("horovod")
    if args.reduction:
        parts.append(args.reduction)
    if args.error_feedback:
        parts.append("ef")
    return "-".join(parts)


# =============================================================================================
# 2. The model (Horovod's example network)
# =============================================================================================

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


# =============================================================================================
# 3. The distributed optimizer: one timed code path for none / fp16 / bit16 / bit8
# =============================================================================================

def make_optimizer(model, args, world_size):
    lr_scaler = 1 if args.use_adasum else world_size   # Adasum needs no lr scaling
    base = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    if args.use_adasum or args.route == "horovod":
        # Horovod's own optimizer, exactly as a course script calls it; with the course's
        # patch, hvd.Compression.bit8/.bit16 exist and travel by allgather.
        compression = getattr(hvd.Compression, args.compression)
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=compression,
                                        op=hvd.Adasum if args.use_adasum else hvd.Average)
    compression = {"none": hc.Compression.none, "fp16": hc.Compression.fp16,
                   "bit16": hc.Compression.bit16, "bit8": hc.Compression.bit8}[args.compression]
    return hc.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=compression, op=hvd.Average,
                                   route=args.reduction, scale_block=args.scale_block,
                                   error_feedback=args.error_feedback)


NO_STATS = {"compress_s": math.nan, "communicate_s": math.nan, "decompress_s": math.nan,
            "bytes_sent": math.nan}


def stock_step_stats(model, args, world_size):
    """One step of Horovod's own optimizer (--route horovod, --use-adasum), as far as we know it.

    Its work happens inside backward hooks and synchronize(), out of our reach: no per-phase
    times (NaN).  The bytes this rank sends follow from the tensor sizes, counted the way the
    plugin counts them: (n-1) packets per gradient by allgather, 2(n-1)/n of the tensor by
    ring allreduce; NaN for Adasum; 0 serially (Horovod skips the exchange at size 1).
    """
    if args.use_adasum:
        return dict(NO_STATS)
    n, sizes = world_size, [p.numel() for p in model.parameters() if p.requires_grad]
    if n == 1:
        sent = 0
    elif args.compression in ("bit8", "bit16"):
        compressor = getattr(hvd.Compression, args.compression)
        sent = sum((n - 1) * packet_bytes(compressor, numel) for numel in sizes)
    else:
        item = 2 if args.compression == "fp16" else 4
        sent = sum(2 * (n - 1) * numel * item // n for numel in sizes)
    return dict(NO_STATS, bytes_sent=sent)


def pop_stats(opt, ctx):
    """The plugin's timings and bytes since the last call; for Horovod's own optimizer, the
    fixed per-step numbers of stock_step_stats()."""
    return opt.pop_stats() if hasattr(opt, "pop_stats") else dict(ctx.stock_stats)


# =============================================================================================
# 4. Small helpers: agreeing across ranks, progress, interruption
# =============================================================================================

def agree(error, rank):
    """Every rank passes its error message (or None); all ranks see the first one.

    Without this a rank that fails alone (say, a missing file) would leave the others
    waiting forever in the next collective.
    """
    errors = [e for e in hvd.allgather_object(error) if e]
    if errors:
        if rank == 0:
            print(f"error: {errors[0]}", file=sys.stderr, flush=True)
        sys.exit(2)


class Interrupted(Exception):
    """The run was stopped before its last epoch (signal or --max-steps); it can be resumed."""


def stop_on_sigterm():
    def handler(signum, frame):
        raise Interrupted(f"signal {signal.Signals(signum).name}")
    signal.signal(signal.SIGTERM, handler)


class Progress:
    """Plain-text progress on rank 0: one line redrawn with \\r on a terminal, otherwise a
    line at every tenth of the epoch (so logs of horovodrun stay short)."""

    def __init__(self, enabled, total, label):
        self.enabled, self.total, self.label = enabled, total, label
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()
        self.next_line = 0

    def update(self, done, loss, force=False):
        if not self.enabled:
            return
        if not self.tty and not force and done < self.next_line:
            return
        self.next_line = done + max(1, self.total // 10)
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        width = 30
        filled = int(width * done / max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        text = (f"{self.label} [{bar}] {done}/{self.total} steps  loss {loss:.4f}  "
                f"{rate:.1f} steps/s  {elapsed:.0f}s")
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", flush=True)

    def close(self):
        if self.enabled and self.tty:
            print(flush=True)


# =============================================================================================
# 5. One epoch of training, one evaluation
# =============================================================================================

def train_epoch(epoch, model, opt, data, args, ctx):
    """Train one epoch on this rank's shard; one row per step in steps_rank<r>.csv."""
    model.train()
    shard = lab_data.train_shard(len(data.train_y), ctx.rank, ctx.size, args.seed, epoch)
    steps = lab_data.batches(shard, args.batch_size)
    progress = Progress(args.progress and ctx.rank == 0, len(steps),
                        f"epoch {epoch}/{args.epochs}")
    timer = runlog.StepTimer()
    loss_sum, samples, bytes_sent = 0.0, 0, 0.0
    pop_stats(opt, ctx)                 # drop anything counted before this epoch
    start = time.perf_counter()
    for batch, index in enumerate(steps):
        with timer("step"):
            with timer("forward_backward"):
                x, y = data.train_x[index], data.train_y[index]
                opt.zero_grad()
                loss = F.nll_loss(model(x), y)
                loss.backward()
            with timer("optimizer"):
                opt.step()              # compress, exchange, decompress, update
        ctx.step += 1
        times, stats = timer.pop(), pop_stats(opt, ctx)
        ctx.steps_log.write(step_record(ctx, epoch, batch, len(index), loss.item(), times, stats))
        ctx.watchdog.beat()             # progress: the job is alive
        loss_sum += loss.item() * len(index)
        samples += len(index)
        bytes_sent += stats["bytes_sent"]
        if (batch + 1) % args.log_interval == 0 or batch + 1 == len(steps):
            progress.update(batch + 1, loss.item(), force=batch + 1 == len(steps))
        if args.max_steps is not None and ctx.step >= args.max_steps and batch + 1 < len(steps):
            progress.close()
            raise Interrupted(f"--max-steps {args.max_steps} reached in epoch {epoch}")
    progress.close()
    epoch_s = time.perf_counter() - start
    totals = hvd.allreduce(torch.tensor([loss_sum, samples, bytes_sent], dtype=torch.float64),
                           op=hvd.Sum, name=f"train_totals.{epoch}")
    return {"epoch": epoch, "steps": len(steps), "train_samples": int(totals[1]),
            "train_loss": float(totals[0] / totals[1]), "epoch_s": epoch_s,
            "train_samples_per_s": float(totals[1]) / epoch_s, "bytes_sent": float(totals[2])}


def step_record(ctx, epoch, batch, samples, loss, times, stats):
    """One row of steps.csv; the update time is step() minus what pop_stats() accounts for."""
    # The plugin compresses full buckets from gradient hooks while backward runs: that part
    # (in_backward_s) is moved from forward+backward to compress, so the columns add up.
    in_backward = stats.get("in_backward_s", 0.0)
    in_step = stats["compress_s"] + stats["communicate_s"] + stats["decompress_s"] - in_backward
    return {"rank": ctx.rank, "epoch": epoch, "step": ctx.step, "batch": batch,
            "samples": samples, "loss": loss, "step_s": times["step"],
            "forward_backward_s": times["forward_backward"] - in_backward,
            "compress_s": stats["compress_s"], "communicate_s": stats["communicate_s"],
            "decompress_s": stats["decompress_s"],
            "update_s": times["optimizer"] - in_step if math.isfinite(in_step)
            else times["optimizer"],
            "bytes_sent": stats["bytes_sent"], "wall_time": time.time()}


def evaluate(epoch, model, data, args, ctx):
    """Test loss and accuracy over the whole test set: each rank scores its own block, then
    the sums and counts are added across ranks (so the result is exact, not an average of
    averages)."""
    model.eval()
    start = time.perf_counter()
    shard = lab_data.eval_shard(len(data.test_y), ctx.rank, ctx.size)
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for index in lab_data.batches(shard, args.test_batch_size):
            output = model(data.test_x[index])
            loss_sum += F.nll_loss(output, data.test_y[index], reduction="sum").item()
            correct += int((output.argmax(dim=1) == data.test_y[index]).sum())
    totals = hvd.allreduce(torch.tensor([loss_sum, correct, len(shard)], dtype=torch.float64),
                           op=hvd.Sum, name=f"test_totals.{epoch}")
    return {"test_samples": int(totals[2]), "test_loss": float(totals[0] / totals[2]),
            "test_accuracy": float(totals[1] / totals[2]),
            "eval_s": time.perf_counter() - start}


def train_all(first_epoch, model, opt, data, args, ctx):
    """The epochs: train, evaluate, record, checkpoint."""
    for epoch in range(first_epoch, args.epochs + 1):
        record = train_epoch(epoch, model, opt, data, args, ctx)
        record.update(evaluate(epoch, model, data, args, ctx))
        ctx.watchdog.beat()
        record["wall_time"] = time.time()
        if ctx.rank == 0:
            ctx.epochs_log.write(record)
            print(f"epoch {epoch}: test loss {record['test_loss']:.4f}, accuracy "
                  f"{100 * record['test_accuracy']:.2f}%, {record['epoch_s']:.1f}s, "
                  f"{record['train_samples_per_s']:.0f} samples/s", flush=True)
        save_checkpoint(ctx, model, opt, epoch)
        if ctx.rank == 0:
            runlog.update_manifest(ctx.run_dir, epochs_completed=epoch)
        ctx.watchdog.beat()
        if args.max_steps is not None and ctx.step >= args.max_steps and epoch < args.epochs:
            raise Interrupted(f"--max-steps {args.max_steps} reached after epoch {epoch}")
    hvd.barrier()                       # every rank has flushed its last row


# =============================================================================================
# 6. Run folder, checkpoint, resume
# =============================================================================================

class Context:
    """What the loop needs besides model/optimizer/data: who we are and where records go."""

    def __init__(self, rank, size, run_dir):
        self.rank, self.size, self.run_dir = rank, size, Path(run_dir)
        self.step = 0
        self.steps_log = None
        self.epochs_log = None
        self.stock_stats = dict(NO_STATS)
        self.watchdog = None


def write_pid_file(ctx):
    """<run>/pids/rank<r>.pid: how tests and users find every process of a run."""
    runlog.atomic_write_text(ctx.run_dir / "pids" / f"rank{ctx.rank}.pid", f"{os.getpid()}\n")


def prepare_run_dir(args, rank, size):
    """Rank 0 decides the folder (and whether it may be used); every rank gets the answer."""
    decision = None
    if rank == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(args.out) if args.out else Path("runs") / (
            f"{config_name(args, size)}-{args.dataset}-{stamp}")
        manifest = runlog.read_manifest(out)
        if args.resume:
            if manifest is None:
                decision = {"error": f"{out}: no manifest.json, nothing to resume"}
            elif not (out / "checkpoint.pt").is_file():
                decision = {"error": f"{out}: no checkpoint.pt (the run stopped before its "
                                     f"first epoch ended); delete the folder and start again"}
            elif manifest.get("world_size") != size:
                decision = {"error": f"{out} was run with {manifest.get('world_size')} "
                                     f"processes; resume it with the same number (now {size})"}
            elif manifest.get("config") != config_name(args, size):
                decision = {"error": f"{out} holds configuration {manifest.get('config')}, "
                                     f"not {config_name(args, size)}; use the same flags"}
        elif out.exists() and any(out.iterdir()):
            decision = {"error": f"{out} already holds a run; pass --resume to continue it "
                                 f"or choose another --out"}
        if decision is None:
            out.mkdir(parents=True, exist_ok=True)
            decision = {"run_dir": str(out)}
    decision = hvd.broadcast_object(decision, root_rank=0, name="run_dir")
    agree(decision.get("error"), rank)
    return Path(decision["run_dir"])


def save_checkpoint(ctx, model, opt, epoch):
    """After each finished epoch: rank 0 writes model, optimizer, position and every rank's
    RNG state (dropout), atomically."""
    rng_states = hvd.allgather_object(torch.get_rng_state(), name=f"rng.{epoch}")
    if ctx.rank == 0:
        runlog.save_checkpoint(ctx.run_dir / "checkpoint.pt", {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
            "step": ctx.step, "world_size": ctx.size, "torch_rng": rng_states})


def restore_checkpoint(ctx, model, opt):
    """--resume: rank 0 reads the checkpoint (other hosts may not see the file); the weights
    reach the other ranks through broadcast_parameters() in main(), the optimizer state and
    the position through broadcast_object() here.  Each rank restores its own RNG state.
    Rows after the checkpoint are dropped so the unfinished epoch is recorded once."""
    position = None
    if ctx.rank == 0:
        state = runlog.load_checkpoint(ctx.run_dir / "checkpoint.pt")
        model.load_state_dict(state["model"])
        position = {k: state[k] for k in ("optimizer", "epoch", "step", "torch_rng")}
    position = hvd.broadcast_object(position, root_rank=0, name="resume_position")
    # Every rank loads the state, so broadcast_optimizer_state() later finds it everywhere
    # (a rank with an empty state would run an initialising step alone and hang).
    opt.load_state_dict(position["optimizer"])
    torch.set_rng_state(position["torch_rng"][ctx.rank])
    ctx.step = position["step"]
    finished = position["epoch"]
    dropped = runlog.truncate_csv(ctx.run_dir / f"steps_rank{ctx.rank}.csv",
                                  lambda row: int(row["epoch"]) <= finished)
    if ctx.rank == 0:
        runlog.truncate_csv(ctx.run_dir / "epochs.csv",
                            lambda row: int(row["epoch"]) <= finished)
    return finished, dropped


# =============================================================================================
# 7. Failing fast: dead and wedged ranks
# =============================================================================================

# Horovod settings that make a broken job end instead of hanging; set before hvd.init() only
# where the user (or horovodrun --gloo-timeout-seconds / --stall-check-*) has not.
HOROVOD_DEFAULTS = {
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "60",          # Gloo gives up on a silent peer (stock: 30)
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "60",      # warn when ranks wait on a tensor others skip
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",  # ... and shut Horovod down (stock: never)
}


def set_horovod_defaults(environ=os.environ):
    for name, value in HOROVOD_DEFAULTS.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in HOROVOD_DEFAULTS}


def start_watchdog(args, ctx):
    """A StepWatchdog (hvd_compress.watchdog) that, before it ends this process, records on
    rank 0 that the run failed, so the manifest never claims 'running' for a dead job."""
    watchdog = StepWatchdog(args.step_timeout or None, rank=ctx.rank)
    end_process = watchdog.on_timeout

    def on_timeout(idle):
        try:
            if ctx.rank == 0:
                finish_manifest(ctx, "failed", f"watchdog: no training step or evaluation "
                                               f"finished for {idle:.0f} s (--step-timeout "
                                               f"{args.step_timeout:g}); a rank is dead or wedged")
        finally:
            end_process(idle)
    watchdog.on_timeout = on_timeout
    return watchdog


# =============================================================================================
# 8. Main
# =============================================================================================

def main(argv=None):
    args = parse_args(argv)
    horovod_env = set_horovod_defaults()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.use_adasum and size > 1 and not hvd.mpi_enabled():
        agree("--use-adasum needs Horovod's MPI controller on CPU: horovodrun --mpi ...", rank)
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Data: every rank reads the files once (md5-checked) into normalised tensors.
    data, error = None, None
    try:
        data = lab_data.load_dataset(args.dataset, args.data_dir, args.split_test)
        lab_data.check_world(len(data.train_y), size, "the training set")
        lab_data.check_world(len(data.test_y), size, "the test set")
    except lab_data.DataError as err:
        error = str(err)
    agree(error, rank)
    if args.cuda:                       # the whole data set fits on a GPU: move it once
        for name in ("train_x", "train_y", "test_x", "test_y"):
            setattr(data, name, getattr(data, name).cuda())

    ctx = Context(rank, size, prepare_run_dir(args, rank, size))
    write_pid_file(ctx)
    model = Net().cuda() if args.cuda else Net()
    opt = make_optimizer(model, args, size)
    ctx.stock_stats = stock_step_stats(model, args, size)

    first_epoch, dropped = 1, 0
    if args.resume:
        finished, dropped = restore_checkpoint(ctx, model, opt)
        first_epoch = finished + 1
    # Horovod: start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    manifest = None
    if rank == 0:
        manifest = start_manifest(ctx, args, opt, data, first_epoch, dropped, horovod_env)
        print(f"run folder {ctx.run_dir}: {manifest['config']}, {size} process(es), "
              f"{args.dataset} {len(data.train_y)} train / {len(data.test_y)} test, "
              f"epochs {first_epoch}..{args.epochs}", flush=True)

    ctx.steps_log = runlog.CsvLog(ctx.run_dir / f"steps_rank{rank}.csv", runlog.STEP_COLUMNS)
    if rank == 0:
        ctx.epochs_log = runlog.CsvLog(ctx.run_dir / "epochs.csv", runlog.EPOCH_COLUMNS)
    stop_on_sigterm()
    status, reason = "failed", None
    ctx.watchdog = start_watchdog(args, ctx)
    try:
        with ctx.watchdog:
            train_all(first_epoch, model, opt, data, args, ctx)
        status = "complete"
    except (Interrupted, KeyboardInterrupt) as stop:
        status, reason = "interrupted", str(stop) or type(stop).__name__
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"
        raise
    finally:
        ctx.steps_log.close()
        if rank == 0:
            finish_manifest(ctx, status, reason)
    if status != "complete":
        if rank == 0:
            how = (f"continue it with --out {ctx.run_dir} --resume"
                   if (ctx.run_dir / "checkpoint.pt").is_file()
                   else f"no epoch finished, so nothing to resume: delete {ctx.run_dir} "
                        f"and start again")
            print(f"run {status}: {reason}; {how}", flush=True)
        sys.exit(3)


def reduction_of(opt, args, world_size):
    """The collective that really carries the gradients (the compressor's default included)."""
    if args.use_adasum:
        return "adasum"
    if args.route == "horovod":
        if world_size == 1:
            return "none"               # Horovod's optimizer skips the exchange at size 1
        return "allgather" if args.compression in ("bit8", "bit16") else "allreduce"
    return opt.communicator.reduction


def start_manifest(ctx, args, opt, data, first_epoch, dropped, horovod_env):
    manifest = runlog.read_manifest(ctx.run_dir) if args.resume else None
    resumes = (manifest or {}).get("resumes", [])
    if args.resume:
        resumes.append({"time": runlog.now_iso(), "from_epoch": first_epoch,
                        "rows_dropped_rank0": dropped})
    env = runlog.environment()
    fresh = {
        "config": config_name(args, ctx.size), "status": "running", "reason": None,
        "args": {k: v for k, v in vars(args).items()}, "world_size": ctx.size,
        "compression": args.compression,
        "route": "horovod" if args.use_adasum else args.route,
        "reduction": reduction_of(opt, args, ctx.size),
        "horovod_env": horovod_env, "step_timeout_s": args.step_timeout,
        "network": emulated_network(),
        "error_feedback": args.error_feedback, "adasum": args.use_adasum,
        "lr_effective": args.lr * (1 if args.use_adasum else ctx.size),
        "controller": "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "none",
        "versions": {k: env[k] for k in ("python", "torch", "horovod", "mpi", "numpy",
                                         "cuda", "hvd_compress")},
        "cpu_model": env["cpu_model"], "hostname": env["hostname"],
        "git_commit": env["git_commit"], "environment": env,
        "data": data.describe(), "run_dir": str(ctx.run_dir.resolve()),
        "start_time": runlog.now_iso(), "start_unix": time.time(), "end_time": None,
        "end_unix": None, "epochs_completed": first_epoch - 1,
        "resumes": resumes,
    }
    if manifest:                       # keep when the run first started
        fresh["start_time"] = manifest.get("start_time", fresh["start_time"])
        fresh["start_unix"] = manifest.get("start_unix", fresh["start_unix"])
    runlog.write_manifest(ctx.run_dir, fresh)
    return fresh


def emulated_network(environ=os.environ):
    """The link scripts/netem.py gave this rank (it sets HVDC_NETEM*), or None: loopback."""
    if environ.get("HVDC_NETEM") != "1":
        return None
    rate = environ.get("HVDC_NETEM_RATE_BPS", "")
    return {"emulated": True, "rate_bps": float(rate) if rate else None,
            "delay_s": float(environ.get("HVDC_NETEM_DELAY_S", "0")),
            "delay_via": environ.get("HVDC_NETEM_DELAY_VIA") or None,
            "mtu": int(environ.get("HVDC_NETEM_MTU", "1500"))}


def finish_manifest(ctx, status, reason):
    """Merge the ranks' step files and record how the run ended."""
    parts = sorted(ctx.run_dir.glob("steps_rank*.csv"),
                   key=lambda p: int(p.stem.replace("steps_rank", "")))
    if parts:
        runlog.merge_csvs(parts, ctx.run_dir / "steps.csv")
    runlog.update_manifest(ctx.run_dir, status=status, reason=reason,
                           end_time=runlog.now_iso(), end_unix=time.time())


if __name__ == "__main__":
    main()
