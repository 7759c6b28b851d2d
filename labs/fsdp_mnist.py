#!/usr/bin/env python
"""The lab's MNIST networks on PyTorch FSDP2 (`fully_shard`), with hvd_compress's codecs on the
gradients' reduce-scatter, and the same run records as the Horovod and DDP trainers.

    torchrun --nproc-per-node 2 labs/fsdp_mnist.py                         # FSDP2's own
    torchrun --nproc-per-node 2 labs/fsdp_mnist.py --reduce-dtype bf16     # FSDP2's cast
    torchrun --nproc-per-node 2 labs/fsdp_mnist.py --fsdp-scheme bit8      # hvd_compress.fsdp
    torchrun --nproc-per-node 4 labs/fsdp_mnist.py --fsdp-scheme bf16 --error-feedback

The twin of labs/ddp_mnist.py on FSDP2: the flags, networks, data shards, learning rate and
evaluation are labs/mnist.py's, the books the lab kit's RunRecorder. Every layer that holds
parameters (conv1, conv2, fc1, fc2) is one fully_shard module, the network the root, so each
layer's gradients are reduce-scattered when its backward ends, as a large model's blocks are.
With --fsdp-scheme none FSDP2 keeps its own reduce-scatter; any other scheme registers
hvd_compress.fsdp on every layer (docs/fsdp.md). --reduce-dtype is FSDP2's own
MixedPrecisionPolicy(reduce_dtype=...), the cast FSDP2 offers. Runs are named as the Horovod
ones with '-fsdp' (np2-bit8-fsdp, np2-none-fsdp-bf16reduce).

What FSDP2 changes in the books: each rank holds a shard of every parameter, so the checkpoint
is the full state gathered from every rank (torch.distributed.checkpoint.state_dict's full
state dicts) before rank 0 writes it, and --resume hands rank 0's back to every rank's shard;
the evaluation scores a full copy of the network gathered once per evaluation (FSDP2's forward
all-gathers each layer, so ranks with different numbers of test batches would wait on each
other). The codec's state (error feedback, per rank) is in the checkpoint as the DDP hook's.
"""
import argparse
import hashlib
import inspect
import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hvd_compress.fsdp as hcf
from hvd_compress.engine.distributed import TorchEngine
from hvd_compress.registry import run_name
from labs import mnist
from labs.ddp_mnist import attempt_store, evaluate as scored
from labs.kit import data as lab_data
from labs.kit.flags import DEFAULTS
from labs.kit.ranks import load_data
from labs.kit.recorder import RunRecorder
from labs.kit.table import MODEL_SUFFIX

SCHEMES = ("none", "bit8", "bit16", "bf16", "fp16", "int8")
REDUCE_DTYPES = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS = ("none", "bit8")
FULL = StateDictOptions(full_state_dict=True)


def weights_option():
    """Does this hvd_compress.fsdp take `weights=` (the weights' all-gather compressed)?"""
    return "weights" in inspect.signature(hcf.FSDPCompression.__init__).parameters


def parse_args(argv=None):
    """labs/mnist.py's flags and FSDP2's own: --fsdp-scheme, --reduce-dtype, --fsdp-weights."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--fsdp-scheme", choices=SCHEMES, default="none",
                     help="the gradients' reduce-scatter: none (FSDP2's own, default) or "
                          "hvd_compress.fsdp's codec")
    own.add_argument("--reduce-dtype", choices=sorted(REDUCE_DTYPES), default="float32",
                     help="FSDP2's MixedPrecisionPolicy(reduce_dtype=...) (default float32)")
    own.add_argument("--fsdp-weights", choices=WEIGHTS, default="none",
                     help="the weights' all-gather: none (FSDP2's own) or bit8 (block-scaled "
                          "8-bit codes; needs an hvd_compress.fsdp whose register takes "
                          "weights=)")
    own.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=None,
                     help="keep each rank's codec error and add it to its next step (packet "
                          "schemes; default: the scheme's own)")
    extra, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        own.print_help()
    args = mnist.parse_args(rest)
    if args.compression != "none" or args.route is not None:
        sys.exit("error: the lab's compression flags and --route are the allreduce's; under "
                 "FSDP2 choose the reduce-scatter's codec with --fsdp-scheme")
    if args.use_adasum or args.optimizer == "horovod":
        sys.exit("error: --use-adasum and --optimizer horovod are Horovod's; this is FSDP2")
    args.error_feedback = extra.error_feedback      # the lab's check wants an allreduce flag
    if extra.fsdp_scheme == "none" and args.error_feedback:
        sys.exit("error: --error-feedback needs a codec (--fsdp-scheme bit8, ...)")
    if extra.fsdp_weights != "none" and not weights_option():
        sys.exit("error: --fsdp-weights: this hvd_compress.fsdp's register() takes no "
                 "weights= (the weights' all-gather is FSDP2's own)")
    args.fsdp_scheme, args.fsdp_weights = extra.fsdp_scheme, extra.fsdp_weights
    args.reduce_dtype = extra.reduce_dtype
    args.compression = extra.fsdp_scheme        # what the manifest and the table read
    return args


def config_name(args, world_size):
    """np2-bit8-fsdp; FSDP2's cast np2-none-fsdp-bf16reduce; weights compressed -w8."""
    variant = "fsdp" + ("" if args.reduce_dtype == "float32" else f"-{args.reduce_dtype}reduce")
    if args.fsdp_weights != "none":
        variant += "-w8"
    name = run_name(world_size, args.fsdp_scheme, error_feedback=bool(args.error_feedback),
                    variant=variant)
    return name if args.model == DEFAULTS["model"] else f"{name}-{MODEL_SUFFIX[args.model]}"


def shard(model, mesh, reduce_dtype=None):
    """fully_shard every layer that holds parameters of its own, then the network (the root):
    each layer one reduce-scatter, when its backward ends."""
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in model.children():
        if any(True for _ in layer.parameters(recurse=False)):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def reduce_scatter_bytes(model, n, item):
    """Bytes one rank sends a step in FSDP2's own reduce-scatter: (n - 1) shards of every
    parameter padded to n equal dim-0 chunks, `item` bytes a value (the reduce dtype's)."""
    total = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // n)                   # FSDP2's chunk: ceil(dim0 / n) rows
        total += rows * (p.numel() // p.shape[0]) * item
    return (n - 1) * total


class ShardedOptimizer:
    """The SGD the loop steps, with what the recorder asks of an optimizer: the codec's
    counters and state, and full state dicts for the checkpoint (the recorder's rank 0 writes
    them, so every rank gathers them first: gather_state). FSDP2 reduce-scatters inside
    backward, so all of the codec's time is reported as in_backward_s, as the DDP trainer's."""

    def __init__(self, base, model, state, fixed_bytes):
        self._base, self._model, self._state = base, model, state
        self._fixed_bytes, self._full = fixed_bytes, None
        # FSDP2's own reduce-scatter: what the manifest asks of a communicator
        self.communicator = state.communicator if state is not None else SimpleNamespace(
            route=SimpleNamespace(value="reduce_scatter"), codec_path=lambda: "none")
        self._memory = state.memory if state is not None else None

    def __getattr__(self, name):
        return getattr(self._base, name)

    def step(self, closure=None):
        return self._base.step(closure)

    def zero_grad(self, set_to_none=True):
        return self._base.zero_grad(set_to_none=set_to_none)

    def gather_state(self):
        """Every rank alike, before the recorder's checkpoint: the full optimizer state."""
        self._full = get_optimizer_state_dict(self._model, self._base, options=FULL)

    def state_dict(self):
        return self._full

    def load_state_dict(self, state):
        """The recorder hands every rank the checkpoint's full optimizer state."""
        set_optimizer_state_dict(self._model, self._base, state, options=FULL)

    def pop_stats(self):
        if self._state is None:      # FSDP2's own: bytes by its layout, no phase of ours
            return {"copy_s": 0.0, "compress_s": 0.0, "communicate_s": float("nan"),
                    "decompress_s": 0.0, "bytes_sent": self._fixed_bytes, "in_backward_s": 0.0,
                    "exchange_s": float("nan"), "launch_span_s": float("nan")}
        stats = self._state.pop_stats()
        stats["in_backward_s"] = sum(stats.get(k, 0.0) for k in (
            "copy_s", "compress_s", "communicate_s", "decompress_s"))
        stats.setdefault("copy_s", 0.0)
        return stats

    def plan_report(self):
        return None

    def compression_state_dict(self):
        return self._state.compression_state_dict() if self._state is not None else None

    def load_compression_state_dict(self, state):
        if self._state is not None and state is not None:
            self._state.load_compression_state_dict(state)


class FullModel:
    """The sharded network as the recorder sees it: state_dict() the full state gathered by
    gather_state() (every rank alike, before a checkpoint); load_state_dict() on rank 0 keeps
    the checkpoint's until restore() hands it to every rank's shards."""

    def __init__(self, model):
        self.model, self._full, self._loaded = model, None, None

    def gather_state(self, engine, epoch):
        """Every rank alike: the full state, and a check that every rank gathered the same
        bits (an all-gather that handed ranks different weights would train different
        models unnoticed); rank 0 says the digest."""
        self._full = get_model_state_dict(self.model, options=FULL)
        digest = hashlib.sha256()
        for name, tensor in sorted(self._full.items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests = engine.allgather_object(digest.hexdigest(), f"state_digest.{epoch}")
        if len(set(digests)) != 1:
            raise RuntimeError(f"epoch {epoch}: the ranks gathered different full states "
                               f"({', '.join(d[:12] for d in digests)})")
        if engine.rank() == 0:
            print(f"epoch {epoch}: every rank holds the same full state (sha256 "
                  f"{digests[0][:16]})", flush=True)

    def state_dict(self):
        return self._full

    def load_state_dict(self, state):
        self._loaded = state

    def restore(self, resumed):
        """Every rank, after the recorder's resume: rank 0's checkpoint into every shard."""
        if resumed:
            set_model_state_dict(self.model, self._loaded or {}, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True))
        self._loaded = None


def train(epoch, model, optimizer, data, args, run, replica):
    model.train()
    shard_ = lab_data.train_shard(len(data.train_y), run.rank, run.size, args.seed, epoch)
    batches = lab_data.batches(shard_, args.batch_size)[:args.steps_per_epoch]
    validate = None if data.holdout_x is None else (
        lambda: evaluate(model, replica, data.holdout_x, data.holdout_y, args, run, "holdout"))
    for step in run.steps(epoch, batches, validate):
        with step.timer("forward_backward"):
            x, y = data.train_x[step.index], data.train_y[step.index]
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()             # each layer's reduce-scatter runs in here
        with step.timer("optimizer"):
            optimizer.step()            # each rank updates its shards
        step.loss = loss.item()


def evaluate(model, replica, images, labels, args, run, split):
    """labs/mnist.py's evaluation on a full copy of the network (gathered once, every rank
    alike): each rank scores its block, the sums added across ranks."""
    replica.load_state_dict(get_model_state_dict(model, options=FULL))
    return scored(replica, images, labels, args, run, run.engine, split)


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:        # python labs/fsdp_mnist.py: a job of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    dist.init_process_group("nccl" if args.cuda else "gloo", timeout=timedelta(seconds=300),
                            **attempt_store())
    engine = TorchEngine()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)        # every rank makes the same weights: FSDP2 shards its own
    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    data = load_data(args, device, engine)
    run = RunRecorder(args, config_name(args, engine.size()), engine)
    n = engine.size()
    model = mnist.MODELS[args.model]().to(device)
    replica = mnist.MODELS[args.model]().to(device)
    mesh = init_device_mesh(device.type, (n,))
    reduce_dtype = REDUCE_DTYPES[args.reduce_dtype]
    shard(model, mesh, reduce_dtype)
    item = 4 if reduce_dtype is None else 2
    state = None
    if args.fsdp_scheme != "none" or args.fsdp_weights != "none":
        options = {"error_feedback": args.error_feedback, "scale_block": args.scale_block}
        if args.fsdp_weights != "none":
            options["weights"] = args.fsdp_weights
        state = hcf.register(model, args.fsdp_scheme, **options)
    base = optim.SGD(model.parameters(), lr=args.lr * n, momentum=args.momentum)
    optimizer = ShardedOptimizer(base, model, state, reduce_scatter_bytes(model, n, item))
    books = FullModel(model)
    first_epoch = run.resume(books, optimizer)
    books.restore(args.resume and first_epoch > 1)
    try:
        with run.recording(optimizer, data):
            for epoch in range(first_epoch, args.epochs + 1):
                train(epoch, model, optimizer, data, args, run, replica)
                metrics = evaluate(model, replica, data.test_x, data.test_y, args, run, "test")
                books.gather_state(engine, epoch)
                optimizer.gather_state()
                run.end_epoch(epoch, metrics, books, optimizer)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
