"""Run under horovodrun with a disagreement chosen by argv[1]; every rank must fail with a
clear RuntimeError from hc.DistributedOptimizer instead of hanging in a collective."""
import sys

import torch
import horovod.torch as hvd

import hvd_compress as hc

hvd.init()
RANK = hvd.rank()
case = sys.argv[1]

compression = hc.Compression.bit8
width = 8
if case == "compression" and RANK == 1:
    compression = hc.Compression.none            # rank 1 sends float32, the others 8-bit codes
if case == "shape" and RANK == 1:
    width = 9                                    # same parameter name, different shape

model = torch.nn.Linear(width, 3)
try:
    hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                            named_parameters=model.named_parameters(), compression=compression)
except RuntimeError as err:
    print(f"rank {RANK} refused: {err}", flush=True)
    sys.exit(3)
print(f"rank {RANK} was not stopped", flush=True)
