"""The buckets that travel through both engines (engine_digests.py here, on Horovod,
tests/ddp_workers/hook_checks.py on DDP), and how their results are compared: the same flat
buckets, rank by rank and step by step, and a digest of every result's bits."""
import hashlib

import torch

# (label, scheme, route, error feedback): every route whose reduction is the plugin's own code
# (decode and sum in rank order), so the two engines must agree bit for bit. The allreduce
# route is not here: Horovod averages by summing then dividing, DDP (and our hook on it) by
# dividing then summing; each equals its own engine's stock path instead (test_ddp.py).
CASES = [
    ("bit8:allgather", "bit8", "allgather", False),
    ("bit8:alltoall", "bit8", "alltoall", False),
    ("bit8:alltoall+ef", "bit8", "alltoall", True),
    ("bit16:alltoall", "bit16", "alltoall", False),
    ("bit16:allgather", "bit16", "allgather", False),
    ("bf16:alltoall", "bf16", "alltoall", False),
    ("int8:allgather", "int8", "allgather", False),
    ("onebit:allgather", "onebit", "allgather", True),
    ("topk:allgather", "topk", "allgather", True),
]
SHAPES = [(64, 100), (100,), (7, 3, 3), (1000,)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
STEPS = 3


def bucket(step, rank):
    """Rank `rank`'s flat bucket at `step`: gradient-like values, magnitudes over 7 decades."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(NUMEL, generator=g) * 10.0 ** torch.randint(-6, 1, (NUMEL,), generator=g).float()


def digest(tensors):
    """sha256 of the bits of `tensors`, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
