#!/usr/bin/env python
"""Each scheme's relative error on each bucket's real gradients, for the planner's accuracy guard.

    python results/planner/bucket_errors.py --out results/planner/bucket_errors.csv

Trains each of the lab's networks (labs/mnist.py: horovod, basic) on MNIST's 10,000 test images
(the set the tests read) for a few steps
(SGD, lr 0.1, momentum 0.5, batch 64, as the lab's matrix) and at every `--every`th step takes
each bucket's gradient (the optimizer's buckets: backward order, fused to 1 MiB of float32) through
each codec's round trip: Horovod's float16 cast (fp16), the block-scaled float16 (bit16) and
E4M3 (bit8) bucket messages. Error as the codec tests define it: ||decoded - g|| / ||g||.
Writes one row per (model, step, bucket, scheme); the planner's CLI takes the largest per
(model, bucket, scheme).
"""
import argparse
import csv
from pathlib import Path

import torch
import torch.nn.functional as F

import hvd_compress as hc
from hvd_compress.costmodel.methods import FUSION_BYTES, groups_by_size
from labs.kit.data import read_idx                             # noqa: E402
from labs.mnist import MODELS                                  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "mnist"   # as the tests


def roundtrip(scheme, flat):
    if scheme == "fp16":
        return flat.half().float()
    comp = getattr(hc.Compression, scheme)
    message = torch.zeros(comp.message_bytes(flat.numel()), dtype=torch.uint8)
    return comp.decode_message(comp.encode_message(flat, message), flat.numel(),
                               torch.empty_like(flat))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--data-dir", default=str(DATA))
    p.add_argument("--out", default="results/planner/bucket_errors.csv")
    args = p.parse_args()
    torch.set_num_threads(1)
    images = torch.from_numpy(read_idx(Path(args.data_dir) / "t10k-images-idx3-ubyte.gz").copy())
    labels = torch.from_numpy(read_idx(Path(args.data_dir) / "t10k-labels-idx1-ubyte.gz").copy())
    x_all = ((images.float() / 255 - 0.1307) / 0.3081).unsqueeze(1)
    rows = []
    for model_name in ("horovod", "basic"):
        torch.manual_seed(42)
        net = MODELS[model_name]()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
        named = list(net.named_parameters())[::-1]               # backward order
        groups = groups_by_size([q.numel() for _, q in named], FUSION_BYTES)
        for step in range(args.steps + 1):
            i = (step * 64) % (len(x_all) - 64)
            opt.zero_grad()
            F.nll_loss(net(x_all[i:i + 64]), labels[i:i + 64].long()).backward()
            if step % args.every == 0:
                for group in groups:
                    flat = torch.cat([named[j][1].grad.reshape(-1) for j in group])
                    for scheme in ("fp16", "bit16", "bit8"):
                        err = float((roundtrip(scheme, flat) - flat).norm() / flat.norm())
                        rows.append(dict(model=model_name, step=step, bucket=named[group[0]][0],
                                         bytes=4 * flat.numel(), scheme=scheme, rel_error=err))
            opt.step()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        if r["step"] == args.steps:
            print(f"{r['model']:8} {r['bucket']:12} {r['bytes']:>9} {r['scheme']:6} "
                  f"{r['rel_error']:.3e}")


if __name__ == "__main__":
    main()
