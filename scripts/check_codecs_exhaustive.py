#!/usr/bin/env python
"""Check every codec on all 2**32 float32 bit patterns against its reference, chunk by chunk.

For each chunk (default 2**24 consecutive bit patterns) and each mode:
  e4m3fn saturate=True   vs torch `x.to(torch.float8_e4m3fn)`
  e4m3fn saturate=False  vs ml_dtypes `x.astype(float8_e4m3fn)`
  e5m2   saturate=False  vs torch `x.to(torch.float8_e5m2)`; also ml_dtypes: equal except
                         NaN inputs, which must give NaN codes (ml_dtypes writes 0x7E, torch 0x7F)
  e5m2   saturate=True   vs torch's cast of x with finite values clamped to +-57344
  float16                vs NumPy `x.astype(np.float16)`
each through every path: NumPy (`fp8_numpy.encode`), torch fast (`fp8_torch.encode`), torch
reference (`fp8_torch.encode_bits`) and the native C++ kernel of the block codec (codecs/native,
`encode_values`: E4M3 saturating and float16 only, the formats codecs/blocks.py uses); same for
fp16.  Decoders are checked on all 256 / 65536 codes first (native: through its
decode_accumulate with one rank and scale 1).  The native path needs the kernel built
(scripts/setup.sh); asked for without it, the check fails.  Prints a progress line per chunk; on any mismatch prints the first ones and
exits 1.  A summary goes to --out as JSON.

    nice python scripts/check_codecs_exhaustive.py            # all 256 chunks (minutes)
    python scripts/check_codecs_exhaustive.py --quick         # 10 chunks at the boundaries
    python scripts/check_codecs_exhaustive.py --chunks 0x43 0xc7 --paths numpy
"""
import argparse
import json
import os
import sys
import time
import warnings

import ml_dtypes
import numpy as np
import torch

from hvd_compress.codecs import E4M3, E5M2, FP16, fp8_numpy, fp8_torch, fp16_numpy, fp16_torch, native

# --quick: the chunks (top 8 bits = sign + 7 exponent bits) where the formats' boundaries are:
# zeros and float32 subnormals, E4M3/E5M2 subnormals (0x3B, 0x37), the E4M3 overflow at 448..480
# (0x43), E5M2 and float16 overflow at 57344..65536 (0x47), Inf and NaN (0x7F), and negatives.
QUICK_CHUNKS = [0x00, 0x37, 0x3B, 0x3F, 0x43, 0x47, 0x7F, 0x80, 0xC3, 0xFF]
MODES = [(E4M3, True), (E4M3, False), (E5M2, True), (E5M2, False)]
PATHS = ["numpy", "torch", "torch-bits", "native"]


def native_encode(x_t, fmt, out):
    """The C++ kernel's plain encoder (no scale) into `out` (uint8 / int16)."""
    native.module().encode_values(x_t, out, fmt.name)
    return out


def native_decode(codes_t, fmt):
    """The C++ kernel's decoder: decode_accumulate of one rank, one block, scale 1."""
    out = torch.empty(codes_t.numel(), dtype=torch.float32)
    native.module().decode_accumulate(codes_t.view(1, -1), torch.ones(1, 1), out, fmt.name, max(1, codes_t.numel()))
    return out


def reference_fp8(x_np, x_t, fmt, saturate):
    if fmt is E4M3 and not saturate:
        return x_np.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    t = x_t
    if fmt is E5M2 and saturate:
        t = torch.where(torch.isfinite(t), t.clamp(-fmt.max_finite, fmt.max_finite), t)
    return t.to(fp8_torch.torch_dtype(fmt)).view(torch.uint8).numpy()


class Checker:
    """Compares arrays, counts mismatches and keeps the first few of each kind."""

    def __init__(self, keep=10):
        self.keep = keep
        self.mismatches = {}          # name -> count
        self.examples = {}            # name -> list of strings

    def compare(self, name, ours, ref, inputs, fmt="{:#x}"):
        bad = ours != ref
        if not bad.any():
            return 0
        idx = np.nonzero(bad)[0]
        self.mismatches[name] = self.mismatches.get(name, 0) + idx.size
        ex = self.examples.setdefault(name, [])
        for i in idx[: max(0, self.keep - len(ex))]:
            ex.append(f"input {int(inputs[i]):#010x}: ours " + fmt.format(int(ours[i]))
                      + " ref " + fmt.format(int(ref[i])))
        return idx.size

    @property
    def total(self):
        return sum(self.mismatches.values())


def check_decoders(chk: Checker, paths):
    codes = np.arange(256, dtype=np.uint8)
    for fmt in (E4M3, E5M2):
        ref = torch.from_numpy(codes).view(fp8_torch.torch_dtype(fmt)).float().numpy().view(np.uint32)
        chk.compare(f"decode {fmt.name} numpy", fp8_numpy.decode(codes, fmt).view(np.uint32), ref, codes)
        chk.compare(f"decode {fmt.name} torch",
                    fp8_torch.decode(torch.from_numpy(codes), fmt).numpy().view(np.uint32), ref, codes)
        if "native" in paths and fmt is E4M3:
            chk.compare(f"decode {fmt.name} native",
                        native_decode(torch.from_numpy(codes), fmt).numpy().view(np.uint32), ref, codes)
    codes16 = np.arange(1 << 16, dtype=np.uint16)
    ref = codes16.view(np.float16).astype(np.float32).view(np.uint32)
    chk.compare("decode fp16 numpy", fp16_numpy.decode(codes16).view(np.uint32), ref, codes16)
    t16 = torch.from_numpy(codes16.view(np.int16))
    chk.compare("decode fp16 torch", fp16_torch.decode(t16).numpy().view(np.uint32), ref, codes16)
    chk.compare("decode fp16 torch-lookup", fp16_torch.decode_lookup(t16).numpy().view(np.uint32), ref, codes16)
    if "native" in paths:     # the block decoder multiplies by 1/|scale|, which quiets NaNs
        quiet = (torch.from_numpy(ref.view(np.float32)) * 1.0).numpy().view(np.uint32)
        chk.compare("decode fp16 native (x 1.0)", native_decode(t16, FP16).numpy().view(np.uint32), quiet, codes16)


def check_chunk(start, size, paths, do_fp16, chk: Checker, bufs):
    bits = np.arange(start, start + size, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    xt = torch.from_numpy(x)
    u8n, u8t, u16n, i16t = bufs
    for fmt, sat in MODES:
        mode = f"{fmt.name} {'sat' if sat else 'nonsat'}"
        ref = reference_fp8(x, xt, fmt, sat)
        if "numpy" in paths:
            chk.compare(f"{mode} numpy", fp8_numpy.encode(x, fmt, sat, out=u8n), ref, bits)
        if "torch" in paths:
            chk.compare(f"{mode} torch", fp8_torch.encode(xt, fmt, sat, out=u8t).numpy(), ref, bits)
        if "torch-bits" in paths:
            chk.compare(f"{mode} torch-bits", fp8_torch.encode_bits(xt, fmt, sat, out=u8t).numpy(), ref, bits)
        if "native" in paths and fmt is E4M3 and sat:
            chk.compare(f"{mode} native", native_encode(xt, fmt, u8t).numpy(), ref, bits)
        if fmt is E5M2 and not sat:                       # the ml_dtypes claim for E5M2
            ml = x.astype(ml_dtypes.float8_e5m2).view(np.uint8)
            nan = np.isnan(x)
            chk.compare("e5m2 nonsat torch-vs-ml_dtypes (non-NaN)", ref[~nan], ml[~nan], bits[~nan])
            ml_nan = np.array([E5M2.is_nan_code(c) for c in range(256)])[ml[nan]]
            chk.compare("e5m2 nonsat ml_dtypes NaN->NaN", ml_nan, np.ones_like(ml_nan), bits[nan])
    if do_fp16:
        ref16 = x.astype(np.float16).view(np.uint16)
        if "numpy" in paths:
            chk.compare("fp16 numpy", fp16_numpy.encode(x, out=u16n), ref16, bits)
        if "torch" in paths:
            chk.compare("fp16 torch", fp16_torch.encode(xt, out=i16t).numpy().view(np.uint16), ref16, bits)
        if "torch-bits" in paths:
            chk.compare("fp16 torch-bits", fp16_torch.encode_bits(xt, out=i16t).numpy().view(np.uint16),
                        ref16, bits)
        if "native" in paths:
            chk.compare("fp16 native", native_encode(xt, FP16, i16t).numpy().view(np.uint16), ref16, bits)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"only chunks {[hex(c) for c in QUICK_CHUNKS]}")
    p.add_argument("--chunks", type=lambda s: int(s, 0), nargs="*", help="chunk indices to check")
    p.add_argument("--chunk-bits", type=int, default=24, help="log2 of the chunk size (default 24)")
    p.add_argument("--paths", nargs="*", default=PATHS, choices=PATHS)
    p.add_argument("--no-fp16", action="store_true")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: a correctness run, and many short "
                        "parallel ops stall badly when the cores are shared)")
    p.add_argument("--out", default="runs/codecs/exhaustive.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if "native" in args.paths and native.module() is None:
        print("FAILED: the native kernel is not built (scripts/setup.sh builds it; "
              "python -m hvd_compress.codecs.native) or HVD_COMPRESS_NATIVE=0; "
              "leave 'native' out of --paths to check the rest")
        return 1
    warnings.simplefilter("ignore", RuntimeWarning)       # NumPy/ml_dtypes overflow warnings

    size = 1 << args.chunk_bits
    n_chunks = 1 << (32 - args.chunk_bits)
    if args.chunks:
        chunks = args.chunks
    elif args.quick:
        chunks = [c >> (24 - args.chunk_bits) if args.chunk_bits <= 24 else c for c in QUICK_CHUNKS]
        chunks = sorted(set(c for c in chunks if c < n_chunks))
    else:
        chunks = list(range(n_chunks))
    bad_idx = [c for c in chunks if not 0 <= c < n_chunks]
    if bad_idx:
        p.error(f"chunk indices must be in [0, {n_chunks}): {bad_idx}")

    print(f"torch {torch.__version__}, numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, "
          f"threads {torch.get_num_threads()}; {len(chunks)} chunk(s) of 2**{args.chunk_bits}, "
          f"paths {args.paths}, fp16 {not args.no_fp16}", flush=True)
    chk = Checker()
    check_decoders(chk, args.paths)
    print(f"decoders (all 256 / 65536 codes): {chk.total} mismatches", flush=True)
    bufs = (np.empty(size, np.uint8), torch.empty(size, dtype=torch.uint8),
            np.empty(size, np.uint16), torch.empty(size, dtype=torch.int16))
    t_start = time.perf_counter()
    for i, c in enumerate(chunks):
        t0 = time.perf_counter()
        check_chunk(c * size, size, args.paths, not args.no_fp16, chk, bufs)
        now = time.perf_counter()
        eta = (now - t_start) / (i + 1) * (len(chunks) - i - 1)
        print(f"chunk {i + 1:3d}/{len(chunks)} [{c * size:#010x}, {(c + 1) * size - 1:#010x}] "
              f"{now - t0:5.1f} s  elapsed {now - t_start:6.0f} s  eta {eta:5.0f} s  "
              f"mismatches {chk.total}", flush=True)
    elapsed = time.perf_counter() - t_start
    values = len(chunks) * size
    summary = dict(torch=torch.__version__, numpy=np.__version__, ml_dtypes=ml_dtypes.__version__,
                   chunks=len(chunks), chunk_size=size, values=values, paths=args.paths,
                   fp16=not args.no_fp16, seconds=round(elapsed, 1), mismatches=chk.mismatches,
                   examples=chk.examples, ok=chk.total == 0)
    if "native" in args.paths:   # which of its kernels ran: kernels_x86.h (F16C) or kernels.h
        summary["native_kernel"] = "f16c" if native.module().uses_f16c() else "portable"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=2)
    if chk.total:
        print(f"FAILED: {chk.total} mismatches over {values} inputs ({elapsed:.0f} s)")
        for name, ex in chk.examples.items():
            print(f"  {name}: {chk.mismatches[name]} mismatches, first:")
            for line in ex:
                print(f"    {line}")
        return 1
    print(f"OK: {values} float32 inputs x {len(MODES)} fp8 modes"
          f"{' + fp16' if not args.no_fp16 else ''} x {len(args.paths)} paths, 0 mismatches "
          f"({elapsed:.0f} s); summary in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
