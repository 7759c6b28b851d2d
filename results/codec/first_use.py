"""What a user meets on first use: how long the kernel's one compile takes, and how much slower
the torch path is where no kernel could be built. The figures behind the two messages
hvd_compress prints then (codecs/native's compile notice, codecs/blocks.py's warning).

    python results/codec/first_use.py --out results/codec/first_use.csv      # under cpu-quiet

Compile: `native.build()` in a fresh interpreter with an empty kernel cache (HVD_COMPRESS_CACHE
a new folder) and no ccache, --compiles times, wall seconds of the whole process (importing
torch included, as a first use pays it). Codecs: blocks.encode and blocks.decode_accumulate (2
ranks' rows) on the native kernel against the same calls' torch path (encode_reference,
decode_accumulate_reference: what runs without a kernel), gradient-like float32 values at
each --sizes, E4M3 (bit8) and float16 (bit16), median of --reps, interleaved run by run.
"""
import argparse
import csv
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hvd_compress.codecs import E4M3, FP16, blocks, native

BUILD = "from hvd_compress.codecs import native; assert native.build() is not None"


def cpu_name():
    """'AMD EPYC family 25 model 1' from /proc/cpuinfo (a VM's model name can be that short)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor()
    return (f"{fields.get('model name', '?')} family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}")


def compile_seconds():
    with tempfile.TemporaryDirectory(prefix="hvdc-first-use-") as cache:
        env = dict(os.environ, HVD_COMPRESS_CACHE=cache, CCACHE_DISABLE="1")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


def gradient_like(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = (n + 4095) // 4096
    scale = torch.pow(10.0, torch.empty(rows, 1).uniform_(-7, -3, generator=g))
    return (torch.randn(rows, 4096, generator=g) * scale).reshape(-1)[:n].contiguous()


def paired(fast, slow, reps):
    """Median seconds of each, run alternately so load hits both alike."""
    fast(), slow()
    a, b = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fast()
        t1 = time.perf_counter()
        slow()
        a.append(t1 - t0)
        b.append(time.perf_counter() - t1)
    return statistics.median(a), statistics.median(b)


def codec_rows(sizes, reps):
    if native.module() is None:
        raise SystemExit(f"no kernel here ({native.why_missing()}): nothing to compare with")
    rows = []
    for fmt, scheme in ((E4M3, "bit8"), (FP16, "bit16")):
        for n in sizes:
            x = torch.stack([gradient_like(n, 0), gradient_like(n, 1)])
            codes = torch.empty(2, n, dtype=blocks.code_dtype(fmt))
            scales = torch.empty(2, blocks.num_blocks(n))
            for r in range(2):
                blocks.encode(x[r], fmt, codes[r], scales[r])
            out = torch.empty(n)
            cases = {
                "encode": (lambda: blocks.encode(x[0], fmt, codes[0], scales[0]),
                           lambda: blocks.encode_reference(x[0], fmt, codes[0], scales[0])),
                "decode_accumulate n=2": (
                    lambda: blocks.decode_accumulate(codes, scales, fmt, out),
                    lambda: blocks.decode_accumulate_reference(codes, scales, fmt, out)),
            }
            for op, (fast, slow) in cases.items():
                t_native, t_torch = paired(fast, slow, reps)
                rows.append(dict(kind="codec", scheme=scheme, op=op, values=n, reps=reps,
                                 native_ms=round(t_native * 1e3, 4),
                                 torch_path_ms=round(t_torch * 1e3, 4),
                                 slower=round(t_torch / t_native, 1)))
                print(f"{scheme:5s} {op:22s} {n:>9,} values: native {t_native * 1e3:9.3f} ms, "
                      f"torch path {t_torch * 1e3:9.3f} ms, {t_torch / t_native:6.1f}x", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiles", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 262144, 4194304])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", default="runs/first_use.csv")
    args = p.parse_args(argv)
    cpu = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, " \
          f"{torch.get_num_threads()} threads"
    print(cpu, flush=True)
    rows = []
    for i in range(args.compiles):
        s = compile_seconds()
        rows.append(dict(kind="compile", op="native.build() from an empty cache", reps=1,
                         seconds=round(s, 2)))
        print(f"compile {i + 1}: {s:.1f} s", flush=True)
    rows += codec_rows(args.sizes, args.reps)
    for row in rows:
        row["cpu"] = cpu
    columns = ["kind", "scheme", "op", "values", "reps", "seconds", "native_ms", "torch_path_ms",
               "slower", "cpu"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
