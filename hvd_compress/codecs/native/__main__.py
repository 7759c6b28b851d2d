"""python -m hvd_compress.codecs.native: build the kernel, then check it against the torch path."""
import sys

import torch

from . import build
from .. import E4M3, FP16, blocks


def main():
    if build() is None:
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
    print("[native] built and checked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
