#!/usr/bin/env python
"""Training-step benchmark on FSDP2: hvd_compress's codecs on the gradients' reduce-scatter
against FSDP2's own (float32, and its reduce_dtype=bfloat16 cast) and against DDP, side by side.

    python -m labs.bench.fsdp --models basic --links loopback,100mbit --ranks 2
    python -m labs.bench.fsdp --memory --models basic --ranks 2,4     # peak memory, row by row

The FSDP2 twin of labs/bench/ddp.py, with its rounds and statistics (labs/bench/rounds.py) and
its launch (one torch.distributed job of Gloo per (model, link, ranks) cell, on loopback or over
an emulated link of labs.netem: root, network namespaces). Inside a job every row trains its
own copy of the model on the same synthetic MNIST-shaped batches, in interleaved rounds, so
every ratio is measured in the same run on the same machine.

Rows:
    fsdp:none         FSDP2's default: fully_shard per layer and root (labs/fsdp_mnist.py's
                      shard()), its float32 reduce-scatter and all-gather
    fsdp:bf16reduce   FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.bfloat16): its cast
    fsdp:bit8         hvd_compress.fsdp.register(model, "bit8") (any of its schemes:
                      fsdp:bf16, fsdp:bit16, fsdp:int8, fsdp:fp16)
    fsdp:bit8+w8      the same with the weights' all-gather compressed too (register(...,
                      weights="bit8")); run only where this hvd_compress.fsdp's register takes
                      weights= (weights_option(): said on the command line otherwise)
    fsdp:bit8+w8k     the same, the backward decoding the codes its forward gathered
                      (keep_weight_codes=True): no second all-gather a step
    ddp:none, ddp:bit8   DDP's own allreduce; hvd_compress.ddp's hook at bit8 (its default route)
    local             the same network, no process group and no exchange: the compute floor

summary.csv gives per row its median step, how well that median is known (median_ci_pct) and
its ratios taken round by round (rounds.paired_ratio, 95% interval) to fsdp:none
(vs_fsdp_none), to fsdp:bf16reduce (vs_fsdp_bf16reduce) and to the floor (vs_local), the
bytes its codec counts a step (bytes_sent: the gradients' reduce-scatter or allreduce) and,
on an emulated link, what the rank's link really sent a step (wire_bytes: all-gathers and
headers included).

--memory runs every row alone in a job of its own (a process's peak is its whole life's) for a
few steps, and writes memory.csv: the peak resident set of each rank above what it held before
the model was made (peak_rss_mb: ru_maxrss), and the shares computed from the tensors each
rank holds after a step: parameters, gradients and the optimizer's momentum (FSDP2: the local
shards; DDP: every value, plus DDP's buckets, one float32 copy of the gradients).
"""
import argparse
import csv
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from labs.bench.rounds import (add_grid_arguments, another_round, check_grid, median,
                               median_ci_pct, paired_ratio, run_torch_ranks, worker_command)
from labs.bench.step import LINKS, cell_steps

SCHEMES = ("none", "bf16", "bit16", "bit8", "int8", "fp16")     # hvd_compress.fsdp's
LOCAL_ROW = "local"
WEIGHTS_ROW = "fsdp:bit8+w8"
KEPT_ROW = "fsdp:bit8+w8k"
ROWS = ["fsdp:none", "fsdp:bf16reduce", "fsdp:bit8", "fsdp:bf16", WEIGHTS_ROW, KEPT_ROW,
        "ddp:none", "ddp:bit8", LOCAL_ROW]
BASES = ("fsdp:none", "fsdp:bf16reduce", LOCAL_ROW)     # the ratios' denominators
STEP_COLUMNS = ["model", "link", "ranks", "row", "round", "step", "step_ms",
                "forward_backward_ms", "compress_ms", "communicate_ms", "decompress_ms",
                "bytes_sent", "wire_bytes", "weights_compress_ms", "weights_communicate_ms",
                "weights_decompress_ms", "weights_bytes_sent"]
MEMORY_COLUMNS = ["model", "ranks", "row", "rank", "peak_rss_mb", "param_mb", "grad_mb",
                  "optimizer_mb", "ddp_bucket_mb", "tensors_mb"]
MEMORY_STEPS = 5
MB = 1 << 20


def weights_option():
    from labs.fsdp_mnist import weights_option as option
    return option()


def kept_option():
    """Does this hvd_compress.fsdp take keep_weight_codes= (KEPT_ROW)?"""
    import inspect
    import hvd_compress.fsdp as hcf
    return "keep_weight_codes" in inspect.signature(hcf.FSDPCompression.__init__).parameters


def known_row(row):
    if row in (LOCAL_ROW, "fsdp:bf16reduce", WEIGHTS_ROW, KEPT_ROW, "ddp:none", "ddp:bit8"):
        return True
    kind, _, scheme = row.partition(":")
    return kind == "fsdp" and scheme in SCHEMES


# ---- inside one torch.distributed job ---------------------------------------------------------
def make_row(row, model, mesh):
    """(the model to step, hvd_compress's state or None) for a row."""
    import torch
    if row == LOCAL_ROW:
        return model, None
    kind, scheme = row.split(":")
    if kind == "ddp":
        import hvd_compress.ddp as hcd
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if scheme == "none":
            return ddp, None
        state = hcd.HookState(scheme, model=ddp)
        ddp.register_comm_hook(state, hcd.hook)
        return ddp, state
    import hvd_compress.fsdp as hcf
    from labs.fsdp_mnist import shard
    shard(model, mesh, torch.bfloat16 if scheme == "bf16reduce" else None)
    if scheme in ("none", "bf16reduce"):
        return model, None
    if row == WEIGHTS_ROW:
        return model, hcf.register(model, "bit8", weights="bit8")
    if row == KEPT_ROW:
        return model, hcf.register(model, "bit8", weights="bit8", keep_weight_codes=True)
    return model, hcf.register(model, scheme)


def own_bytes(row, model, n):
    """Bytes a rank sends a step where no codec of ours counts them: FSDP2's reduce-scatter
    (float32, or bfloat16 under reduce_dtype) and DDP's ring allreduce of float32."""
    if row == LOCAL_ROW:
        return 0
    if row.startswith("ddp:"):
        return sum(2 * (n - 1) * p.numel() * 4 // n for p in model.parameters())
    from labs.fsdp_mnist import reduce_scatter_bytes     # a DTensor's shape is the whole's
    return reduce_scatter_bytes(model, n, 2 if row == "fsdp:bf16reduce" else 4)


def local_bytes(tensors):
    """Bytes of this rank's part of `tensors` (a DTensor's local shard, a tensor's all)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def tensor_shares(row, model, opt):
    """{param_mb, grad_mb, optimizer_mb, ddp_bucket_mb} this rank holds after a step."""
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if hasattr(v, "numel")]
    # DDP's buckets: one flat float32 copy of every gradient (gradient_as_bucket_view=False)
    buckets = sum(p.numel() * 4 for p in params) if row.startswith("ddp:") else 0
    return {"param_mb": local_bytes(params) / MB,
            "grad_mb": local_bytes(p.grad for p in params) / MB,
            "optimizer_mb": local_bytes(state) / MB, "ddp_bucket_mb": buckets / MB}


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # Linux: KiB


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from hvd_compress.engine.distributed import TorchEngine
    from labs.bench.ddp import init_from_environment
    from labs.bench.step import make_model
    from labs.netem.launch import wire_counter
    init_from_environment()
    torch.set_num_threads(1)
    engine = TorchEngine()
    rank, n = engine.rank(), engine.size()
    mesh = init_device_mesh("cpu", (n,))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(args.batch_size, 1, 28, 28, generator=g),
             torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(4)]
    wire = wire_counter()
    before = current_rss_bytes()
    rows = {}
    for row in args.rows.split(","):
        torch.manual_seed(0)                       # every rank the same weights
        model, state = make_row(row, make_model(args.model), mesh)
        rows[row] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5), state)

    def step(model, opt, state, i):
        x, y = data[i % len(data)]
        t0, sent = time.perf_counter(), wire()
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()         # the reduce-scatters (allreduces) run here
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        return t0, t1, t2, state.pop_stats() if state is not None else {}, wire() - sent

    if args.memory:                                # one row alone: its peak is its own
        (row, (model, opt, state)), = rows.items()
        for i in range(MEMORY_STEPS):
            step(model, opt, state, i)
        record = dict(model=args.model, ranks=n, row=row, rank=rank,
                      peak_rss_mb=(peak_rss_bytes() - before) / MB, **tensor_shares(row, model, opt))
        record["tensors_mb"] = sum(record[k] for k in ("param_mb", "grad_mb", "optimizer_mb",
                                                       "ddp_bucket_mb"))
        records = engine.allgather_object(record, "memory")
        if rank == 0:
            with open(args.csv, "a", newline="") as f:
                writer = csv.DictWriter(f, MEMORY_COLUMNS)
                for r in records:
                    writer.writerow(r)
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)

    bytes_of = {row: own_bytes(row, model, n) for row, (model, _, state) in rows.items()
                if state is None}
    out = open(args.csv, "a", newline="") if rank == 0 else None
    writer = csv.writer(out) if out else None
    times = {row: ([], []) for row in rows}
    rnd = 0
    while True:                                     # round 0 warms every row up
        for row, (model, opt, state) in rows.items():
            dist.barrier()
            for i in range(args.per_round if rnd else args.warmup):
                t0, t1, t2, stats, sent = step(model, opt, state, i)
                if rnd and writer:
                    codec = sum(stats.get(k, 0.0) for k in ("compress_s", "communicate_s",
                                                            "decompress_s"))
                    writer.writerow([args.model, args.link, n, row, rnd, i, 1e3 * (t2 - t0),
                                     1e3 * (t1 - t0 - codec),
                                     *(1e3 * stats.get(k, math.nan) for k in (
                                         "compress_s", "communicate_s", "decompress_s")),
                                     stats.get("bytes_sent", bytes_of.get(row, math.nan)), sent,
                                     *(1e3 * stats.get(f"weights_{k}", math.nan) for k in (
                                         "compress_s", "communicate_s", "decompress_s")),
                                     stats.get("weights_bytes_sent", math.nan)])
                    times[row][0].append(1e3 * (t2 - t0))
                    times[row][1].append(rnd)
        if rank == 0:
            print(f"[bench_fsdp] {args.model} {args.link} n={n}: round {rnd}", flush=True)
            out.flush()
        more = another_round(times, rnd, args) if rank == 0 else 0.0
        if not engine.broadcast_object(more, root_rank=0, name=f"more.{rnd}"):
            break
        rnd += 1
    if out:
        out.close()
    dist.barrier()
    # FSDP2's and DDP's state and Gloo's threads torn down by the interpreter can abort the
    # ranks (labs/bench/ddp.py): leave as its workers do
    sys.stdout.flush()
    os._exit(0)


# ---- the driver ---------------------------------------------------------------------------------
def launch(args, model, link, n, csv_path, rows=None, memory=False):
    """One cell's job: every rank runs the worker, over loopback or an emulated link."""
    per_round, first, most = cell_steps(model, link, args.steps, args.rounds, args.max_rounds)
    sub = argparse.Namespace(**dict(vars(args), rows=rows or args.rows))
    cmd = worker_command("labs.bench.fsdp", sub, model, link, per_round, first, most, csv_path)
    if memory:
        cmd.append("--memory")
    run_torch_ranks(n, LINKS[link], args.timeout, cmd, "bench_fsdp")


def summarise(steps):
    """One row per (model, link, ranks, row) of steps.csv's frame: medians, spreads, the
    paired ratios to BASES and the bytes."""
    import pandas as pd
    out = []
    for (model, link, n), cell in steps.groupby(["model", "link", "ranks"], sort=False):
        by_row = {row: (g.step_ms.tolist(), g["round"].tolist())
                  for row, g in cell.groupby("row", sort=False)}
        for row, g in cell.groupby("row", sort=False):
            record = dict(model=model, link=link, ranks=n, row=row, steps=len(g),
                          rounds=g["round"].nunique(), step_ms=median(g.step_ms.tolist()),
                          step_p10_ms=g.step_ms.quantile(0.1),
                          step_p90_ms=g.step_ms.quantile(0.9),
                          median_ci_pct=median_ci_pct(*by_row[row]),
                          forward_backward_ms=g.forward_backward_ms.median(),
                          communicate_ms=g.communicate_ms.median(),
                          bytes_sent=g.bytes_sent.median(), wire_bytes=g.wire_bytes.median())
            for base in BASES:
                name = "vs_" + base.replace(":", "_")
                ratio = paired_ratio(*by_row[row], *by_row[base]) if base in by_row \
                    else (math.nan,) * 3
                record[name], record[f"{name}_lo"], record[f"{name}_hi"] = ratio
            out.append(record)
    return pd.DataFrame(out)


def plot(summary, path, cpu):
    """One panel per (model, link, ranks): each row's median step over FSDP2's default's,
    round by round, with its 95% interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = list(dict.fromkeys(zip(summary.model, summary.link, summary.ranks)))
    fig, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 4.2), sharey=True,
                             squeeze=False)
    for ax, (model, link, n) in zip(axes[0], cells):
        f = summary[(summary.model == model) & (summary.link == link) & (summary.ranks == n)]
        err = [(f.vs_fsdp_none - f.vs_fsdp_none_lo).clip(lower=0),
               (f.vs_fsdp_none_hi - f.vs_fsdp_none).clip(lower=0)]
        colors = ["#999" if r in ("fsdp:none", "fsdp:bf16reduce") else "#2ca02c"
                  if r == LOCAL_ROW else "#ff7f0e" if r.startswith("ddp:") else "#1f77b4"
                  for r in f.row]
        ax.bar(range(len(f)), f.vs_fsdp_none, color=colors, yerr=err, capsize=2)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(f)), list(f.row), rotation=70, fontsize=7)
        ax.set_title(f"{model}, {link}, n={n}", fontsize=9)
    axes[0][0].set_ylabel("step / FSDP2 default's step\n(round by round; lower: faster)")
    fig.suptitle("Training step on FSDP2 (Gloo): FSDP2's own (grey), hvd_compress.fsdp (blue),\n"
                 f"DDP (orange), no exchange (green), 95% intervals; {cpu}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_memory(memory, path, cpu):
    """Per (model, ranks): each row's peak resident set above its start, rank 0, beside the
    parameters + gradients + optimizer state it holds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mem = memory[memory["rank"] == 0]
    cells = list(dict.fromkeys(zip(mem.model, mem.ranks)))
    fig, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 4), squeeze=False)
    for ax, (model, n) in zip(axes[0], cells):
        f = mem[(mem.model == model) & (mem.ranks == n)]
        x = range(len(f))
        ax.bar([i - 0.2 for i in x], f.peak_rss_mb, 0.4, label="peak RSS above start")
        ax.bar([i + 0.2 for i in x], f.tensors_mb, 0.4, label="params+grads+momentum(+buckets)")
        ax.set_xticks(list(x), list(f.row), rotation=70, fontsize=7)
        ax.set_title(f"{model}, n={n}, rank 0", fontsize=9)
        ax.set_ylabel("MiB")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Memory per rank on FSDP2 and DDP\n{cpu}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def cpu_name():
    """`lscpu`'s model name, family and model, and its CPUs: what every figure says."""
    fields = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        return "CPU unknown"
    return (f"{fields.get('Model name', '?')} (family {fields.get('CPU family', '?')}, model "
            f"{fields.get('Model', '?')}), {fields.get('CPU(s)', '?')} CPUs")


def replot(out):
    import pandas as pd
    out, cpu = Path(out), cpu_name()
    summary = None
    if (out / "steps.csv").is_file():
        summary = summarise(pd.read_csv(out / "steps.csv"))
        summary.to_csv(out / "summary.csv", index=False, float_format="%.4g")
        plot(summary, out / "summary.png", cpu)
    if (out / "memory.csv").is_file():
        plot_memory(pd.read_csv(out / "memory.csv"), out / "memory.png", cpu)
    return summary


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_grid_arguments(p, ROWS, "results/fsdp", LINKS)
    p.add_argument("--memory", action="store_true",
                   help="measure memory per rank instead: each row alone, MEMORY_STEPS steps, "
                        "over loopback (memory.csv, memory.png)")
    p.add_argument("--replot", action="store_true", help="redraw OUT's summary from its CSV")
    args = p.parse_args(argv)
    if args.worker:
        return args
    check_grid(p, args, LINKS, known_row, f"{ROWS} and fsdp:<{'|'.join(SCHEMES)}>")
    if WEIGHTS_ROW in args.rows and not weights_option():
        print(f"[bench_fsdp] {WEIGHTS_ROW} left out: this hvd_compress.fsdp's register() takes "
              "no weights= (the weights' all-gather is FSDP2's own)", file=sys.stderr, flush=True)
        args.rows.remove(WEIGHTS_ROW)
    if KEPT_ROW in args.rows and not kept_option():
        print(f"[bench_fsdp] {KEPT_ROW} left out: this hvd_compress.fsdp's register() takes "
              "no keep_weight_codes=", file=sys.stderr, flush=True)
        args.rows.remove(KEPT_ROW)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        replot(out)
        return 0
    if args.memory:
        path = (out / "memory.csv").resolve()
        path.write_text(",".join(MEMORY_COLUMNS) + "\n")
        for model in args.models:
            for n in args.ranks:
                for row in args.rows:
                    print(f"[bench_fsdp] memory: {model}, {n} ranks, {row}", flush=True)
                    launch(args, model, "loopback", n, path, rows=[row], memory=True)
        replot(out)
        print(open(path).read())
        return 0
    path = (out / "steps.csv").resolve()
    path.write_text(",".join(STEP_COLUMNS) + "\n")
    for model in args.models:
        for link in args.links:
            for n in args.ranks:
                print(f"[bench_fsdp] {model} over {link}, {n} ranks", flush=True)
                launch(args, model, link, n, path)
    summary = replot(out)
    cols = ["model", "link", "ranks", "row", "step_ms", "median_ci_pct", "rounds",
            "vs_fsdp_none", "vs_fsdp_bf16reduce", "vs_local", "bytes_sent", "wire_bytes"]
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
