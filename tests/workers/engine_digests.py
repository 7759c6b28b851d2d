"""Run under horovodrun (tests/workers/suite.py): the buckets of tests/engine_cases.py through
the plugin's communicators on Horovod, step by step; each case's result digest is written to
$HVDC_CHECK_DIR/hvd-digests-rank<r>.json for test_ddp.py to compare with the DDP hook's."""
import json
import os
from pathlib import Path

import torch

from hvd_compress import registry
from hvd_compress.codecs import SCALE_BLOCK
from hvd_compress.compressors import Int8Compressor
from hvd_compress.exchange.fusion import Bucket
from hvd_compress.exchange.memory import ResidualMemory
from hvd_compress.exchange.routes import make_communicator
import checks
import engine_cases as cases


def compression(name):
    entry = registry.scheme(name)
    return entry.load()(entry.parameter) if entry.parameter is not None else entry.load()


def exchange(hvd, label, name, route, ef):
    comm = make_communicator(compression(name), route, hvd.Average, 0, SCALE_BLOCK)
    Int8Compressor.reseed(0)             # after the communicator's warm-up, which encodes once
    memory = ResidualMemory() if ef and comm.capabilities.takes_memory else None
    results = []
    for step in range(cases.STEPS):
        flat = cases.bucket(step, hvd.rank())
        if comm.capabilities.fuses:      # named as the hook names it (int8 rounds by name)
            bucket_name = f"ddp.0.{flat.numel()}"
            buckets = [Bucket(bucket_name, [bucket_name], [flat], flat=True)]
            members = [flat]
        else:                            # per tensor, named as the hook names them
            members, offset = [], 0
            for s in cases.SHAPES:
                k = torch.Size(s).numel()
                members.append(flat[offset:offset + k].view(s))
                offset += k
            buckets = [Bucket(f"ddp.0.{j}", [f"ddp.0.{j}"], [m], flat=False)
                       for j, m in enumerate(members)]
        exchanges = []
        for b, m in zip(buckets, members):
            b.put(0, m)
            exchanges.append(comm.start(b, memory))
        comm.advance(exchanges)
        out = []
        for b, ex in zip(buckets, exchanges):
            comm.finish(ex)
            out.append(b.result(0).reshape(-1))
        results.append(torch.cat(out))
    return results


def run(hvd):
    digests = {}
    for label, name, route, ef in cases.CASES:
        results = exchange(hvd, label, name, route, ef)
        checks.check(f"{label}: finite results", all(bool(torch.isfinite(r).all()) for r in results))
        digests[label] = cases.digest(results)
    every = hvd.allgather_object(digests)
    checks.check("every rank holds the same bits", all(d == digests for d in every))
    path = Path(os.environ["HVDC_CHECK_DIR"]) / f"hvd-digests-rank{hvd.rank()}.json"
    path.write_text(json.dumps(digests, indent=1))
