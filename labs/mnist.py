#!/usr/bin/env python
"""Course lab: Horovod's PyTorch MNIST example with compressed gradients, timed step by step.

    python labs/mnist.py                                         # serial (world size 1)
    horovodrun -np 2 --gloo python labs/mnist.py --bit8-allreduce  # 2 processes, 8-bit gradients
    horovodrun -np 4 --gloo python labs/mnist.py --bit16-allreduce
    horovodrun -np 2 --gloo python labs/mnist.py --auto-allreduce  # each bucket's scheme measured

The flags of Horovod's examples/pytorch/pytorch_mnist.py plus the course's compression
switches; the network, lr, momentum and epochs default to the lab's own (docs/lab.md,
"Defaults").  Gradients go through hvd_compress.DistributedOptimizer, which times each phase
and counts the bytes sent; `--optimizer horovod` and --use-adasum use Horovod's own optimizer.
The lab kit's RunRecorder (labs/kit/recorder.py) keeps the books: run folder, CSV files,
manifest, checkpoints, --resume, the watchdog.  See docs/run-folder.md.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import horovod.torch as hvd

import hvd_compress as hc
from hvd_compress.codecs import SCALE_BLOCK
from labs.kit import data as lab_data
from labs.kit.flags import (DEFAULTS, add_auto_flags, add_compression_flags, check_args,
                            compression_of, scale_block)
from labs.kit.ranks import agree, load_data, set_horovod_defaults
from labs.kit.recorder import RunRecorder
from labs.kit.watchdog import FLOOR_S
from labs.kit.table import config_name


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Horovod MNIST with 8/16-bit gradient compression (course lab)")
    # --- the flags of Horovod's pytorch_mnist.py ---
    parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                        help="input batch size for training, per rank (default: 64)")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N",
                        help="input batch size for testing (default: 1000)")
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], metavar="N",
                        help=f"number of epochs to train (default: {DEFAULTS['epochs']}; "
                             "Horovod's example: 10)")
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"], metavar="LR",
                        help="learning rate, multiplied by the world size (default: "
                             f"{DEFAULTS['lr']}; Horovod's example: 0.01)")
    parser.add_argument("--momentum", type=float, default=DEFAULTS["momentum"], metavar="M",
                        help=f"SGD momentum (default: {DEFAULTS['momentum']}; Horovod's "
                             "example: 0.5)")
    parser.add_argument("--seed", type=int, default=42, metavar="S",
                        help="random seed (default: 42)")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                        help="batches between progress updates (default: 10)")
    parser.add_argument("--no-cuda", action="store_true", default=False,
                        help="disables CUDA training")
    parser.add_argument("--use-adasum", action="store_true", default=False,
                        help="use Horovod's Adasum reduction (stock optimizer, not timed)")
    # --- one switch per compression scheme (hvd_compress/registry.py, plugins included) ---
    add_compression_flags(parser.add_mutually_exclusive_group())
    add_auto_flags(parser)
    # --- the course's additions ---
    parser.add_argument("--optimizer", choices=["plugin", "horovod"], default="plugin",
                        help="plugin: hvd_compress.DistributedOptimizer, timed phase by phase "
                             "(default); horovod: Horovod's own hvd.DistributedOptimizer of "
                             "the patched Horovod (whole-step times only)")
    parser.add_argument("--route", choices=["allgather", "alltoall"], default=None,
                        help="the collective packet codes travel by, as the plugin's route= "
                             "(default: the compressor's own)")
    parser.add_argument("--scale-block", type=scale_block, default=SCALE_BLOCK,
                        metavar="N|tensor",
                        help="bit8/bit16: values per power-of-two scale in a bucket (default "
                             f"{SCALE_BLOCK}); 'tensor': one scale per tensor, no "
                             "fusion, the course's packets (what --optimizer horovod sends)")
    parser.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=None,
                        help="keep each rank's compression error and add it to the next step "
                             "(default: the method's own: on for 1-bit, top-k and PowerSGD)")
    parser.add_argument("--dataset", choices=sorted(lab_data.DATASETS), default=None,
                        help="mnist or fashion-mnist (Debian's dataset-fashion-mnist); default: "
                             "MNIST, found in data/ or downloaded there, else Fashion-MNIST "
                             "(offline: said in one line at the start)")
    parser.add_argument("--data-dir", default=None,
                        help="folder holding the IDX .gz files (MNIST: downloaded there if "
                             "missing and online)")
    parser.add_argument("--split-test", type=int, default=None, metavar="N",
                        help="train on the first N test images, evaluate on the rest")
    parser.add_argument("--holdout", type=int, default=None, metavar="K",
                        help="set the training set's last K images aside and score them after "
                             "every epoch (evals.csv): steps to a target accuracy are counted "
                             "on them, never on the test set")
    parser.add_argument("--eval-every", type=int, default=None, metavar="N",
                        help="with --holdout: score the held-out images every N training steps "
                             "too, between two steps (outside their time)")
    parser.add_argument("--target-accuracy", type=float, default=None, metavar="A",
                        help="with --holdout: end the run (complete) at the first evaluation "
                             "whose held-out accuracy is at least A, e.g. 0.885")
    # --- the run's records (labs/kit/recorder.py) ---
    parser.add_argument("--out", default=None,
                        help="run folder (default: runs/<configuration>-<time>)")
    parser.add_argument("--resume", action="store_true", default=False,
                        help="continue the interrupted run in --out from its last checkpoint")
    parser.add_argument("--max-steps", type=int, default=None, metavar="N",
                        help="stop after N training steps in total (smoke tests), exit code 0; "
                             "the run is recorded as interrupted and --resume continues it")
    parser.add_argument("--steps-per-epoch", type=int, default=None, metavar="N",
                        help="train only the first N steps of each epoch's shard, then evaluate "
                             "(timing runs: the run matrix's network table)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show a progress bar on rank 0 (default: on)")
    parser.add_argument("--num-threads", type=int, default=1, metavar="N",
                        help="torch CPU threads per rank (default: 1, like Horovod's example)")
    parser.add_argument("--model", choices=sorted(MODELS), default=DEFAULTS["model"],
                        help="basic: pytorch/examples' network (1.2 M parameters, default); "
                             "horovod: Horovod's small one (21,840; a run's name gets -small)")
    parser.add_argument("--step-timeout", type=float, default=None, metavar="SECONDS",
                        help="end the job if no training step or evaluation finishes for this "
                             "long: another rank is dead or wedged (default: adaptive, 10x the "
                             "slowest seen, at least 20 s; 0 disables)")
    parser.add_argument("--step-timeout-floor", type=float, default=FLOOR_S, metavar="SECONDS",
                        help="the adaptive limit's least value (default: %(default)g s): lower, a "
                             "wedged rank of a run whose steps are fast is caught sooner (the "
                             "failure tests)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    return args


class Net(nn.Module):
    """Horovod's example network: two convolutions, two linear layers."""

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


class BasicNet(nn.Module):
    """pytorch/examples' mnist/main.py network: 1,199,882 parameters, 4.8 MB of gradients a
    step, 55x the small network's (most of them in fc1)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


MODELS = {"horovod": Net, "basic": BasicNet}


def make_optimizer(model, args, world_size):
    """SGD, wrapped so that step() first averages the gradients over the ranks."""
    lr_scaler = 1 if args.use_adasum else world_size   # Adasum needs no lr scaling
    base = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    if args.use_adasum or args.optimizer == "horovod":
        # Horovod's own optimizer, exactly as a course script calls it; with the course's
        # patch, hvd.Compression.bit8/.bit16 exist and travel by allgather.
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        compression=getattr(hvd.Compression, args.compression),
                                        op=hvd.Adasum if args.use_adasum else hvd.Average)
    return hc.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=compression_of(args),
                                   op=hvd.Average, route=args.route,
                                   scale_block=args.scale_block,
                                   error_feedback=args.error_feedback)


def train(epoch, model, optimizer, data, args, run):
    """One epoch on this rank's shard; the recorder times each step and writes its row, and
    with --holdout scores the held-out images between steps (validate)."""
    model.train()
    shard = lab_data.train_shard(len(data.train_y), run.rank, run.size, args.seed, epoch)
    batches = lab_data.batches(shard, args.batch_size)[:args.steps_per_epoch]
    validate = None if data.holdout_x is None else (
        lambda: evaluate(model, data.holdout_x, data.holdout_y, args, run, "holdout"))
    for step in run.steps(epoch, batches, validate):
        with step.timer("forward_backward"):
            x, y = data.train_x[step.index], data.train_y[step.index]
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
        with step.timer("optimizer"):
            optimizer.step()            # compress, exchange, decompress, update
        step.loss = loss.item()


def evaluate(model, images, labels, args, run, split):
    """Loss and accuracy over `images`: each rank scores its own block, then the sums and
    counts are added across ranks (exact, not an average of averages)."""
    model.eval()
    start = time.perf_counter()
    shard = lab_data.eval_shard(len(labels), run.rank, run.size)
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for index in lab_data.batches(shard, args.test_batch_size):
            output = model(images[index])
            loss_sum += F.nll_loss(output, labels[index], reduction="sum").item()
            correct += int((output.argmax(dim=1) == labels[index]).sum())
    totals = hvd.allreduce(torch.tensor([loss_sum, correct, len(shard)], dtype=torch.float64),
                           op=hvd.Sum, name=f"{split}_totals.{run.step}")
    model.train()
    return {f"{split}_samples": int(totals[2]), f"{split}_loss": float(totals[0] / totals[2]),
            f"{split}_accuracy": float(totals[1] / totals[2]),
            "eval_s": time.perf_counter() - start}


def test(epoch, model, data, args, run):
    """Test loss and accuracy over the whole test set, after each epoch."""
    return evaluate(model, data.test_x, data.test_y, args, run, "test")


def main(argv=None):
    args = parse_args(argv)
    set_horovod_defaults()              # a dead or silent rank ends the job, never hangs it
    hvd.init()
    if args.use_adasum and hvd.size() > 1 and not hvd.mpi_enabled():
        agree("--use-adasum needs Horovod's MPI controller on CPU: horovodrun --mpi ...")
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    device = torch.device("cuda" if args.cuda else "cpu")
    data = load_data(args, device)      # MNIST (found or downloaded) or offline Fashion-MNIST

    run = RunRecorder(args, config_name(args, hvd.size()))
    model = MODELS[args.model]().to(device)
    optimizer = make_optimizer(model, args, hvd.size())
    first_epoch = run.resume(model, optimizer)
    # Horovod: start every rank from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    with run.recording(optimizer, data):
        for epoch in range(first_epoch, args.epochs + 1):
            train(epoch, model, optimizer, data, args, run)
            run.end_epoch(epoch, test(epoch, model, data, args, run), model, optimizer)


if __name__ == "__main__":
    main()
