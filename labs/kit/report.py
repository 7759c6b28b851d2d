"""Fill report_template.md with a run matrix's numbers: report.md, the course's lab report.

    python -m labs.kit.report                                   # runs/matrix -> report.md
    python -m labs.kit.report --summary runs/x/summary.csv --out runs/x/report.md

(scripts/fill_report.py is the same command.)  Paths are relative to the current folder: run
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

from hvd_compress.registry import METHODS, run_name

from . import runlog
from .matrix import read_summary
from .table import ROW_ORDER

PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")

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
}
REQUIRED = ["ranks", "train_time_s", "final_test_accuracy", "step_ms", "forward_backward_ms",
            "compress_ms", "communicate_ms", "decompress_ms", "update_ms", "bytes_per_step"]


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
    rows = frame[frame["compression"].isin(METHODS)]
    if rows.empty:
        return ("Not run in this matrix: `python -m labs.kit.matrix --methods` (or "
                "`bash scripts/run_lab.sh --methods`) adds int8, onebit, top-k and PowerSGD "
                "at 2 and 4 processes.")
    by_run = {row.run: row for row in frame.itertuples()}
    header = ("| 方法 / Method | 设备数 / Devices | 正确率 / Accuracy | vs fp32 (points) | "
              "每步发送 / Bytes per step | 公式 / Formula | bytes / fp32 | bytes / fp16 | "
              "每步 / Step (ms) | step / fp32 | step / fp16 | 运行 / Run |")
    lines = [header, "|" + "---|" * 12]
    order = sorted(rows.itertuples(), key=lambda r: (r.ranks, METHODS.index(r.compression)))
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
                f"(x{other.step_ms / base.step_ms:.2f}), of which compress+decompress "
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
    return (f"- 数据集 / Data set: {data['name']} from `{data['folder']}` (md5-checked){split}\n"
            f"- Epochs: {args['epochs']}; batch size {args['batch_size']} per process; "
            f"learning rate {args['lr']} x number of processes; momentum {args['momentum']}; "
            f"seed {args['seed']}\n"
            f"- 模型 / Model: Horovod's PyTorch MNIST example network (2 conv + 2 linear layers)")


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
    if re.search(r"\bnan\b", text, flags=re.IGNORECASE):
        raise ReportError("the report would contain NaN")
    return text


def build_report(summary_path, template_path):
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
        results_table=results_table(frame[~frame["compression"].isin(METHODS)]),
        methods_section=methods_section(frame),
        findings=findings(frame, env.get("cpus_usable")),
    )
    return fill(Path(template_path).read_text(encoding="utf-8"), values)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", default="runs/matrix/summary.csv")
    parser.add_argument("--template", default="report_template.md")
    parser.add_argument("--out", default="report.md")
    args = parser.parse_args(argv)
    try:
        text = build_report(args.summary, args.template)
    except ReportError as err:
        print(f"fill_report: {err}", file=sys.stderr)
        return 1
    runlog.atomic_write_text(Path(args.out), text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
