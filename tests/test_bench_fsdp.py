"""labs/bench/fsdp.py: its rows and arguments, its summary's paired ratios, and a small job of
the lab's network on 2 Gloo ranks over loopback (rows side by side, bytes counted, memory per
rank from the tensors)."""
import math

import pandas as pd
import pytest

from labs.bench import fsdp as bench_fsdp


@pytest.mark.unit
def test_the_rows_and_the_weights_row():
    args = bench_fsdp.parse_args(["--models", "basic", "--links", "100mbit", "--ranks", "2"])
    assert {"fsdp:none", "fsdp:bf16reduce", "fsdp:bit8", "ddp:none", "ddp:bit8",
            "local"} <= set(args.rows)
    # the compressed all-gather's row runs only where register() takes weights=
    assert (bench_fsdp.WEIGHTS_ROW in args.rows) == bench_fsdp.weights_option()
    assert bench_fsdp.known_row("fsdp:int8") and not bench_fsdp.known_row("fsdp:topk")
    for bad in (["--rows", "fsdp:topk"], ["--ranks", "1"], ["--links", "wifi"]):
        with pytest.raises(SystemExit):
            bench_fsdp.parse_args(bad)


@pytest.mark.unit
def test_the_summary_pairs_rows_round_by_round():
    """A row twice as fast as fsdp:none in every round is 0.5x whatever the rounds' drift."""
    rows = []
    for rnd in range(1, 7):
        drift = 1 + 0.5 * rnd                      # the machine slows round by round
        for step in range(3):
            for row, ms in (("fsdp:none", 100), ("fsdp:bf16reduce", 80), ("fsdp:bit8", 50),
                            ("local", 40)):
                rows.append(dict(model="basic", link="100mbit", ranks=2, row=row, round=rnd,
                                 step=step, step_ms=ms * drift, forward_backward_ms=1,
                                 compress_ms=0, communicate_ms=0, decompress_ms=0,
                                 bytes_sent=1, wire_bytes=math.nan))
    summary = bench_fsdp.summarise(pd.DataFrame(rows)).set_index("row")
    assert summary.loc["fsdp:bit8", "vs_fsdp_none"] == pytest.approx(0.5)
    assert summary.loc["fsdp:bit8", "vs_fsdp_bf16reduce"] == pytest.approx(50 / 80)
    assert summary.loc["fsdp:bit8", "vs_local"] == pytest.approx(50 / 40)
    assert summary.loc["fsdp:none", "rounds"] == 6
    # the medians alone drift with the machine; the paired ratio's interval does not
    assert summary.loc["fsdp:bit8", "vs_fsdp_none_hi"] == pytest.approx(0.5)


@pytest.mark.multiprocess
def test_a_small_job_times_every_row_and_measures_memory(tmp_path):
    rows = "fsdp:none,fsdp:bf16reduce,fsdp:bit8,ddp:none,ddp:bit8,local"
    assert bench_fsdp.main(["--models", "lab", "--links", "loopback", "--ranks", "2",
                            "--rows", rows, "--steps", "2", "--rounds", "2", "--warmup", "1",
                            "--out", str(tmp_path)]) == 0
    summary = pd.read_csv(tmp_path / "summary.csv").set_index("row")
    assert set(summary.index) == set(rows.split(","))
    assert (summary.rounds == 2).all() and (summary.step_ms > 0).all()
    assert summary.loc["fsdp:none", "vs_fsdp_none"] == 1.0
    assert summary.vs_local.notna().all()
    sent = summary.bytes_sent
    assert sent["fsdp:bit8"] < 0.3 * sent["fsdp:none"]           # 8-bit codes and block scales
    assert sent["fsdp:bf16reduce"] == sent["fsdp:none"] / 2
    assert sent["local"] == 0
    assert (tmp_path / "summary.png").stat().st_size > 0
    assert bench_fsdp.main(["--memory", "--models", "lab", "--ranks", "2", "--rows",
                            "fsdp:none,ddp:none", "--out", str(tmp_path)]) == 0
    memory = pd.read_csv(tmp_path / "memory.csv")
    assert len(memory) == 4 and (memory.peak_rss_mb > 0).all()
    by = memory[memory["rank"] == 0].set_index("row")
    # a rank of FSDP2 holds half of every parameter (padded), its gradient and momentum
    assert by.loc["fsdp:none", "param_mb"] < 0.6 * by.loc["ddp:none", "param_mb"]
    assert by.loc["fsdp:none", "optimizer_mb"] < 0.6 * by.loc["ddp:none", "optimizer_mb"]
    assert by.loc["ddp:none", "ddp_bucket_mb"] == by.loc["ddp:none", "grad_mb"]
