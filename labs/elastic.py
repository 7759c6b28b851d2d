#!/usr/bin/env python
"""The lab's trainer under Horovod's elastic mode: ranks may die and join while it trains.

    echo -e "localhost:1\\n127.0.0.1:1\\n$(hostname):1" > runs/hosts
    HVDC_HOSTS_FILE=runs/hosts horovodrun -np 3 --min-np 2 --max-np 3 \\
        --host-discovery-script scripts/discover_hosts.sh --blacklist-cooldown-range 5 10 \\
        python labs/elastic.py --dataset fashion-mnist --epochs 3 --bit8-allreduce --out runs/elastic

Same model, data and flags as labs/mnist.py (plus --commit-every), the training loop inside
`hvd.elastic.run`. Every --commit-every steps the state is committed: model, optimizer, epoch,
and the position in the epoch's shuffled order. When a rank dies, the others roll back to the
last commit and go on with fewer ranks; when the discovery script lists a slot again, a rank
starts there, receives the committed state, and joins. Horovod blacklists a host whose worker
failed, so on one machine each slot needs a host name of its own (three names of this machine
above); --blacklist-cooldown-range lets a failed slot come back.

What follows the world size, and why:
- Data: each epoch is one shuffled order of the whole set (a function of seed and epoch);
  a step takes the next world_size x batch_size samples of it, rank r every world_size-th. The
  committed position is global, so after a change no sample of the epoch is used twice or
  skipped (the last world_size - 1 at most are dropped).
- Learning rate: lr x world size (the lab's rule), set again after every change.
- Error-feedback residuals and PowerSGD's Q: reset to zero / their seeded start on every rank
  at every change. A dead rank's residual is gone, a new rank has none, and rolling back to the
  commit would leave the others' residuals ahead of the parameters they belong to.
- Buckets are fixed by parameters, not ranks; the two-phase chunks and the byte counts are
  computed from the current world size at every step.

Records (rank 0, in --out): steps.csv gets a step's row only when the commit that covers it is
made, so a rolled-back step is never written twice; each row has the world size it ran at.
epochs.csv as the lab's; manifest.json lists every membership change with its time, the
world size after it and the steps rolled back.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd
from horovod.common.elastic import run_fn

import hvd_compress as hc
from labs.kit import data as lab_data
from labs.kit import runlog
from labs.kit.flags import compression_of
from labs.kit.ranks import set_horovod_defaults
from labs.mnist import MODELS, parse_args as parse_lab_args, test

STEP_COLUMNS = ["epoch", "step", "world_size", "samples", "loss", "step_s", "bytes_sent",
                "wall_time"]
EPOCH_COLUMNS = ["epoch", "world_size", "steps", "test_samples", "test_loss", "test_accuracy",
                 "eval_s", "wall_time"]

# Gloo has one timeout (HOROVOD_GLOO_TIMEOUT_SECONDS, read at every hvd.init()) for two waits: a
# rendezvous waiting for processes that are still starting (a joining rank imports torch and
# loads the data: seconds, many on a loaded machine), and a collective waiting for a rank that
# died (the survivor that does not see the dead rank's socket close waits all of it out). So
# every init is done twice (init_twice): first with JOIN_TIMEOUT_S, used only by that
# rendezvous (Horovod is shut down again at once), then among processes that are all running,
# with the detection timeout, which the training's collectives use.
GLOO_TIMEOUT = "HOROVOD_GLOO_TIMEOUT_SECONDS"
JOIN_TIMEOUT_S = 60
DETECT_TIMEOUT_S = 10


def parse_args(argv=None):
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--commit-every", type=int, default=20, metavar="N",
                       help="commit the training state every N steps (default 20): what a "
                            "failure can cost")
    ours, rest = extra.parse_known_args(argv)
    if ours.commit_every < 1:
        extra.error(f"--commit-every must be at least 1, got {ours.commit_every}")
    args = parse_lab_args(rest)
    for flag, why in (("resume", "elastic training resumes by itself"),
                      ("use_adasum", "Adasum needs the stock optimizer"),
                      ("max_steps", "not with elastic training"),
                      ("steps_per_epoch", "not with elastic training")):
        if getattr(args, flag):
            extra.error(f"--{flag.replace('_', '-')}: {why}")
    if args.momentum == 0:
        extra.error("--momentum 0: elastic training needs momentum > 0 (the optimizer state "
                    "a joining rank receives is made of momentum buffers)")
    if args.optimizer == "horovod":
        extra.error("--optimizer horovod: labs/elastic.py trains with hvd_compress's optimizer")
    if not args.out:
        extra.error("--out RUN_FOLDER is required (ranks come and go; the folder is shared)")
    args.commit_every = ours.commit_every
    return args


def global_batch(order, position, rank, world_size, batch_size):
    """This rank's indices for the step at `position` of the epoch's `order`: the next
    world_size x batch_size samples (fewer at the end, cut to a multiple of world_size),
    every world_size-th from rank. Empty once fewer than world_size samples are left."""
    take = min(world_size * batch_size, len(order) - position)
    take -= take % world_size
    return order[position + rank:position + take:world_size], take


class Books:
    """Rank 0's records. Rows wait in memory until the commit that covers them."""

    def __init__(self, out, args):
        self.out = Path(out)
        self.pending_steps, self.pending_epochs = [], []
        if hvd.rank() == 0 and runlog.read_manifest(self.out) is None:
            self.out.mkdir(parents=True, exist_ok=True)
            runlog.write_manifest(self.out, {
                "config": f"elastic-{args.compression}", "status": "running", "reason": None,
                "args": dict(vars(args)), "compression": args.compression,
                "start_time": runlog.now_iso(), "start_unix": time.time(), "end_time": None,
                "membership": [{"time": runlog.now_iso(), "unix": time.time(),
                                "event": "start", "world_size": hvd.size()}]})

    def commit(self):
        """Write the rows of the steps the commit just saved (rank 0)."""
        if hvd.rank() == 0:
            with runlog.CsvLog(self.out / "steps.csv", STEP_COLUMNS) as log:
                for row in self.pending_steps:
                    log.write(row)
            with runlog.CsvLog(self.out / "epochs.csv", EPOCH_COLUMNS) as log:
                for row in self.pending_epochs:
                    log.write(row)
        self.pending_steps, self.pending_epochs = [], []

    def membership(self, state):
        """A change of ranks: the uncommitted rows are dropped (those steps are redone)."""
        lost = len(self.pending_steps)
        self.pending_steps, self.pending_epochs = [], []
        if hvd.rank() == 0:
            manifest = runlog.read_manifest(self.out)
            manifest["membership"].append({
                "time": runlog.now_iso(), "unix": time.time(), "event": "reset",
                "world_size": hvd.size(), "resumed_at_step": state.step,
                "epoch": state.epoch, "steps_rolled_back": lost})
            runlog.write_manifest(self.out, manifest)

    def finish(self, status, reason=None):
        if hvd.rank() == 0:
            runlog.update_manifest(self.out, status=status, reason=reason,
                                   end_time=runlog.now_iso(), end_unix=time.time())


def init_twice(detect_s):
    """hvd.init() for the rendezvous with processes still starting (JOIN_TIMEOUT_S), then again
    among running processes with `detect_s`, the timeout the collectives keep: how long a
    survivor may wait for a rank that died. Each init is a round of Horovod's elastic driver;
    every rank makes both, at the start and at every reset."""
    os.environ[GLOO_TIMEOUT] = str(max(JOIN_TIMEOUT_S, detect_s))
    hvd.init()
    hvd.shutdown()
    os.environ[GLOO_TIMEOUT] = str(detect_s)
    hvd.init()


def main(argv=None):
    args = parse_args(argv)
    # A rank that dies is seen at once by its ring neighbours; another waits in a collective
    # until Gloo's timeout: DETECT_TIMEOUT_S unless set (horovodrun --gloo-timeout-seconds).
    detect_s = int(os.environ.get(GLOO_TIMEOUT, DETECT_TIMEOUT_S))
    set_horovod_defaults()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    # Before hvd.init(): the others wait for a joining rank in the rendezvous (JOIN_TIMEOUT_S),
    # not in a collective. No collective before the elastic loop: a rank that joins later
    # would wait in it alone.
    data = lab_data.load_dataset(args.dataset, args.data_dir, args.split_test)
    args.dataset = data.name                 # the records name the set actually loaded
    init_twice(detect_s)
    if data.note and hvd.rank() == 0:        # MNIST missing offline: Fashion-MNIST, said once
        print(data.note, flush=True)
    model = MODELS[args.model]()
    base = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hc.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=compression_of(args), route=args.route,
                                        scale_block=args.scale_block,
                                        error_feedback=args.error_feedback)
    # Horovod's broadcast_optimizer_state (TorchState.sync) fills an empty optimizer state by
    # a step, which for a wrapper it does not know is a collective: a rank that joins later
    # would run it alone and wait forever. An SGD step of zero gradients made here, locally,
    # creates the same state (zero momentum buffers) and leaves the parameters as they are.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    super(type(optimizer), optimizer).step()
    optimizer.zero_grad()
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=1, position=0,
                                   step=0)
    books = Books(args.out, args)
    pids = Path(args.out) / "pids"

    def on_reset():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        optimizer.reset_compression_state()
        books.membership(state)

    state.register_reset_callbacks([on_reset])

    def train(state):
        pids.mkdir(parents=True, exist_ok=True)
        # "pid host": which process to stop and which slot it holds (tests, docs/reliability.md)
        (pids / f"rank{hvd.rank()}").write_text(f"{os.getpid()} {os.environ.get('HOROVOD_HOSTNAME', '')}")
        while state.epoch <= args.epochs:
            model.train()
            order = lab_data.epoch_permutation(len(data.train_y), args.seed, state.epoch)
            while True:
                index, taken = global_batch(order, state.position, hvd.rank(), hvd.size(),
                                            args.batch_size)
                if taken == 0:
                    break
                start = time.perf_counter()
                optimizer.zero_grad()
                loss = F.nll_loss(model(data.train_x[index]), data.train_y[index])
                loss.backward()
                optimizer.step()
                stats = optimizer.pop_stats()
                state.position += taken
                state.step += 1
                books.pending_steps.append({
                    "epoch": state.epoch, "step": state.step, "world_size": hvd.size(),
                    "samples": taken, "loss": loss.item(),
                    "step_s": time.perf_counter() - start,
                    "bytes_sent": stats["bytes_sent"], "wall_time": time.time()})
                if state.step % args.commit_every == 0:
                    commit(state)
            run = argparse.Namespace(rank=hvd.rank(), size=hvd.size(), step=state.step)
            metrics = test(state.epoch, model, data, args, run)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: test accuracy {100 * metrics['test_accuracy']:.2f}% "
                      f"on {hvd.size()} ranks, step {state.step}", flush=True)
            books.pending_epochs.append(dict(
                {k: metrics[k] for k in ("test_samples", "test_loss", "test_accuracy", "eval_s")},
                epoch=state.epoch, world_size=hvd.size(), steps=state.step, wall_time=time.time()))
            state.epoch += 1
            state.position = 0
            commit(state)

    def commit(state):
        # save, write the rows it covers, then let Horovod raise for a change of hosts: a row
        # is on disk only once its step can never be rolled back
        state.save()
        books.commit()
        state.check_host_updates()

    def reset():
        hvd.shutdown()
        init_twice(detect_s)

    # hvd.elastic.run's loop, with its reset (shutdown, init) making both inits
    try:
        run_fn(train, reset)(state)
    except BaseException as err:
        books.finish("failed", f"{type(err).__name__}: {err}")
        raise
    books.finish("complete")


if __name__ == "__main__":
    sys.exit(main())
