"""A job in which only rank 0 registers the hook (tests/test_ddp.py, a launch that must fail):
rank 0 must end with an error that names rank 1 once the hook's agreement has waited its
timeout (HookState agree_timeout_s, its default), not wait in a collective that rank 1,
inside DDP's own allreduce, never joins; rank 1 then ends too (its peer is gone)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvd_compress.ddp as hcd
import checks


def run(dist):
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
    if dist.get_rank() == 0:
        hcd.register(ddp, "bit8")
    checks.check("the hook registered on rank 0 only", True)
    F.mse_loss(ddp(torch.randn(4, 8)), torch.zeros(4, 4)).backward()
    checks.check("a step ended", True)
