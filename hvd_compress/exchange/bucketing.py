"""Which values travel together: bucket membership and the two-phase route's chunks.

The runtime's plan, in pure Python (no torch), so that the cost model reads the very functions
the optimizer and the communicators run instead of keeping copies: exchange/fusion.py builds its
buckets from `groups_by_size`, the two-phase communicator cuts them with `chunk_bounds`, and
costmodel/methods.py counts the bytes of the same buckets and chunks.
"""

__all__ = ["DEFAULT_FUSION_BYTES", "groups_by_size", "backward_buckets", "chunk_bounds"]

# Buckets of at most 1 MiB of float32 (Horovod fuses up to 64 MiB, DDP buckets 25 MiB): small
# enough that the first buckets leave while backward still computes the rest. A tensor larger
# than this travels alone.
DEFAULT_FUSION_BYTES = 1 << 20


def groups_by_size(numels, threshold_bytes):
    """Split range(len(numels)) into consecutive groups of at most `threshold_bytes` float32;
    a tensor larger than the threshold is a group of its own, threshold 0 puts every tensor in
    its own group."""
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    groups, current, current_bytes = [], [], 0
    for i, n in enumerate(numels):
        if current and (threshold_bytes == 0 or current_bytes + 4 * n > threshold_bytes):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += 4 * n
    if current:
        groups.append(current)
    return groups


def backward_buckets(numels, threshold_bytes=DEFAULT_FUSION_BYTES):
    """Value counts of the optimizer's buckets for tensors with these `numels` (in parameter
    order): taken in backward order (last layer first), fused while they fit."""
    backward = list(numels)[::-1]
    return [sum(backward[i] for i in group) for group in groups_by_size(backward, threshold_bytes)]


def chunk_bounds(count, n, align=1):
    """n contiguous chunks (a, b) covering range(count), cut on multiples of `align`, their
    sizes in units of `align` differing by at most one: the two-phase route's chunks."""
    units = -(-count // align) if count else 0
    base, extra = divmod(units, n)
    bounds, start = [], 0
    for k in range(n):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((min(start * align, count), min(stop * align, count)))
        start = stop
    return bounds
