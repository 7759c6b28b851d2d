#!/usr/bin/env python
"""Does hvd_compress's DDP hook run on CUDA through real NCCL collectives, and give the CPU's
bits? (issue 47: the plugin on a GPU)

    python -m scripts.check_cuda [--out results/cuda/ddp_hook_<gpu>.json]
    python -m scripts.check_cuda --device cpu      # the same checks on the CPU (Gloo): the suite's

From the repository's root, as a module: it then imports the checkout's hvd_compress whether
or not the package is installed (a lent GPU machine has the checkout and torch, no install).

One process, world size 1 (NCCL refuses two ranks on one GPU): the default group has Gloo for
CPU tensors and NCCL for CUDA ones, so every route's collectives (allreduce, allgather,
alltoall) run through real NCCL on the GPU. For every registered scheme and each of its routes
(top-k and PowerSGD included, bit8 also with error feedback), the same gradient-like buckets go
through hvd_compress.ddp's hook twice, on the CPU and on the device, for a few steps (residuals
and PowerSGD's Q carry over); the results must be equal bit for bit (int8 rounds stochastically
from a generator of the device: within one quantisation step instead). Then bit8's encode and
decode of a 25 MB bucket are timed against a device-to-device copy of its float32 values (the
memory-bandwidth bound). Compression.auto is not checked here (its calibration needs steps).
Exit status 1 on any mismatch; finishes in well under 5 minutes on one GPU.
"""
import argparse
import json
import os
import platform
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hvd_compress import registry
from hvd_compress.ddp import FlatBucket, HookState

SHAPES = [(64, 100), (100,), (7, 3, 3), (1000,)]     # a matrix, vectors, an odd tensor
STEPS = 3
STOCHASTIC = ("int8",)                               # rounding noise drawn on the device


def cases():
    """(label, compression, route, error_feedback) for every registered scheme and route."""
    out = []
    for name, entry in registry.schemes().items():
        for route in entry.routes:
            out.append((f"{name}:{route.value}", name, route.value, None))
    out.append(("bit8:allgather+ef", "bit8", "allgather", True))
    out.append(("bit8:alltoall+ef", "bit8", "alltoall", True))
    return out


def gradient_like(step, numel):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(numel, generator=g) * 10.0 ** torch.randint(-6, 1, (numel,), generator=g).float()


def run_case(name, route, error_feedback, device):
    """The hook's results on `device` for STEPS steps of the same buckets: a list of tensors
    (on the CPU)."""
    state = HookState(name, route, error_feedback=error_feedback)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    results = []
    for step in range(STEPS):
        buffer = gradient_like(step, numel).to(device)
        future = state.exchange(FlatBucket(buffer, 0, True, SHAPES))
        results.append(future.wait().cpu().clone())
    return results


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def check_schemes(device, report):
    ok = True
    for label, name, route, ef in cases():
        started = time.perf_counter()
        try:
            cpu = run_case(name, route, ef, "cpu")
            dev = run_case(name, route, ef, device)
        except Exception as err:                    # a scheme that cannot run here: say so
            report["schemes"][label] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            ok = False
            continue
        if name in STOCHASTIC:
            worst = max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)) for a, b in zip(cpu, dev))
            good = worst < 2 / 127
            how = f"within one quantisation step (largest relative difference {worst:.3g})"
        else:
            good = all(same_bits(a, b) for a, b in zip(cpu, dev))
            how = "bit for bit"
        report["schemes"][label] = {"ok": good, "compared": how,
                                    "seconds": round(time.perf_counter() - started, 3)}
        print(f"[check_cuda] {label}: {'ok' if good else 'MISMATCH'} ({how})", flush=True)
        ok &= good
    return ok


def time_bit8(device, report, numel=25 * (1 << 20) // 4, repeats=20):
    """bit8 encode + decode of one bucket against a copy of its float32 values, on `device`."""
    from hvd_compress.codecs import SCALE_BLOCK
    from hvd_compress.compressors import Bit8Compressor as B
    x = gradient_like(0, numel).to(device)
    message = torch.zeros(B.message_bytes(numel, SCALE_BLOCK), dtype=torch.uint8, device=device)
    out = torch.empty_like(x)
    copy = torch.empty_like(x)

    def timed(fn):
        fn()
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        return (time.perf_counter() - start) / repeats

    encode = timed(lambda: B.encode_message(x, message, SCALE_BLOCK))
    decode = timed(lambda: B.decode_messages(message.view(1, -1), numel, out, SCALE_BLOCK))
    copied = timed(lambda: copy.copy_(x))
    report["bit8_timing"] = {"values": numel, "encode_ms": 1e3 * encode, "decode_ms": 1e3 * decode,
                             "copy_ms": 1e3 * copied,
                             "encode_decode_vs_copy": (encode + decode) / copied,
                             "codec_path": B.codec_path(x.device)}
    print(f"[check_cuda] bit8 on {device}: encode {1e3 * encode:.3f} ms, decode "
          f"{1e3 * decode:.3f} ms, float32 copy {1e3 * copied:.3f} ms", flush=True)


def init_group(device):
    """World size 1: Gloo for CPU tensors, and NCCL for CUDA ones where there is a device."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timedelta(seconds=120))
    return dist.get_backend()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the checks' own test)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("[check_cuda] no CUDA device here: nothing checked (the CPU suite never needs one)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    backend = init_group(args.device)
    report = {"device": args.device, "backend": backend, "torch": torch.__version__,
              "host": platform.node(), "schemes": {}}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        ok = check_schemes(args.device, report)
        time_bit8(args.device, report)
    finally:
        dist.destroy_process_group()
    report["ok"] = bool(ok)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"[check_cuda] {'all schemes agree' if ok else 'MISMATCH'} ({report['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
