"""Run under horovodrun -np 2 (tests/test_overlap_multiprocess.py, a launch of its own: a rank
leaves on purpose; argv: the output folder, the compression, bit8 or auto): rank 1 leaves after its forward of the third step, so rank 0's buckets will
never be reduced; rank 0 must raise, not hang: in backward or step() where Horovod has noticed
by then (its launches fail), else in the next forward, which waits for them.

Writes $OUT/rank0.json: what rank 0's next forward did (the error, how long it took)."""
import json
import os
import sys
import time

import torch
import horovod.torch as hvd

import hvd_compress as hc


def main(out, compression="bit8"):
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(),
                                  compression=getattr(hc.Compression, compression),
                                  schedule="overlap", model=model, fusion_threshold_bytes=1000)
    x, y = torch.randn(8, 20), torch.randint(0, 4, (8,))
    result, where = {}, "train"
    for step in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    hvd.allreduce(torch.zeros(1), name="both.here")   # rank 1 leaves only after this
    start = time.perf_counter()
    try:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if hvd.rank() == 1:
            os._exit(0)                        # gone mid-step, without a word to rank 0
        where = "backward"                     # the buckets launched in its hooks may fail here,
        loss.backward()                        # or in step(), as Horovod notices the loss,
        where = "step"
        opt.step()
        where = "forward"                      # or in the next forward, which waits for them
        model(x)
        result["outcome"] = "returned"
    except Exception as err:                   # Horovod's own error
        result.update(outcome="raised", error=f"{type(err).__name__}: {err}")
    result.update(where=where, seconds=time.perf_counter() - start,
                  pending_after=len(opt._pending.exchanges))
    with open(os.path.join(out, "rank0.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)                                # no shutdown handshake with a rank that is gone


if __name__ == "__main__":
    main(*sys.argv[1:3])
