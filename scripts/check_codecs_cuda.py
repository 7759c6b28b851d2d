#!/usr/bin/env python
"""Does the codecs' torch path run on CUDA and give the CPU's bits? (issue: checks on a GPU)

    python scripts/check_codecs_cuda.py [--chunks 64] [--out result.json]

Every float32 bit pattern (2**32, in --chunks pieces) is encoded on the GPU and on the CPU by
fp8_torch.encode (E4M3 and E5M2, both overflow modes) and fp16_torch.encode; every code is
decoded on both; the block codec (blocks.encode_reference / decode_accumulate_reference, the
path a CUDA bucket takes) is compared on gradient-like data with NaN/Inf at several block sizes
and 1-4 ranks. The CPU side is the reference that scripts/check_codecs_exhaustive.py checks
against NumPy and ml_dtypes. Needs no Horovod. Exit status 1 on any mismatch.
"""
import argparse
import json
import platform
import sys
import time

import torch

from hvd_compress.codecs import E4M3, E5M2, FP16, blocks, fp8_torch, fp16_torch


def bits_equal(a, b):
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def check_all_inputs(chunks, dev, report):
    step = (1 << 32) // chunks
    for c in range(chunks):
        x_cpu = (torch.arange(c * step, (c + 1) * step, dtype=torch.int64) & 0xFFFFFFFF) \
            .to(torch.int32).view(torch.float32)
        x_dev = x_cpu.to(dev)
        for fmt in (E4M3, E5M2):
            for saturate in (True, False):
                key = f"{fmt.name}.saturate{int(saturate)}.encode"
                same = bits_equal(fp8_torch.encode(x_dev, fmt, saturate), fp8_torch.encode(x_cpu, fmt, saturate))
                report[key] = report.get(key, True) and same
        key = "float16.encode"
        report[key] = report.get(key, True) and bits_equal(fp16_torch.encode(x_dev), fp16_torch.encode(x_cpu))
        print(f"[cuda] all inputs: chunk {c + 1}/{chunks}", flush=True)
    for fmt in (E4M3, E5M2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        report[f"{fmt.name}.decode"] = bits_equal(fp8_torch.decode(codes.to(dev), fmt), fp8_torch.decode(codes, fmt))
    codes = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    report["float16.decode"] = bits_equal(fp16_torch.decode(codes.to(dev)), fp16_torch.decode(codes))


def gradient_like(n, seed, nan):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 3, (n,), generator=g).float()
    x[7::211], x[9::307] = float("inf"), -float("inf")
    if nan:
        x[::101] = float("nan")
    return x


def same_up_to_nan_payload(a, b, fmt=None):
    """Bits equal, except that a NaN may be any NaN (CUDA's arithmetic returns one canonical
    NaN where x86 keeps the input's payload): same NaN positions, every other bit equal."""
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.float32:
        na, nb = torch.isnan(a), torch.isnan(b)
    else:                                             # codes: NaN codes by the format's rule
        mag = lambda t: t.to(torch.int32) & (fmt.sign_bit - 1)
        nan = (lambda m: m > fmt.inf_code) if fmt.has_inf else (lambda m: m == fmt.nan_code)
        na, nb = nan(mag(a)), nan(mag(b))
    return torch.equal(na, nb) and bits_equal(a[~na], b[~nb])


def check_blocks(dev, report):
    for nan in (False, True):
        for fmt in (E4M3, FP16):
            for block in (1, 7, blocks.SCALE_BLOCK, 4096):
                for ranks in (1, 2, 4):
                    check_block_case(dev, report, fmt, block, ranks, nan)


def check_block_case(dev, report, fmt, block, ranks, nan):
        n = 100_003
        rows = [gradient_like(n, r + block, nan) for r in range(ranks)]
        out = {}
        for where in ("cpu", dev):
            codes = torch.empty(ranks, n, dtype=blocks.code_dtype(fmt), device=where)
            scales = torch.empty(ranks, blocks.num_blocks(n, block), device=where)
            for r in range(ranks):
                blocks.encode_reference(rows[r].to(where), fmt, codes[r], scales[r], block)
            total = blocks.decode_accumulate_reference(codes, scales, fmt,
                                                       torch.empty(n, device=where), block)
            out[where] = (codes, scales, total)
        key = f"blocks.{fmt.name}.block{block}.ranks{ranks}"
        if nan:      # codes, scales and sums equal up to NaN payloads
            (c1, s1, t1), (c2, s2, t2) = out["cpu"], out[dev]
            report[key + ".with_nan.same_up_to_nan_payload"] = (
                same_up_to_nan_payload(c1, c2, fmt) and bits_equal(s1, s2)
                and same_up_to_nan_payload(t1, t2))
        else:        # no NaN in the data: every bit equal
            report[key + ".bit_identical"] = all(bits_equal(a, b) for a, b in zip(out["cpu"], out[dev]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=64, help="pieces of the 2**32 inputs (default 64)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--skip-all-inputs", action="store_true", help="only the block codec")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("[cuda] no CUDA device here: nothing to check", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.time()
    report = {}
    check_blocks("cuda", report)
    if not args.skip_all_inputs:
        check_all_inputs(args.chunks, "cuda", report)
    summary = {"ok": all(report.values()), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "python": platform.python_version(),
               "seconds": round(time.time() - start, 1),
               "fp8_cast_is_exact_on_cuda": {f"{f.name}.sat{int(s)}": fp8_torch.cast_is_exact(f, s, "cuda")
                                              for f in (E4M3, E5M2) for s in (True, False)},
               "fp16_cast_is_exact_on_cuda": fp16_torch.cast_is_exact("cuda"),
               "checks": report}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
