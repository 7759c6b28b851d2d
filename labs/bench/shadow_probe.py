"""Shadow progress of the lossy methods along float32's trajectory, in one process.

    python -m labs.bench.shadow_probe --model basic --steps 400 --out results/tta/shadow/basic.csv

The measure Compression.auto's choice by time to accuracy reads (hvd_compress/auto/
convergence.py, Progress): n simulated ranks (each its own shard of the lab's training set, as
labs/mnist.py deals them) train with the exact float32 average at the lab's settings; at every
step each lossy method compresses every rank's gradient plus its own shadow residual (what its
error feedback would carry had it been the one training) and the compressed average u_c is
kept; at the next step its first-order progress <u_c, g_t+1> is set against the exact
update's <g_t, g_t+1>. r_c, their sums' ratio over a window, is the share of float32's
progress per step the method would make. Each method as the plugin computes it: top-k's
selection (methods.topk.select), 1-bit's codec (codecs.onebit), PowerSGD's round over the
ranks (methods.powersgd.approximate, warm-started Q), so the probe checks the decision's input
against the steps the grid measured, not the plugin's exchange.

Writes one row per window: step, method, r (the progress ratio), residual (the shadow
residual's norm over the gradient's, all ranks).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from hvd_compress.codecs import onebit
from hvd_compress.methods.powersgd import approximate, orthonormal
from hvd_compress.methods.topk import select
from labs import mnist
from labs.kit import data as lab_data, runlog, tta
from labs.kit.flags import DEFAULTS

BLOCK = 256                     # the 1-bit codec's block (the plugin's scale block)


def topk(ratio):
    def compress(xs, state, key):
        outs = []
        for x in xs:
            flat = x.reshape(-1)
            kept = torch.zeros_like(flat)
            index = select(flat, max(1, math.ceil(ratio * flat.numel())))
            kept[index] = flat[index]
            outs.append(kept.view_as(x))
        return outs, sum(outs) / len(outs)
    return compress


def signs(xs, state, key):
    outs = []
    for x in xs:
        flat = x.reshape(-1).contiguous()
        codes = torch.empty(onebit.sign_bytes(flat.numel()), dtype=torch.uint8)
        means = torch.empty(onebit.num_blocks(flat.numel(), BLOCK), dtype=torch.float32)
        onebit.encode(flat, codes, means, BLOCK)
        outs.append(onebit.decode(codes, means, flat.numel(), BLOCK).view_as(x))
    return outs, sum(outs) / len(outs)


def powersgd(rank):
    def compress(xs, state, key):
        if xs[0].dim() < 2:                           # vectors go whole, as the plugin's
            mean = sum(xs) / len(xs)
            return [mean] * len(xs), mean
        matrices = [x.reshape(x.shape[0], -1) for x in xs]
        q = state.get(key)
        if q is None:
            generator = torch.Generator().manual_seed(len(state))
            q = orthonormal(torch.randn(matrices[0].shape[1], min(rank, *matrices[0].shape),
                                        generator=generator))
        approximation, state[key] = approximate(matrices, q)
        shared = approximation.view_as(xs[0])
        return [shared] * len(xs), shared
    return compress


METHODS = {"topk0.1": topk(0.1), "topk0.01": topk(0.01), "topk0.001": topk(0.001),
           "onebit": signs, "powersgd1": powersgd(1), "powersgd2": powersgd(2),
           "powersgd4": powersgd(4)}


def probe(model_name, ranks, steps, window, seed, dataset):
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    data = lab_data.hold_out(lab_data.load_dataset(dataset), tta.HOLDOUT)
    model = mnist.MODELS[model_name]()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=DEFAULTS["lr"] * ranks, momentum=DEFAULTS["momentum"])
    residual = {m: [[torch.zeros_like(p) for p in params] for _ in range(ranks)] for m in METHODS}
    states = {m: {} for m in METHODS}
    made, exact, before, rows = dict.fromkeys(METHODS, 0.0), 0.0, None, []
    epoch, offset, shards = 1, 0, None
    for t in range(steps):
        if shards is None or offset + 64 > len(shards[0]):
            shards = [lab_data.train_shard(len(data.train_y), r, ranks, seed, epoch)
                      for r in range(ranks)]
            epoch, offset = epoch + 1, 0
        grads = []
        for shard in shards:
            index = shard[offset:offset + 64]
            opt.zero_grad()
            F.nll_loss(model(data.train_x[index]), data.train_y[index]).backward()
            grads.append([p.grad.detach().clone() for p in params])
        offset += 64
        mean = [sum(g[j] for g in grads) / ranks for j in range(len(params))]
        if before is not None:
            exact += sum(float((a * b).sum()) for a, b in zip(before[0], mean))
            for m in METHODS:
                made[m] += sum(float((a * b).sum()) for a, b in zip(before[1][m], mean))
        updates = {}
        for m, compress in METHODS.items():
            update = []
            for j in range(len(params)):
                xs = [grads[r][j] + residual[m][r][j] for r in range(ranks)]
                outs, average = compress(xs, states[m], j)
                for r in range(ranks):
                    residual[m][r][j] = xs[r] - outs[r]
                update.append(average)
            updates[m] = update
        before = (mean, updates)
        for p, g in zip(params, mean):
            p.grad = g
        opt.step()
        if (t + 1) % window == 0:
            scale = math.sqrt(sum(float((g * g).sum()) for gr in grads for g in gr))
            for m in METHODS:
                norm = math.sqrt(sum(float((e * e).sum()) for er in residual[m] for e in er))
                rows.append({"step": t + 1, "method": m, "r": made[m] / exact,
                             "residual": norm / scale})
            print(f"[shadow_probe] {model_name} step {t + 1}: " + ", ".join(
                f"{m} {made[m] / exact:.2f}" for m in METHODS), flush=True)
            made, exact = dict.fromkeys(METHODS, 0.0), 0.0
    return pd.DataFrame(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(mnist.MODELS), default="basic")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    frame = probe(args.model, args.ranks, args.steps, args.window, args.seed, args.dataset)
    runlog.atomic_write_text(Path(args.out), frame.to_csv(index=False, float_format="%.4g"))
    print(frame.groupby("method").r.median().round(2).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
