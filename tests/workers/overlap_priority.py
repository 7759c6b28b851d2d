"""Run under horovodrun (tests/workers/suite.py, or alone): priority on the wire under
schedule="overlap" (hvd_compress/exchange/sender.py), on both packet routes.

A net with one layer large enough that its bucket is cut (sender.chunk_plan): on the allgather
route into chunks, on the two-phase route into pieces, each piece an alltoall and an allgather
of its own whose middle step runs on the sender's thread. For bit8, int8 (stochastic rounding:
each rank's reduce stream is drawn part after part, so a piece reduced out of order changes
bits) and bit16, and bit8 with error feedback, the parameters after several steps are
bit-identical to schedule="wait"'s, where the bucket travels whole; a piece decoded into
another piece's place, or reduced in another order, fails it. At 2 and 4 ranks
(tests/hvdrun.py SUITE).
"""
import torch

import checks
from checks import check

import hvd_compress as hc

STEPS = 4
FUSION = 200_000             # bytes: the large layer's bucket alone, the others around it


def make(schedule, compression, route, error_feedback=None, **options):
    """(model, optimizer): a net whose middle layer's bucket is the one to cut."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4))
    extra = {"model": model} if schedule == "overlap" else {}
    return model, hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
        compression=compression, route=route, error_feedback=error_feedback,
        fusion_threshold_bytes=FUSION, schedule=schedule, **extra, **options)


def wide(schedule, compression, route, error_feedback=None, seed=0):
    """(parameters, {bucket: (index, chunks)}) after STEPS steps."""
    import horovod.torch as hvd
    model, opt = make(schedule, compression, route, error_feedback)
    if hasattr(compression, "reseed"):    # int8's rounding streams from their start
        compression.reseed()
    chunked = dict(getattr(opt.communicator, "_chunking", {}))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank() + seed)
    for _ in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    params = torch.cat([v.reshape(-1) for v in model.state_dict().values()])
    opt.close()
    return params, chunked


def run(hvd):
    cases = [("bit8.allgather", hc.Compression.bit8, "allgather", None),
             ("int8.allgather", hc.Compression.int8, "allgather", None),
             ("bit8.alltoall", hc.Compression.bit8, "alltoall", None),
             ("int8.alltoall", hc.Compression.int8, "alltoall", None),
             ("bit16.alltoall", hc.Compression.bit16, "alltoall", None),
             ("bit8.alltoall.error_feedback", hc.Compression.bit8, "alltoall", True)]
    for label, comp, route, ef in cases:
        waited, _ = wide("wait", comp, route, ef)
        overlapped, chunked = wide("overlap", comp, route, ef)
        check(f"overlap.priority.{label}.large_bucket_chunked",
              len(chunked) == 1 and list(chunked.values())[0][1] >= 3, str(chunked))
        check(f"overlap.priority.{label}.chunked_bit_identical_to_wait",
              torch.equal(waited, overlapped), f"max diff {(waited - overlapped).abs().max()}")
        check(f"overlap.priority.{label}.same_on_every_rank", checks.same_everywhere([overlapped]))

    # prioritise=False (bench_step's +whole rows): overlap with the bucket whole
    _, opt = make("overlap", hc.Compression.bit8, "alltoall", prioritise=False)
    check("overlap.priority.off_when_asked",
          opt.schedule == "overlap" and not opt.communicator.chunk_counts(),
          str(opt.communicator.chunk_counts()))
    opt.close()
    # the model given and nothing asked: overlapped, the large bucket cut (the default)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4))
    opt = hc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), compression=hc.Compression.bit8,
                                  fusion_threshold_bytes=FUSION, model=model)
    check("overlap.priority.default_with_a_model",
          opt.schedule == "overlap" and len(opt.communicator.chunk_counts()) == 1,
          f"{opt.schedule} {opt.communicator.chunk_counts()}")
    opt.close()


if __name__ == "__main__":
    checks.main(run)
