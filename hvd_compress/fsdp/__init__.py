"""hvd_compress on PyTorch FSDP2 (docs/fsdp.md): the project's codecs on the gradients'
reduce-scatter of every module wrapped by `fully_shard` and, asked for, on the weights'
all-gather, over torch.distributed; the compression state in torch.distributed.checkpoint.

    from torch.distributed.fsdp import fully_shard
    import hvd_compress.fsdp as hcf
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = hcf.register(model, "bit8", error_feedback=True, weights="bit8")
    ...
    hcf.save_checkpoint(path, model, optimizer, state)      # DCP, every rank
    hcf.load_checkpoint(path, model, optimizer, state)

One file per job: front.py (the front: its modules, its core, a step), reduce_scatter.py (the
gradients), all_gather.py (the weights), checkpoint.py (DCP).
"""
from .all_gather import WEIGHT_SCHEMES, CompressedAllGather, NearestInt8
from .checkpoint import load_checkpoint, load_compression_state, save_checkpoint, saved_meta
from .front import FSDPCompression, fsdp_modules
from .reduce_scatter import CompressedReduceScatter

__all__ = ["FSDPCompression", "CompressedReduceScatter", "CompressedAllGather", "NearestInt8",
           "WEIGHT_SCHEMES", "register", "fsdp_modules", "save_checkpoint", "load_checkpoint",
           "load_compression_state", "saved_meta"]


def register(model, compression="bit8", **options):
    """Install `compression` on the gradients' reduce-scatter of every fully_shard module of
    `model` (and options['weights'] on its weights' all-gather; default: FSDP2's own); call it
    on every rank alike, after fully_shard, before the first forward. The FSDPCompression
    (keep it for checkpoints and counters). Options: FSDPCompression's."""
    return FSDPCompression(model, compression, **options)
