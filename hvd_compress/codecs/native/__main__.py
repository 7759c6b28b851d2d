"""hvd-compress-build-kernel (python -m hvd_compress.codecs.native): build the kernel into the
per-user cache now, even where an earlier build failed, then check it against the torch path."""
import argparse
import sys

import torch

from . import build, kernel_dir
from .. import E4M3, FP16, blocks


def build_parser():
    parser = argparse.ArgumentParser(
        prog="hvd-compress-build-kernel",
        description="Compile the codec's C++ kernel (blocks.cpp) into the per-user cache "
                    "(HVD_COMPRESS_CACHE, default ~/.cache/hvd-compress), then check that it "
                    "codes 100,003 values bit for bit as the torch path does. Without this, the "
                    "first process to code a bucket builds it.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    print(f"[native] building into {kernel_dir()}", flush=True)
    try:
        path = build(verbose=args.verbose)
    except Exception as e:
        print(f"[native] the build failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if path is None:
        print("[native] the kernel did not load after building", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_003, generator=g) * 10.0 ** torch.randint(-8, 3, (100_003,), generator=g)
    x[::997] = float("nan")
    x[5::1999] = float("inf")
    for fmt in (E4M3, FP16):
        out = []
        for native in (True, False):
            codes = torch.empty(x.numel(), dtype=blocks.code_dtype(fmt))
            scales = torch.empty(blocks.num_blocks(x.numel()))
            blocks.encode(x, fmt, codes, scales) if native else blocks.encode_reference(x, fmt, codes, scales)
            out.append((codes, scales))
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*out))
        print(f"[native] {fmt.name}: encode {'equals' if same else 'DIFFERS FROM'} the torch path")
        if not same:
            return 1
    print(f"[native] built and checked: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
