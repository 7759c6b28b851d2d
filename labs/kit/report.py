"""Fill report_template.md with a run matrix's numbers: report.md, the course's lab report.

    python -m labs.kit.report                                   # runs/matrix -> runs/report.md
    python -m labs.kit.report --summary runs/x/summary.csv --out runs/x/report.md

Paths are relative to the current folder: run
it from the checkout's top folder, where report_template.md is.

Two tables, laid out like the course's lab report (headings in Chinese and English):
the environment (servers, NIC, GPU, OS, drivers, framework and packages, CUDA), taken from the
manifest the trainer wrote while running, and the results (training algorithm, devices,
training time, accuracy) with the per-step time breakdown and bytes on the wire beside them.

It fails, writing nothing, when a number is missing (an unfinished run, a NaN) or a
placeholder is left: a report must never show a blank where a measurement should be.
"""
import argparse
import math
import re
import sys
import time
from pathlib import Path

from hvd_compress.registry import other_schemes, run_name

from . import network, runlog, tta
from .matrix import read_summary
from .table import ROW_ORDER

PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
# The NaN guard reads the numbers, not the words the report quotes: a plan, a fallback's reason
# (say, "rank 1's median step is nan"), a path or a run name is free text in a code span, and
# is left out; a number the tables and sentences print is a NaN where it reads "nan" (Python's
# format of one: with a sign, a unit or a ratio's "x" beside it, but inside no other word).
CODE_SPAN = re.compile(r"`[^`\n]*`")
NAN_NUMBER = re.compile(r"(?<![a-wyz])nan(?![a-z])", flags=re.IGNORECASE)   # 'x1.73' -> 'xnan'

# How the course names each configuration (the rows of its results table).
ALGORITHMS = {
    "none": "用Horovod并行 / Horovod (float32 allreduce)",
    "fp16": "Horovod fp16 cast (--fp16-allreduce)",
    "bit16": "float16(16bit)压缩 / float16 compression",
    "bit8": "float8(8bit)压缩 / float8 compression",
    "int8": "int8 量化 / int8, stochastic rounding",
    "onebit": "1-bit 符号 / 1-bit sign + error feedback",
    "topk": "Top-K 稀疏化 / Top-K sparsification",
    "powersgd": "PowerSGD 低秩 / PowerSGD low rank",
    "auto": "自动选择 / auto: per-bucket plan (--auto-allreduce)",
}
REQUIRED = ["ranks", "train_time_s", "final_test_accuracy", "step_ms", "forward_backward_ms",
            "compress_ms", "communicate_ms", "decompress_ms", "update_ms", "bytes_per_step"]

# Forward+backward is the same work in every row of one device count (same network, batch and
# data; the schemes differ only after it). When two rows' forward+backward differ by more than
# this, the host ran them in different states (a slower hour, a busy neighbour), and a ratio of
# their step times measures the host as much as the scheme: the report says so beside it.
STATE_TOLERANCE = 0.15


MODELS = {
    "basic": "pytorch/examples' mnist/main.py network (2 conv layers 32/64, dropout, 9216 -> "
             "128 -> 10; 1,199,882 parameters, 4.8 MB of float32 gradients a step)",
    "horovod": "Horovod's PyTorch MNIST example network (2 conv + 2 linear layers; 21,840 "
               "parameters)",
}


class ReportError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# Reading the matrix
# ---------------------------------------------------------------------------------------------

def load_summary(path):
    frame = read_summary(path, error=ReportError)
    unfinished = frame[frame["status"] != "complete"]
    if len(unfinished):
        raise ReportError(f"{path}: runs not complete: "
                          + ", ".join(f"{r.run} ({r.status})" for r in unfinished.itertuples())
                          + "; finish them (the matrix resumes) before filling the report")
    for column in REQUIRED:
        if column not in frame:
            raise ReportError(f"{path}: column {column} is missing")
        missing = frame[frame[column].isna()]
        if len(missing):
            raise ReportError(f"{path}: no {column} for {', '.join(missing['run'])}")
    order = {name: i for i, name in enumerate(ROW_ORDER)}
    frame["_order"] = [order.get(run, len(order)) for run in frame["run"]]
    return frame.sort_values(["_order", "ranks", "run"], kind="stable").drop(columns="_order")


def run_manifests(summary_path, frame):
    base = Path(summary_path).parent
    manifests = {}
    for row in frame.itertuples():
        manifest = runlog.read_manifest(base / row.run_dir)
        if manifest is None:
            raise ReportError(f"{base / row.run_dir}: manifest.json is missing")
        manifests[row.run] = manifest
    return manifests


# ---------------------------------------------------------------------------------------------
# Environment table
# ---------------------------------------------------------------------------------------------

def environment_fields(env, controllers):
    """The course's environment rows from a manifest's 'environment' (or this machine's)."""
    nics = [n for n in env.get("nics", []) if n["name"] != "lo"]
    if nics:
        nic_text = f"{len(nics)}: " + "; ".join(
            f"{n['name']} ({n.get('driver') or 'virtual'}"
            f"{', %d Mb/s' % n['speed_mbps'] if n.get('speed_mbps') else ''}, {n['state']})"
            for n in nics)
    else:
        nic_text = "none (loopback only)"
    nic_text += "; all processes run on this one server and talk over loopback / shared memory"
    gpus = env.get("gpus", [])
    if gpus:
        names = sorted({g["name"] for g in gpus})
        gpu_text = f"{', '.join(names)} x {len(gpus)}"
        connection = "PCIe (" + ", ".join(g["pci_bus"] for g in gpus) + ")"
        gpu_driver = "NVIDIA " + ", ".join(sorted({g["driver"] for g in gpus}))
    else:
        gpu_text, connection, gpu_driver = "none (CPU only)", "none", "none"
    nic_drivers = sorted({n["driver"] for n in nics if n.get("driver")})
    memory = f", {env['memory_gib']} GiB memory" if env.get("memory_gib") else ""
    return {
        "servers": f"1 ({env['hostname']}: {env['cpu_model']}, {env['cpus_usable']} usable "
                   f"cores{memory})",
        "nics": nic_text,
        "gpus": gpu_text,
        "gpu_connection": connection,
        "os": f"{env['os']}, Linux kernel {env['kernel']}",
        "drivers": f"GPU driver: {gpu_driver}; NIC driver: "
                   f"{', '.join(nic_drivers) if nic_drivers else 'none'}",
        "framework": (f"PyTorch {env['torch']}, Horovod {env['horovod']} (controller: "
                      f"{', '.join(controllers)}), {env['mpi']}; Python {env['python']}, "
                      f"numpy {env['numpy']}, pandas {env['pandas']}, matplotlib "
                      f"{env['matplotlib']}, ml_dtypes {env['ml_dtypes']}, hvd_compress "
                      f"{env['hvd_compress']}"),
        "cuda": cuda_text(env),
    }


def cuda_text(env):
    used = env.get("cuda") or "none"
    toolkit = env.get("cuda_toolkit") or "none"
    if used == "none":
        text = "none (PyTorch is the CPU build)"
        return text + (f"; CUDA toolkit {toolkit} installed, unused" if toolkit != "none" else "")
    return f"{used} (PyTorch build)" + (f"; toolkit {toolkit}" if toolkit != "none" else "")


# ---------------------------------------------------------------------------------------------
# Results table
# ---------------------------------------------------------------------------------------------

def algorithm(row):
    if row.ranks == 1:
        return "串行训练 / Serial"
    name = ALGORITHMS.get(row.compression, str(row.compression))
    extras = []
    if row.compression in ("bit8", "bit16"):
        extras.append(str(row.reduction))
    if str(row.error_feedback) == "True":
        extras.append("error feedback")
    return name + (f" ({', '.join(extras)})" if extras else "")


def fmt_ms(value):
    return f"{value:.2f}"


def results_table(frame):
    header = ("| 训练算法 / Algorithm | 设备数 / Devices | 训练时间 / Training time (s) | "
              "结果正确率 / Accuracy | 每步 / Step (ms) | 前向+反向 / Fwd+bwd (ms) | "
              "压缩 / Compress (ms) | 通信 / Communicate (ms) | 解压 / Decompress (ms) | "
              "更新 / Update (ms) | 每步发送 / Bytes sent per step | 运行 / Run |")
    lines = [header, "|" + "---|" * 12]
    for row in frame.itertuples():
        devices = "1" if row.ranks == 1 else f"Device# == {row.ranks}"
        lines.append(
            f"| {algorithm(row)} | {devices} | {row.train_time_s:.1f} | "
            f"{100 * row.final_test_accuracy:.2f}% | {fmt_ms(row.step_ms)} | "
            f"{fmt_ms(row.forward_backward_ms)} | {fmt_ms(row.compress_ms)} | "
            f"{fmt_ms(row.communicate_ms)} | {fmt_ms(row.decompress_ms)} | "
            f"{fmt_ms(row.update_ms)} | {row.bytes_per_step:,.0f} | `{row.run}` |")
    return "\n".join(lines)


def method_label(row):
    """'topk 0.01', 'powersgd rank 2', 'onebit': a method with its parameter."""
    if row.compression == "topk":
        return f"topk {row.method_parameter:g}"
    if row.compression == "powersgd":
        return f"powersgd rank {int(row.method_parameter)}"
    return str(row.compression)


def methods_section(frame):
    """The other methods (the matrix's --methods rows) beside float32 allreduce and Horovod's
    fp16 allreduce of the same matrix run: accuracy, bytes per step (counted, and the cost
    model's formula), step time, each as a ratio to both baselines."""
    methods = other_schemes()
    rows = frame[frame["compression"].isin(methods)]
    if rows.empty:
        return ("Not run in this matrix: `python -m labs.kit.matrix --methods` (or "
                "`bash scripts/run_lab.sh --methods`) adds " + ", ".join(methods)
                + " at 2 and 4 processes.")
    by_run = {row.run: row for row in frame.itertuples()}
    header = ("| 方法 / Method | 设备数 / Devices | 正确率 / Accuracy | vs fp32 (points) | "
              "每步发送 / Bytes per step | 公式 / Formula | bytes / fp32 | bytes / fp16 | "
              "每步 / Step (ms) | step / fp32 | step / fp16 | 运行 / Run |")
    lines = [header, "|" + "---|" * 12]
    order = sorted(rows.itertuples(), key=lambda r: (r.ranks, methods.index(r.compression)))
    for row in order:
        fp32, fp16 = by_run.get(run_name(row.ranks, "none")), by_run.get(run_name(row.ranks, "fp16"))
        if fp32 is None or fp16 is None:
            raise ReportError(f"{row.run}: the matrix has no {run_name(row.ranks, 'none')} or "
                              f"{run_name(row.ranks, 'fp16')} to compare it with")
        formula = "n/a" if math.isnan(row.bytes_formula) else f"{row.bytes_formula:,.0f}"
        lines.append(
            f"| {method_label(row)} | {row.ranks} | {100 * row.final_test_accuracy:.2f}% | "
            f"{100 * (row.final_test_accuracy - fp32.final_test_accuracy):+.2f} | "
            f"{row.bytes_per_step:,.0f} | {formula} | "
            f"{row.bytes_per_step / fp32.bytes_per_step:.3f} | "
            f"{row.bytes_per_step / fp16.bytes_per_step:.3f} | {row.step_ms:.2f} | "
            f"{row.step_ms / fp32.step_ms:.2f} | {row.step_ms / fp16.step_ms:.2f} | `{row.run}` |")
    return "\n".join(lines) + "\n\n![正确率与每步字节 / Accuracy against bytes per step](methods.png)"


def _ratio(rows, run, base, column="step_ms"):
    a, b = rows.get(run), rows.get(base)
    return math.nan if a is None or b is None else getattr(a, column) / getattr(b, column)


def state_shift(row, base):
    """forward+backward of `row` relative to `base`'s, minus 1 (the same work in both)."""
    return row.forward_backward_ms / base.forward_backward_ms - 1


def state_note(row, base):
    """'' when the two rows ran in one machine state, else a note that says they did not, and
    the ratio of what is left of the step once forward+backward is taken out."""
    shift = state_shift(row, base)
    if abs(shift) <= STATE_TOLERANCE:
        return ""
    rest = (row.step_ms - row.forward_backward_ms) / (base.step_ms - base.forward_backward_ms)
    return (f" [measured in a different machine state: forward+backward, the same work in both "
            f"rows, took {100 * shift:+.0f}% in this row; the rest of the step (exchange and "
            f"codecs) is x{rest:.2f} of float32's]")


def pays_sentence(n, scheme, on_link, on_loop, loop_note, break_even, rate):
    """One line of 'where compression pays': the two measured ratios, the model's break-even,
    and, where a measurement disagrees with the model, that disagreement, never a verdict a
    number beside it contradicts."""
    text = (f"- {n} processes, {scheme}: step x{on_link:.2f} of float32's at "
            f"{network.rate_text(rate)} ({'pays' if on_link < 1 else 'does not pay'} there), "
            f"x{on_loop:.2f} over loopback ({'faster' if on_loop < 1 else 'not faster'} there)"
            f"{loop_note}")
    if break_even <= 0:
        return text + "; the model says it never pays (it saves no bytes)."
    if math.isinf(break_even):
        text += ("; the model (the link's alpha-beta terms and decoding) finds no fixed cost "
                 "above float32's, so no break-even rate")
        if on_loop >= 1:
            text += (f"; the measured x{on_loop:.2f} over loopback says it does not pay at every "
                     f"rate on this host: the model leaves out costs loopback shows"
                     + (" (and the rows ran in different machine states)" if loop_note else ""))
    else:
        text += (f"; the model puts the break-even at {network.rate_text(break_even)}: it pays "
                 f"on links slower than that")
    model_pays_here = break_even > rate
    if model_pays_here != (on_link < 1):
        text += (f"; measured at {network.rate_text(rate)} it "
                 f"{'does not pay' if on_link >= 1 else 'pays'}, against the model")
    return text + "."


def network_section(net_path, calibration, loop_frame, skipped=None):
    """The parallel rows again over an emulated link: step times as ratios to float32 and to
    Horovod's fp16 on that link and over loopback, each exchange predicted beside the measured
    one, bytes on the wire beside the bytes counted, the break-even rate; then where
    compression pays, computed from both tables."""
    if skipped:
        return (f"Not run: {skipped}. The network table needs root and network namespaces "
                f"(`python -m labs.netem check` says what is missing); `bash scripts/run_lab.sh` "
                f"runs it where they work.")
    frame = load_summary(net_path)
    manifests = run_manifests(net_path, frame)
    try:
        links, idle = network.load_calibration(calibration)
        preds = {p.run: p for p in network.predictions(frame, manifests, loop_frame, links,
                                                       idle)}
    except network.NetworkError as err:
        raise ReportError(str(err)) from None
    rates = sorted({r for r in frame["netem_rate_bps"] if r == r})
    if len(rates) != 1:
        raise ReportError(f"{net_path}: expected one emulated link rate, got {rates or 'none'}")
    rate = rates[0]
    steps = sorted({int(s) for s in frame["steps_per_epoch"]})
    net = {row.run: row for row in frame.itertuples()}
    loop = {row.run: row for row in loop_frame.itertuples()}
    lines = [f"Link: {network.rate_text(rate)} per process (labs.netem: one network namespace "
             f"per process, a tbf-shaped veth each), Gloo; "
             f"{', '.join(map(str, steps))} steps per process per run (a timing table: the "
             f"accuracy of so short a run says nothing). Same network, seed and flags as the "
             f"table above.", "",
             "| 训练算法 / Algorithm | 设备数 / Devices | 每步 / Step (ms) | step / bound | "
             "step / fp32 | "
             "step / fp16 | loopback step / fp32 | 通信实测 / Exchange measured (ms) | "
             "预测 / Predicted (ms) | error | 计数字节 / Bytes counted per step | "
             "网卡字节 / Bytes on the wire per step | wire / counted | 盈亏平衡 / Pays below | "
             "运行 / Run |", "|" + "---|" * 15]
    for row in frame.itertuples():
        if row.ranks < 2 or row.run not in preds:   # auto: its own table below
            continue
        p = preds[row.run]
        fp32, fp16 = run_name(row.ranks, "none"), run_name(row.ranks, "fp16")
        judged = "" if p.judged else " (not judged: < 5 ms)"
        pays = ("—" if row.compression == "none" else
                "none in the model" if math.isinf(p.break_even_bps) else
                network.rate_text(p.break_even_bps))
        shifted = (row.run in loop and fp32 in loop
                   and abs(state_shift(loop[row.run], loop[fp32])) > STATE_TOLERANCE)
        try:
            bound = network.step_bound(row, rate)
        except network.NetworkError as err:
            raise ReportError(str(err)) from None
        lines.append(
            f"| {algorithm(row)} | {row.ranks} | {row.step_ms:.1f} | "
            f"{bound.ratio:.2f} of {bound.bound_ms:.0f} "
            f"({'wire' if bound.wire_ms >= bound.floor_ms else 'floor'}) | "
            f"{_ratio(net, row.run, fp32):.2f} | {_ratio(net, row.run, fp16):.2f} | "
            f"{_ratio(loop, row.run, fp32):.2f}{' †' if shifted else ''} | {p.measured_ms:.1f} | "
            f"{p.predicted_ms:.1f} | "
            f"{100 * p.error:+.0f}%{judged} | {row.bytes_per_step:,.0f} | "
            f"{row.wire_bytes_per_step:,.0f} | {row.wire_bytes_per_step / row.bytes_per_step:.3f} | "
            f"{pays} | `{row.run}` |")
    auto = auto_on_link(frame, net, rate)
    auto_lines = [auto, ""] if auto else []
    judged = [p for p in preds.values() if p.judged]
    worst = max(judged, key=lambda p: abs(p.error)) if judged else None
    within = sum(abs(p.error) <= network.TOLERANCE for p in judged)
    lines += ["", f"- Predictions within {100 * network.TOLERANCE:.0f}% of the measured exchange: "
              f"{within} of {len(judged)} rows with an exchange of at least "
              f"{network.JUDGED_MS:g} ms" + (f"; the largest error is {100 * worst.error:+.0f}% "
                                             f"({worst.run})." if worst else "."),
              "- Prediction: T = max(S, t_1 + ... + t_(k-1)) + t_k + D for the k units (buckets, "
              "or tensors) of a step in the order backward produces them, t_i = alpha_c m_i + "
              "beta_c b_i for each collective c of unit i (alpha, beta fitted on this link, "
              "below: on busy cores until S, on idle cores after it, a collective running "
              "across S at each pace for its part), S the slowest process's measured launch "
              "span (its first unit launched to its last: backward's pace), D the decode time "
              "of the same configuration in the loopback table; for the two-phase route "
              "(bit16) t_i is the alltoall and the allgathers of the reduced chunks follow "
              "(`hvd_compress/costmodel/methods.py` exchange_seconds, `labs/kit/network.py`). "
              "Encoding is left out: it runs before each launch, inside S or while earlier "
              "units are on the wire.",
              "- step / bound: the step against what the machine and the link allow, "
              "bound = max(floor, wire) in ms, and which of the two it is: floor, the row's mean "
              "step less its mean wait for the exchange (the process's own forward, backward, "
              "coding and update); wire, the bytes a process counted per step at the link's "
              "rate (TCP and Ethernet framing not counted: wire / counted says how much they "
              "add). 1.00 would be a step that waits for nothing the link does not force "
              "(`labs/kit/network.py` step_bound).",
              "- Pays below: the link rate b* under which the compressed exchange is faster "
              "than float32's, from the fit without overlap (the exchange after backward: the "
              "idle-core fit where there is one): T(b) = L + D + 8 W / b, "
              "b* = 8 (W_32 - W_k) / ((L_k + D_k) - (L_32 + D_32)), with W the bytes a step's "
              "collectives move (their beta terms at the calibrated rate), L their alpha terms "
              "(`break_even_rate`). 'none in the model': in the model, compression costs no "
              "fixed time more than float32, so it has no break-even rate (a statement about "
              "the link's terms; the loopback column is what this host measured).",
              f"- †: this loopback row and float32's ran in different machine states "
              f"(forward+backward, the same work, differs by more than "
              f"{100 * STATE_TOLERANCE:.0f}%); its ratio measures the host as much as the "
              f"scheme. 'Where compression pays' below gives the rest of the step apart.",
              "- Bytes on the wire: each process's eth0 transmit counter "
              "(/sys/class/net/eth0/statistics/tx_bytes in its namespace), read before and "
              "after the training loop of each epoch, per process and step.",
              "", wire_sentence(frame), ""] + auto_lines + [calibration_table(links, idle),
              "", where_it_pays(net, loop, preds, rate)]
    return "\n".join(lines) + "\n\n![网络上的步时间与预测 / Step time and predicted exchange on the emulated link](network.png)"


def plan_table(frame, baseline):
    """The --auto-allreduce rows: the plan (scheme:route per bucket, launch order), the
    optimizer's predicted step beside its measured one, the table's mean step (calibration
    included) against float32's of the same table; `baseline(ranks)` gives that float32 row."""
    try:
        rows = network.plan_rows(frame)
    except network.NetworkError as err:
        raise ReportError(str(err)) from None
    header = ("| 设备数 / Devices | 计划 / Plan (scheme:route per bucket) | 预测 / Predicted step "
              "(ms) | 实测 / Measured step since the plan (ms) | error | 每步 / Step, whole run "
              "(ms) | step / fp32 | 决策 / Calibration (s, of training) | 正确率 / Accuracy | "
              "vs fp32 (points) | 运行 / Run |")
    lines = [header, "|" + "---|" * 11]
    for p in rows:
        row = frame[frame["run"] == p.run].iloc[0]
        fp32 = baseline(p.ranks)
        if fp32 is None:
            raise ReportError(f"{p.run}: the table has no {run_name(p.ranks, 'none')} to "
                              f"compare it with")
        planned = math.isfinite(p.predicted_ms)      # else it fell back: no prediction
        quoted = p.plan.replace("`", "'")            # free text, kept whole in its code span
        lines.append(
            f"| {p.ranks} | `{quoted}` | "
            + (f"{p.predicted_ms:.1f} | {p.plan_measured_ms:.1f} | {100 * p.error:+.0f}% | "
               if planned else "— | — | — | ")
            + f"{p.step_ms:.1f} | {p.step_ms / fp32.step_ms:.2f} | "
            f"{p.calibration_s:.2f} ({100 * p.calibration_s / p.train_time_s:.1f}%) | "
            f"{100 * row.final_test_accuracy:.2f}% | "
            f"{100 * (row.final_test_accuracy - fp32.final_test_accuracy):+.2f} | `{p.run}` |")
    return "\n".join(lines)


PLAN_NOTES = ("- Plan: each gradient bucket's scheme and route, in the order backward launches "
              "them, as the optimizer chose it from what the job measured (backward's pace, the "
              "link, the codecs' cost; docs/planner.md); the run folder's manifest.json holds "
              "the whole `plan_report` (buckets, bytes, measurements, refused candidates, "
              "calibration time, events) and steps.csv the plan of every step; "
              "`python -m hvd_compress.auto --report <run>/manifest.json` decides again "
              "from that record and shows why (every fixed scheme's predicted step, each "
              "bucket's timeline).\n"
              "- Predicted: the plan's step on the cost model's timeline; measured: the "
              "optimizer's median step since the plan was applied (issue 25's target: within "
              "15%). Step, whole run: the table's mean over every step, calibration included, "
              "so what the decision cost is in it. Calibration: the seconds the optimizer "
              "spent measuring for its plans (its `plan_report`'s `calibration_s`, rank 0), and "
              "their share of the run's training time (issue 25's target: under 2%).")


def auto_section(frame):
    """The per-bucket plan's rows of the loopback table, or how to add them."""
    if not (frame["compression"] == "auto").any():
        return ("Not run in this matrix: `python -m labs.kit.matrix --auto` (or `bash "
                "scripts/run_lab.sh --auto`) adds the per-bucket plan (`--auto-allreduce`) at 2 "
                "and 4 processes.")
    by_run = {row.run: row for row in frame.itertuples()}
    return (plan_table(frame, lambda n: by_run.get(run_name(n, "none"))) + "\n\n" + PLAN_NOTES)


def auto_on_link(frame, net, rate):
    """The per-bucket plan's rows on the emulated link (empty when the table has none)."""
    if not (frame["compression"] == "auto").any():
        return ""
    return (f"### 自动选择 / The per-bucket plan on the {network.rate_text(rate)} link\n\n"
            + plan_table(frame, lambda n: net.get(run_name(n, "none"))) + "\n\n" + PLAN_NOTES)


def wire_sentence(frame):
    rows = frame[frame["ranks"] > 1]
    ratio = rows["wire_bytes_per_step"] / rows["bytes_per_step"]
    extra = rows["wire_bytes_per_step"] - rows["bytes_per_step"]
    return (f"Wire against counted: x{ratio.min():.3f} to x{ratio.max():.3f} "
            f"({extra.min():,.0f} to {extra.max():,.0f} bytes per step more on the wire). The "
            f"counted bytes are the gradient payload; the wire adds TCP/IPv4/Ethernet framing "
            f"(66 bytes on every 1,448-byte segment: +4.6% on bulk data), the ACKs of what the "
            f"process receives, and Horovod's control traffic (every collective is negotiated "
            f"through the coordinator; not measured apart).")


def calibration_table(links, idle=None):
    """The fitted links: on busy cores (what the exchange meets while backward runs) and, if
    calibrated, on idle cores (after backward)."""
    if idle is None:
        lines = ["Calibration (labs.netem.bench on the same link with every core kept busy, as "
                 "backward keeps them while the exchange runs; fitted per collective and "
                 "number of processes, `python -m hvd_compress.costmodel --fit`):", "",
                 "| collective | n | alpha (ms) | bandwidth (Mbit/s) |", "|---|---|---|---|"]
    else:
        lines = ["Calibration (labs.netem.bench on the same link, fitted per collective and "
                 "number of processes, `python -m hvd_compress.costmodel --fit`): with every "
                 "core kept busy, as backward keeps them for the first S of the exchange, and "
                 "on idle cores, as they are after it:", "",
                 "| collective | n | alpha, busy (ms) | bandwidth, busy (Mbit/s) | "
                 "alpha, idle (ms) | bandwidth, idle (Mbit/s) |", "|---|---|---|---|---|---|"]
    for n in sorted(links):
        for collective, link in sorted(links[n].items()):
            row = f"| {collective} | {n} | {1000 * link.alpha:.3f} | {8 * link.bandwidth / 1e6:.1f} |"
            if idle is not None:
                after = idle.get(n, {}).get(collective)
                row += (" — | — |" if after is None else
                        f" {1000 * after.alpha:.3f} | {8 * after.bandwidth / 1e6:.1f} |")
            lines.append(row)
    return "\n".join(lines)


def where_it_pays(net, loop, preds, rate):
    """The section's conclusion, computed from both tables."""
    lines = ["### 压缩何时划算 / Where compression pays (computed from both tables)", ""]
    for n in sorted({row.ranks for row in net.values() if row.ranks > 1}):
        fp32 = run_name(n, "none")
        for scheme in ("bit8", "bit16", "fp16"):
            run = run_name(n, scheme)
            if run not in net or fp32 not in net:
                continue
            on_link, on_loop = _ratio(net, run, fp32), _ratio(loop, run, fp32)
            note = state_note(loop[run], loop[fp32]) if run in loop and fp32 in loop else ""
            lines.append(pays_sentence(n, scheme, on_link, on_loop, note,
                                       preds[run].break_even_bps, rate))
    return "\n".join(lines)


def _seconds(value):
    return "—" if math.isinf(value) else f"{value:.0f}"


def _never(composed, epochs):
    return f"not within {epochs} epochs" if not composed.reach.reached else str(composed.reach.step)


def tta_section(summary_path, loop_frame, net_path, skipped=None):
    """Each parallel row's time to two targets on the network table's link: its steps to the
    target over loopback (the table's held-out evaluations), its step on the link (the network
    table), and what the run spent besides its steps (labs/kit/tta.py); over loopback beside
    it, the run's own time to the target, measured. Then whether compression pays, computed."""
    base = Path(summary_path).parent
    loop = {row.run: (base / row.run_dir, int(row.ranks), str(row.compression))
            for row in loop_frame.itertuples() if row.ranks > 1}
    missing = [run for run, (folder, _, _) in loop.items() if not (folder / "evals.csv").is_file()]
    if missing or not loop:
        return ("Not measured in this table: its runs held no images out of the training set "
                "(`python -m labs.kit.job` runs the table with `--holdout 2000`: each run scores "
                "them as it trains, and the report says here when each scheme reached its "
                "target on the network table's link).")
    if skipped or net_path is None:
        return (f"Not computed: no network table ({skipped or 'none given'}). The steps to "
                "each target are counted (the table's `evals.csv`); the time on a slow link "
                "needs that link's step.")
    net = load_summary(net_path)
    rates = sorted({r for r in net["netem_rate_bps"] if r == r})
    rate = rates[0]
    steps_on_link = {row.run: row.step_ms / 1e3 for row in net.itertuples() if row.ranks > 1}
    try:
        rows = tta.compose_runs(loop, steps_on_link, lambda n: run_name(n, "none"))
    except tta.RunError as err:
        raise ReportError(str(err)) from None
    if not rows:
        raise ReportError(f"{net_path}: no parallel row of the table has a step on the link")
    epochs = int(loop_frame["epochs"].max())
    by = {(c.run, c.target_name): c for c in rows}
    first = runlog.read_manifest(next(iter(loop.values()))[0])
    held, every = first["data"]["holdout_samples"], first["args"]["eval_every"]
    every_images = every * first["args"]["batch_size"] * first["world_size"]
    lines = [f"Does compression pay? Not if its step is shorter, but if it reaches the accuracy "
             f"you need sooner. Each row's steps to two targets counted over loopback (the "
             f"table above: {held:,} images held out of the training set, scored every "
             f"{every_images:,} training images; in synchronous training the steps do not "
             f"depend on the link), its step on the emulated {network.rate_text(rate)} link "
             f"(the network table), so time = start-up + steps x step + evaluations + epoch "
             f"ends (the last three as the run measured them; `labs/kit/tta.py`). Targets, per "
             f"number of processes: float32's held-out accuracy after the table's {epochs} "
             f"epoch(s) minus 0.5 points (**lab**), and float32's own (**float32**). One seed: "
             f"`results/tta/` measures the spread over seeds and every other method.", "",
             "| 训练算法 / Algorithm | 设备数 / Devices | 每步 / Step on the link (ms) | "
             "step / fp32 | 目标 lab / steps | time on the link (s) | vs fp32 | "
             "目标 float32 / steps | time on the link (s) | vs fp32 | over loopback, measured "
             "(s, lab / float32) | 运行 / Run |", "|" + "---|" * 12]
    for c in sorted((c for c in rows if c.target_name == "lab"), key=lambda c: (
            c.ranks, ROW_ORDER.index(c.run) if c.run in ROW_ORDER else len(ROW_ORDER), c.run)):
        strict = by[(c.run, "float32")]
        fp32 = run_name(c.ranks, "none")
        lab32, strict32 = by[(fp32, "lab")], by[(fp32, "float32")]
        row = loop_frame[loop_frame["run"] == c.run].iloc[0]
        lines.append(
            f"| {algorithm(row)} | {c.ranks} | {1e3 * c.step_s:.0f} | "
            f"{c.step_s / lab32.step_s:.2f} | {_never(c, epochs)} | {_seconds(c.seconds)} | "
            f"{_ratio_text(c.seconds, lab32.seconds)} | {_never(strict, epochs)} | "
            f"{_seconds(strict.seconds)} | {_ratio_text(strict.seconds, strict32.seconds)} | "
            f"{_seconds(c.loopback_s)} / {_seconds(strict.loopback_s)} | `{c.run}` |")
    targets = sorted({(c.ranks, c.target_name, c.target) for c in rows})
    lines += ["", "Targets (held-out accuracy): " + "; ".join(
        f"{n} processes {name} {100 * t:.2f}%" for n, name, t in targets) + ".", "",
        "### 压缩划算吗 / Does compression pay? (computed from the table above)", ""]
    lines += pays_in_time(rows, rate)
    return "\n".join(lines) + ("\n\n![精度与时间 / Held-out accuracy against time on the link]"
                               "(tta.png)")


def _ratio_text(value, base):
    if math.isinf(value):
        return "—"
    return f"x{value / base:.2f}" if math.isfinite(base) else "—"


def _scheme(composed):
    """A run's scheme as the sentences name it: float32, bit8, bit8 alltoall, ..."""
    name = "float32" if composed.compression == "none" else composed.compression
    rest = composed.run.split("-")[2:]
    return " ".join([name] + rest)


def pays_in_time(rows, rate):
    """A line per number of processes and target: each compressed scheme's time on the link
    against float32's (pays or not), the first to get there, and the same runs' own times over
    loopback, measured."""
    lines = []
    for n in sorted({c.ranks for c in rows}):
        for name in ("lab", "float32"):
            cells = [c for c in rows if c.ranks == n and c.target_name == name]
            fp32 = next(c for c in cells if c.compression == "none")
            first = min(cells, key=lambda c: c.seconds)
            verdicts = "; ".join(
                f"{_scheme(c)} {_seconds(c.seconds)} s " + (
                    f"(x{c.seconds / fp32.seconds:.2f}: "
                    f"{'pays' if c.seconds < fp32.seconds else 'does not pay'})"
                    if math.isfinite(c.seconds) else "(never reached it: does not pay)")
                for c in cells if c.compression != "none")
            loopback = ", ".join(f"{_scheme(c)} {_seconds(c.loopback_s)} s" for c in cells)
            lines.append(f"- {n} processes, target {name} ({100 * fp32.target:.2f}%), on the "
                         f"{network.rate_text(rate)} link: float32 {_seconds(fp32.seconds)} s; "
                         f"{verdicts}. First there: {_scheme(first)}. Over loopback, "
                         f"measured: {loopback}.")
    return lines


def findings(frame, cpus):
    """Sentences computed from the table: what compression bought at each device count."""
    by_run = {row.run: row for row in frame.itertuples()}
    lines = ["### 观察 / Observations (computed from the table)", ""]
    serial = by_run.get("serial")
    for ranks in sorted({int(r) for r in frame["ranks"] if r > 1}):
        base = by_run.get(run_name(ranks, "none"))
        if serial is not None and base is not None:
            speedup = serial.train_time_s / base.train_time_s
            lines.append(f"- {ranks} processes vs serial: training time "
                         f"{base.train_time_s:.1f} s vs {serial.train_time_s:.1f} s "
                         f"(speed-up {speedup:.2f}"
                         f"{', i.e. slower than serial' if speedup < 1 else ''}), accuracy "
                         f"{100 * base.final_test_accuracy:.2f}% vs "
                         f"{100 * serial.final_test_accuracy:.2f}%.")
        for compression in ("bit16", "bit8", "fp16"):
            other = by_run.get(run_name(ranks, compression))
            if base is None or other is None or not base.bytes_per_step:
                continue
            lines.append(
                f"- {ranks} processes, {compression} vs float32: "
                f"{other.bytes_per_step:,.0f} vs {base.bytes_per_step:,.0f} bytes per step "
                f"(x{other.bytes_per_step / base.bytes_per_step:.3f}), step "
                f"{other.step_ms:.2f} ms vs {base.step_ms:.2f} ms "
                f"(x{other.step_ms / base.step_ms:.2f}){state_note(other, base)}, of which "
                f"compress+decompress "
                f"{other.compress_ms + other.decompress_ms:.2f} ms; accuracy "
                f"{100 * other.final_test_accuracy:.2f}% vs "
                f"{100 * base.final_test_accuracy:.2f}%.")
    most = int(frame["ranks"].max())
    if cpus and most > cpus:
        lines.append(f"- Caution: {most} processes shared {cpus} cores, so step times include "
                     f"CPU contention; the processes talk over loopback, where bytes are cheap. "
                     f"Fewer bytes pay off on a real network (see docs/lab.md).")
    return "\n".join(lines) if len(lines) > 2 else ""


def setup_text(frame, manifests):
    first = manifests[frame["run"].iloc[0]]
    args = first["args"]
    data = first["data"]
    split = (f", training on the first {data['split_test']} test images and testing on the "
             f"other {data['test_samples']}" if data.get("split_test") else "")
    model = MODELS.get(args.get("model", "horovod"), args.get("model"))
    block = args.get("scale_block")
    return (f"- 数据集 / Data set: {data['name']} from `{data['folder']}` (md5-checked){split}\n"
            f"- 超参数 / Hyperparameters: epochs {args['epochs']}; SGD, learning rate "
            f"{args['lr']} x number of processes (constant), momentum "
            f"{args['momentum']}; batch size "
            f"{args['batch_size']} per process (test batch {args['test_batch_size']}); seed "
            f"{args['seed']}; {args['num_threads']} torch thread(s) per process; 8/16-bit "
            f"packets: a power-of-two scale per {block} values, buckets of up to 1 MiB of "
            f"float32. Where these differ from Horovod's example (lr 0.01, momentum 0.5, "
            f"its small network), docs/lab.md says why.\n"
            f"- 模型 / Model: {model}")


def epoch_size(frame, manifests):
    sizes = sorted({manifests[r]["data"]["train_samples"] for r in frame["run"]})
    epochs = sorted({manifests[r]["args"]["epochs"] for r in frame["run"]})
    return (f"{', '.join(f'{s:,}' for s in sizes)} training images per epoch, "
            f"{', '.join(map(str, epochs))} epoch(s)")


# ---------------------------------------------------------------------------------------------
# Filling
# ---------------------------------------------------------------------------------------------

def fill(template, values):
    """Replace every {{name}}; unknown names and leftovers are errors."""
    names = set(PLACEHOLDER.findall(template))
    unknown = names - set(values)
    if unknown:
        raise ReportError(f"no value for placeholder(s): {', '.join(sorted(unknown))}")
    for name, value in values.items():
        if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
            if name in names and name != "findings":
                raise ReportError(f"placeholder {name} has no value")
    text = PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)
    if PLACEHOLDER.search(text):
        raise ReportError("a placeholder is left in the report")
    if NAN_NUMBER.search(CODE_SPAN.sub("``", text)):
        raise ReportError("the report would contain NaN")
    return text


def build_report(summary_path, template_path, network_summary=None, calibration=None,
                 network_skipped=None):
    frame = load_summary(summary_path)
    manifests = run_manifests(summary_path, frame)
    env = manifests[frame["run"].iloc[0]].get("environment") or runlog.environment()
    controllers = sorted({str(m.get("controller")) for r, m in manifests.items()
                          if m.get("world_size", 1) > 1}) or ["none (serial only)"]
    values = environment_fields(env, controllers)
    values.update(
        generated=time.strftime("%Y-%m-%d %H:%M"),
        summary_path=str(Path(summary_path)),
        setup=setup_text(frame, manifests),
        epoch_size=epoch_size(frame, manifests),
        results_table=results_table(frame[~frame["compression"].isin(other_schemes())]),
        methods_section=methods_section(frame),
        auto_section=auto_section(frame),
        findings=findings(frame, env.get("cpus_usable")),
        network_section=network_section(
            network_summary, calibration, frame,
            network_skipped or (None if network_summary else
                                "no network table was given (--network-summary)")),
        tta_section=tta_section(summary_path, frame, network_summary, network_skipped),
    )
    return fill(Path(template_path).read_text(encoding="utf-8"), values)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", default="runs/matrix/summary.csv")
    parser.add_argument("--template", default="report_template.md")
    parser.add_argument("--out", default="runs/report.md",
                        help="the filled report (the plots go next to it: labs.kit.plots --out-dir)")
    parser.add_argument("--network-summary", default=None,
                        help="the network table's summary.csv (labs/kit/job.py)")
    parser.add_argument("--calibration", default=None,
                        help="its link's calibration fit (labs.netem.bench *_fit.json)")
    parser.add_argument("--network-skipped", default=None, metavar="WHY",
                        help="why there is no network table (said in the report)")
    args = parser.parse_args(argv)
    if args.network_summary and not args.calibration:
        parser.error("--network-summary needs --calibration")
    try:
        text = build_report(args.summary, args.template, args.network_summary,
                            args.calibration, args.network_skipped)
    except ReportError as err:
        print(f"fill_report: {err}", file=sys.stderr)
        return 1
    runlog.atomic_write_text(Path(args.out), text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
