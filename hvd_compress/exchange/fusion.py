"""Buckets: many gradients travel in one collective, with membership fixed once.

A model with many small layers would otherwise pay one collective's latency (and one round of
Horovod's negotiation) per tensor. Membership is decided once, from the parameters' order and
names, identically on every rank, so the order in which gradients arrive during backward
never changes what is summed with what (PyTorch DDP's reducer does the same:
https://pytorch.org/docs/stable/notes/ddp.html#internal-design).
"""
import torch

from .bucketing import groups_by_size

__all__ = ["buckets_by_size", "Bucket", "Filling"]


def buckets_by_size(tensors, threshold_bytes):
    """Split range(len(tensors)) into consecutive buckets of at most `threshold_bytes` float32.

    A tensor larger than the threshold gets a bucket of its own; a threshold of 0 puts every
    tensor in its own bucket (no fusion). The cost model plans from the same function
    (exchange/bucketing.py).
    """
    return groups_by_size([t.numel() for t in tensors], threshold_bytes)


class Bucket:
    """Tensors that travel together: names, shapes, and one flat float32 `buffer`.

    The packet routes reduce `buffer` in place; `load(i, t)` copies member i in, `view(i)` is
    member i's slice of it. The allreduce route fuses nothing itself (Horovod's fusion buffer
    does) and works on `tensor`, one member bound per step: a bucket of one.
    """

    def __init__(self, name, names, tensors, flat=True):
        self.name = name
        self.names = list(names)
        self.shapes = [t.shape for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.offsets = [sum(self.numels[:i]) for i in range(len(tensors))]
        self.numel = sum(self.numels)
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.buffer = torch.empty(self.numel, dtype=torch.float32, device=self.device) if flat else None
        self.tensor = None            # allreduce route: the one member, bound each step
        self._scratch = {}
        self._slices = ([] if self.buffer is None else
                        [self.buffer[o:o + k] for o, k in zip(self.offsets, self.numels)])
        self._views = [s.view(shape) for s, shape in zip(self._slices, self.shapes)]

    def __len__(self):
        return len(self.names)

    def put(self, i, tensor):
        """Member i's gradient for this step: copied into the buffer (converted to float32),
        or, for a bucket without one, bound as it is."""
        if self.buffer is None:
            self.tensor = tensor
        else:
            self._slices[i].copy_(tensor.reshape(-1))

    def put_all(self, members):
        """put(i, t) for every (i, t) of `members`, as one copy op (torch._foreach_copy_): a
        small model's step would otherwise pay one op call per gradient. A gradient that
        already is member i's view of the buffer (see grad_view) needs no copy."""
        if self.buffer is None:
            for i, t in members:
                self.put(i, t)
            return
        pending = [(self._views[i], t) for i, t in members if not self.holds(i, t)]
        if pending:
            dst, src = zip(*pending)
            torch._foreach_copy_(list(dst), list(src))

    def holds(self, i, tensor):
        """Is `tensor` member i's view of the buffer (the gradient written in place)?"""
        view = self._views[i]
        return tensor.data_ptr() == view.data_ptr() and tensor.shape == view.shape and \
            tensor.dtype == view.dtype and tensor.stride() == view.stride()

    def grad_view(self, i):
        """Member i's view of the buffer, if it can serve as the parameter's .grad (float32,
        as the parameter), else None. PyTorch DDP does the same (gradient_as_bucket_view): the
        reduced gradient is not copied back, and a gradient zeroed in place (zero_grad with
        set_to_none=False) is accumulated by autograd straight into the bucket."""
        if self.buffer is None or self.dtypes[i] != torch.float32:
            return None
        return self._views[i]

    def cached(self, key, make):
        """make(), computed once per bucket and key: layouts and views reused every step."""
        if key not in self._scratch:
            self._scratch[key] = make()
        return self._scratch[key]

    def scratch(self, key, numel, dtype, zero=False):
        """A buffer kept with the bucket and reused every step (fresh large tensors cost page
        faults each time); zero=True zeroes it once, when made."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            make = torch.zeros if zero else torch.empty
            buf = self._scratch[key] = make(numel, dtype=dtype, device=self.device)
        return buf

    def view(self, i):
        """Member i's slice of the buffer, in its shape (float32)."""
        return self._slices[i].view(self.shapes[i])

    def result(self, i):
        """Member i after reduction, in its own shape and dtype."""
        if self.buffer is None:
            return self.tensor
        return self.view(i).to(self.dtypes[i])

    @classmethod
    def plan(cls, names, tensors, threshold_bytes, flat=True, prefix=""):
        """Buckets for `tensors` in the order given, fused up to `threshold_bytes` (0 or
        flat=False: one bucket per tensor). Each is named by its first member."""
        groups = buckets_by_size(tensors, threshold_bytes if flat else 0)
        return [(group, cls(prefix + names[group[0]], [names[i] for i in group],
                            [tensors[i] for i in group], flat)) for group in groups]


class Filling:
    """A step's buckets filling as their members' gradients arrive, in any order (a gradient
    hook per parameter): a bucket is filled in one op (Bucket.put_all) when its last member
    is in. `slots`: member -> (bucket index, position in it)."""

    def __init__(self, buckets, slots):
        self.buckets, self.slots = buckets, slots
        self.reset()

    def reset(self):
        self.missing = [len(b) for b in self.buckets]
        self.waiting = [[] for _ in self.buckets]    # (position, gradient) not yet in it
        self.arrived = set()

    def put(self, member, grad):
        """Note `member`'s gradient; the index of its bucket if that is now full (and filled),
        else None."""
        b, j = self.slots[member]
        self.arrived.add(member)
        self.waiting[b].append((j, grad))
        self.missing[b] -= 1
        if self.missing[b]:
            return None
        self.buckets[b].put_all(self.waiting[b])
        return b
