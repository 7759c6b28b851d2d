"""Run under horovodrun (tests/workers/suite.py, or alone): gradients as views of the bucket
(fusion.Bucket.grad_view), on real ranks.

After step() every float32 gradient of a packet route is its bucket's slice (no copy back);
a gradient zeroed in place is accumulated by autograd straight into the bucket (no copy in);
and training gives the same bits whichever way the gradients were zeroed, and with the
per-tensor course packets; a float64 parameter keeps its own gradient."""
import copy

import torch
import horovod.torch as hvd

import hvd_compress as hc
import checks

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 9)
        self.b = torch.nn.Linear(9, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def train(model, set_to_none, steps=2, **kwargs):
    """Two steps: the first makes the gradients; the second finds them there, set to None or
    zeroed in place, which is what is checked (more steps repeat the second)."""
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), **kwargs)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(16, 12, generator=gen)
        model(x).square().mean().backward()
        opt.step()
    return opt


def run(hvd):
    torch.manual_seed(0)
    base = Net()
    for scheme in ("bit8", "bit16"):
        for route in ("allgather", "alltoall"):
            tag = f"{scheme}.{route}"
            kw = dict(compression=getattr(hc.Compression, scheme), route=route)
            m_none, m_zero = copy.deepcopy(base), copy.deepcopy(base)
            opt = train(m_none, True, **kw)
            bucket = opt._buckets[0]
            ptr = bucket.buffer.data_ptr()
            end = ptr + 4 * bucket.numel
            checks.check(f"{tag}.grads_are_bucket_views",
                         all(ptr <= p.grad.data_ptr() < end for p in m_none.parameters()))
            opt_zero = train(m_zero, False, **kw)
            b0 = opt_zero._buckets[0]
            views = [p.grad for _, p in opt_zero._members[0]]
            checks.check(f"{tag}.zeroed_in_place_stay_views",
                         all(b0.holds(j, g) for j, g in enumerate(views)))
            checks.check(f"{tag}.same_bits_either_zeroing",
                         all(torch.equal(a, b) for a, b in zip(m_none.parameters(), m_zero.parameters())))
            checks.check(f"{tag}.identical_on_all_ranks", checks.same_everywhere(list(m_none.parameters())))

    # a float64 parameter: its gradient cannot be a float32 view, so it is copied back
    m64 = copy.deepcopy(base).double()
    opt = hc.DistributedOptimizer(torch.optim.SGD(m64.parameters(), lr=0.1), named_parameters=m64.named_parameters(),
                                  compression=hc.Compression.bit8)
    opt.zero_grad()
    m64(torch.randn(4, 12, dtype=torch.float64)).sum().backward()
    opt.step()
    checks.check("float64.grad_keeps_dtype", all(p.grad.dtype == torch.float64 for p in m64.parameters()))


if __name__ == "__main__":
    checks.main(run)
