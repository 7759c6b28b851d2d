"""The cost model's bytes per method (hvd_compress/costmodel/methods.py): its model shapes are
the lab's networks, its buckets are the optimizer's, its formulas are the counts of
the communicators (the multi-process workers check the counts on real ranks), and the CLI's
--methods table."""
import subprocess
import sys

import pytest
import torch

from hvd_compress.codecs import SCALE_BLOCK
from hvd_compress.exchange.routes import DEFAULT_FUSION_BYTES
from hvd_compress import registry
from hvd_compress.costmodel import methods
from hvd_compress.exchange.fusion import buckets_by_size
from labs.mnist import MODELS

pytestmark = pytest.mark.unit


def test_model_shapes_are_the_labs_networks():
    for name, net in MODELS.items():
        assert methods.MODEL_SHAPES[name] == [tuple(p.shape) for p in net().parameters()]


# The buckets the optimizer fuses, worked out by hand from the networks' parameter sizes:
# gradients arrive last layer first (backward order) and fuse while their float32 bytes fit in
# the threshold (inclusive); a tensor larger than the threshold travels alone, 0 fuses nothing.
#   horovod, backward: fc2.b 10, fc2.w 500, fc1.b 50, fc1.w 16,000, conv2.b 20, conv2.w 5,000,
#                      conv1.b 10, conv1.w 250                               (21,840 in all)
#   basic, backward:   fc2.b 10, fc2.w 1,280, fc1.b 128, fc1.w 1,179,648, conv2.b 64,
#                      conv2.w 18,432, conv1.b 32, conv1.w 288            (1,199,882 in all)
# 4096 bytes hold 1,024 values; 1 MiB (the default) holds 262,144.
BY_HAND = {
    ("horovod", 0): [10, 500, 50, 16000, 20, 5000, 10, 250],
    ("horovod", 4096): [10 + 500 + 50, 16000, 20, 5000, 10 + 250],
    ("horovod", DEFAULT_FUSION_BYTES): [21840],
    ("basic", 0): [10, 1280, 128, 1179648, 64, 18432, 32, 288],
    ("basic", 4096): [10, 1280, 128, 1179648, 64, 18432, 32 + 288],
    ("basic", DEFAULT_FUSION_BYTES): [10 + 1280 + 128, 1179648, 64 + 18432 + 32 + 288],
}


@pytest.mark.parametrize("model,threshold", sorted(BY_HAND))
def test_buckets_are_the_optimizers(model, threshold):
    """The cost model's buckets and the optimizer's (fusion.buckets_by_size, which the
    communicators fuse with) against the sizes worked out by hand above."""
    params = list(MODELS[model]().parameters())
    assert methods.buckets([p.numel() for p in params], threshold) == BY_HAND[model, threshold]
    backward = params[::-1]
    groups = buckets_by_size(backward, threshold)
    assert [sum(backward[i].numel() for i in g) for g in groups] == BY_HAND[model, threshold]
    assert sorted(i for g in groups for i in g) == list(range(len(params)))   # each once, in order


def test_bucket_edges():
    """A bucket that fills its threshold exactly is kept; one value more starts the next."""
    assert methods.buckets([1, 256, 256], 2048) == [512, 1]        # backward: 256, 256, 1
    assert methods.buckets([1, 256, 257], 2048) == [257, 257]
    assert methods.buckets([600, 100], 2048) == [100, 600]         # 600 alone is over 2048
    assert methods.buckets([], 2048) == []
    with pytest.raises(ValueError, match="fusion threshold"):
        methods.buckets([1], -1)


def test_formulas_by_hand():
    # lab network at 2 ranks: 21,840 values in one bucket; float32 ring: 2(n-1)/n * 4 numel
    shapes = methods.MODEL_SHAPES["horovod"]
    assert methods.bytes_per_step("none", shapes, 2) == 4 * 21840
    assert methods.bytes_per_step("bit8", shapes, 2) == 21840 + 4 * 86          # 86 scales
    assert methods.bytes_per_step("onebit", shapes, 2) == 4 * 86 + 2732         # 2730 -> 2732
    assert methods.bytes_per_step("topk", [(1000,), (10,)], 3) == 2 * 8 * (10 + 1)
    assert methods.bytes_per_step("powersgd", [(50, 320), (50,)], 2) == 4 * ((50 + 320) * 2 + 50)
    assert all(methods.bytes_per_step(m, shapes, 1) == 0 for m in ("none", "bit8", "topk"))


@pytest.mark.interpreter
def test_cli_methods_table():
    out = subprocess.run([sys.executable, "-m", "hvd_compress.costmodel", "--methods", "basic",
                          "--nodes", "2", "--bandwidth", "100Mbit/s", "--latency", "50us",
                          "--format", "csv"], capture_output=True, text=True, check=True).stdout
    import io
    import pandas as pd
    rows = pd.read_csv(io.StringIO(out)).set_index("method")
    assert list(rows.index) == list(registry.schemes())           # bf16 too: the registry's
    assert rows.loc["bf16", "route"] == "alltoall" and rows.loc["topk", "route"] == "allgather"
    assert rows.loc["none", "bytes_vs_fp32"] == 1
    assert rows.loc["onebit", "bytes_vs_fp32"] < 1 / 28 and rows.loc["bit8", "bytes_vs_fp32"] < 0.26
    bad = subprocess.run([sys.executable, "-m", "hvd_compress.costmodel", "--methods", "basic"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--methods needs --nodes, --bandwidth, --latency" in bad.stderr
    assert torch.Size(methods.MODEL_SHAPES["basic"][4]).numel() == 128 * 9216


def test_report_methods_section_from_the_committed_matrix(tmp_path):
    """The report's section of the other methods, filled from results/matrix (a real run):
    one row per method and size, ratios computed against that run's float32 and fp16 rows,
    counted bytes beside the formula; and the accuracy-against-bytes plot is drawn."""
    import pandas as pd
    from conftest import ROOT
    from labs.kit import plots, report
    summary = ROOT / "results" / "matrix" / "summary.csv"
    text = report.build_report(summary, ROOT / "report_template.md")
    rows = [line for line in text.splitlines() if line.endswith("` |") and "| 设备数" not in line
            and line.split("|")[1].strip().split()[0] in ("int8", "onebit", "topk", "powersgd")]
    frame = pd.read_csv(summary).set_index("run")
    assert len(rows) == 8
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        run = cells[-1].strip("`")
        fp32 = frame.loc[run.replace(run.split("-")[1], "none")]
        assert cells[4] == cells[5] == f"{frame.loc[run, 'bytes_per_step']:,.0f}"   # counted = formula
        assert cells[6] == f"{frame.loc[run, 'bytes_per_step'] / fp32['bytes_per_step']:.3f}"
        assert cells[3] == f"{100 * (frame.loc[run, 'final_test_accuracy'] - fp32['final_test_accuracy']):+.2f}"
    assert plots.plot_methods(pd.read_csv(summary), tmp_path / "methods.png")
    assert (tmp_path / "methods.png").stat().st_size > 10_000
