"""Bucketing: many small gradients travel in one collective, as Horovod's fusion buffer does.

A model with many small layers would otherwise pay one collective's latency (and one round
of Horovod's negotiation) per tensor. Buckets are formed in the order the tensors are given
(the optimizer's fixed parameter order), so every rank forms the same buckets.
"""
import torch

__all__ = ["buckets_by_size", "flatten"]


def buckets_by_size(tensors, threshold_bytes):
    """Split range(len(tensors)) into consecutive buckets of at most `threshold_bytes` float32.

    A tensor larger than the threshold gets a bucket of its own; a threshold of 0 puts every
    tensor in its own bucket (no fusion).
    """
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    buckets, current, current_bytes = [], [], 0
    for i, t in enumerate(tensors):
        size = 4 * t.numel()
        if current and (threshold_bytes == 0 or current_bytes + size > threshold_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def flatten(tensors):
    """One contiguous float32 vector holding all tensors' values, in order."""
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1).to(torch.float32)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])

