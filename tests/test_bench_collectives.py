"""Tests of the collectives benchmark (labs/netem/bench.py, `python -m labs.netem.bench`):
argument parsing and the analysis on synthetic numbers (pure), then a tiny real run with
horovodrun (2 ranks, 2 sizes, few repetitions) whose CSVs pandas reads and the cost model fits,
and, as root, the same under netem with the NIC byte counters; the timing loop's repetitions on
real ranks (tests/workers/bench_checks.py, in the 2-rank jobs of tests/hvdrun.py). No timing
target lives here (machines are noisy): only that times are positive and the files are whole.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hvdrun import across_ranks, passed_checks
from labs.netem import bench

REPO = Path(__file__).resolve().parents[1]
KiB, MiB = 2**10, 2**20


# ---------------------------------------------------------------- pure parts

@pytest.mark.unit
def test_parse_sizes_ranges_and_lists():
    assert bench.parse_sizes("1KiB:64KiB") == [1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB]
    assert bench.parse_sizes("1KiB:8KiB:x2") == [1 * KiB, 2 * KiB, 4 * KiB, 8 * KiB]
    assert bench.parse_sizes("1MiB,4096,1MiB") == [4096, MiB]
    assert bench.parse_sizes("1KiB:64MiB")[-1] == 64 * MiB       # the brief's range, both ends
    for bad in ("", "1KB:1B", "1KiB:4KiB:x1", "12 parsecs", "0"):
        with pytest.raises(ValueError):
            bench.parse_sizes(bad)


@pytest.mark.unit
def test_parse_schemes():
    assert bench.parse_schemes(["bit8:allgather", "none:allreduce"]) == [
        ("bit8", "allgather"), ("none", "allreduce")]
    for bad in (["bit8"], ["bit4:allgather"], ["bit8:broadcast"], ["fp16:alltoall"],
                ["hvd_fp16:allgather"]):
        with pytest.raises(ValueError):
            bench.parse_schemes(bad)


@pytest.mark.unit
def test_scheme_names_come_from_the_registry():
    from hvd_compress.registry import COURSE_SCHEMES, SCHEMES, label
    assert {f"{name}:{route}" for name in COURSE_SCHEMES for route in SCHEMES[name].routes} \
        == set(bench.DEFAULT_SCHEMES) - {"hvd_fp16:allreduce"}
    assert bench._model_scheme("bit8", "alltoall") == ("alltoall", 8)
    assert bench._model_scheme("none", "allreduce") == ("allreduce_ring", 32)
    assert label("bit8", "alltoall") in bench.DEFAULT_SCHEMES


@pytest.mark.unit
def test_output_paths_are_named_after_out():
    p = bench.output_paths(Path("r/x.csv"))
    assert p["schemes"] == Path("r/x_schemes.csv") and p["plot"] == Path("r/x.png")
    assert p["summary"] == Path("r/x_summary.csv") and p["fit"] == Path("r/x_fit.json")


@pytest.mark.unit
def test_summarize_matches_numpy_quantiles():
    rng = np.random.default_rng(0)
    secs = rng.lognormal(-5, 0.3, size=40)
    df = pd.DataFrame({"collective": "allreduce", "n": 2, "bytes": 1024, "seconds": secs})
    s = bench.summarize(df, ["collective", "n", "bytes"]).iloc[0]
    assert s["reps"] == 40
    assert s["median_s"] == pytest.approx(np.median(secs))
    assert s["p10_s"] == pytest.approx(np.quantile(secs, 0.1))
    assert s["p90_s"] == pytest.approx(np.quantile(secs, 0.9))
    assert s["min_s"] <= s["p10_s"] <= s["median_s"] <= s["p90_s"] <= s["max_s"]


@pytest.mark.unit
def test_fit_recovers_a_synthetic_link_and_ratios_use_the_same_run():
    # Primitives made from a known link: alpha 100 us, 1 GB/s; the fit must give them back,
    # and a scheme twice as slow as allreduce must show a time ratio of 2.
    alpha, beta = 100e-6, 1e-9
    rows = []
    for n in (2, 4):
        for b in (KiB, 64 * KiB, MiB, 16 * MiB):
            t = 2 * (n - 1) * alpha + 2 * (n - 1) / n * b * beta
            rows += [{"collective": "allreduce", "dtype": "float32", "n": n, "bytes": b,
                      "seconds": t * f, "bytes_per_rank": 2 * (n - 1) / n * b}
                     for f in (0.99, 1.0, 1.01)]
    prim_raw = pd.DataFrame(rows)
    prim = bench.summarize(prim_raw, ["collective", "dtype", "n", "bytes"])
    schemes = prim[["n", "bytes"]].copy()
    schemes["scheme"], schemes["compression"], schemes["reduction"] = (
        "bit8_allgather", "bit8", "allgather")
    schemes["median_s"] = 2 * prim["median_s"]
    schemes["bytes_sent"] = (schemes["n"] - 1) * (schemes["bytes"] / 4 + 8)
    prim, schemes, fits = bench.fit_and_predict(prim_raw, prim, schemes)
    assert fits["allreduce"].alpha == pytest.approx(alpha, rel=1e-6)
    assert fits["allreduce"].beta == pytest.approx(beta, rel=1e-6)
    assert np.allclose(prim["predicted_s"], prim["median_s"], rtol=1e-6)
    assert np.allclose(prim["pooled_predicted_s"], prim["median_s"], rtol=1e-6)
    for n in (2, 4):                    # the per-n fits find the same link at each n
        assert fits[f"allreduce@n={n}"].alpha == pytest.approx(alpha, rel=1e-6)
        assert fits[f"allreduce@n={n}"].beta == pytest.approx(beta, rel=1e-6)
    out = bench.add_ratios(prim, schemes)
    assert np.allclose(out["time_ratio"], 2.0)
    # bit8 allgather at n = 2 sends g/4 + 8 bytes; fp32 ring allreduce sends g: ratio ~ 1/4
    two = out[(out["n"] == 2) & (out["bytes"] == 16 * MiB)].iloc[0]
    assert two["bytes_ratio"] == pytest.approx((16 * MiB / 4 + 8) / (16 * MiB))


# ---------------------------------------------------------------- a tiny real run

COLUMNS = {"collective", "n", "bytes", "rep", "seconds"}


def _tiny_args(out):
    return ["--out", str(out), "--sizes", "4KiB,256KiB", "--warmup", "1", "--min-reps", "3",
            "--max-reps", "3", "--budget", "0.01",
            "--schemes", "none:allreduce", "bit8:allgather", "bit8:alltoall"]


def _check_outputs(out, n_values):
    prim = pd.read_csv(out)
    assert COLUMNS <= set(prim.columns)
    assert set(prim["collective"]) == {"allreduce", "allgather", "alltoall"}
    assert sorted(prim["n"].unique()) == n_values
    assert sorted(prim["bytes"].unique()) == [4 * KiB, 256 * KiB]
    assert (prim["seconds"] > 0).all() and prim["seconds"].notna().all()
    assert (prim.groupby(["collective", "n", "bytes"]).size() == 3).all()   # 3 reps each
    schemes = pd.read_csv(bench.output_paths(out)["schemes"])
    assert set(schemes["scheme"]) == {"none_allreduce", "bit8_allgather", "bit8_alltoall"}
    assert (schemes["seconds"] > 0).all()
    assert (schemes["communicate_s"] > 0).all() and (schemes["bytes_sent"] > 0).all()
    # the communicators' own byte counts: bit8 allgather sends (n-1) bucket messages of g/4
    # codes and their block scales (compressors.message_bytes)
    from hvd_compress.compression import Compression
    bit8 = schemes[schemes["scheme"] == "bit8_allgather"]
    for n, g, sent in zip(bit8["n"], bit8["bytes"], bit8["bytes_sent"]):
        assert sent == (n - 1) * Compression.bit8.message_bytes(g // 4), (n, g, sent)
    summary = pd.read_csv(bench.output_paths(out)["summary"])
    assert {"median_s", "p10_s", "p90_s", "predicted_s", "pooled_predicted_s", "rel_err",
            "pooled_rel_err", "time_ratio"} <= set(summary.columns)
    assert (summary["predicted_s"] > 0).all()
    fit = json.loads(bench.output_paths(out)["fit"].read_text())
    assert {f["collective"] for f in fit["fits"]} >= {"allreduce", "allgather", "alltoall"}
    assert {f["n"] for f in fit["fits"]} == {None, *n_values}
    assert bench.output_paths(out)["plot"].stat().st_size > 10_000
    return prim, schemes


@pytest.mark.multiprocess
def test_tiny_loopback_run_then_costmodel_fit(tmp_path, monkeypatch, capfd):
    # The driver, the cost model's command line and --analyze run in this process (each one's
    # main(argv), what its script calls): only horovodrun and the ranks are processes of their
    # own. `python -m labs.netem.bench` itself runs in test_worker_refuses_to_run_without_a_launcher.
    from hvd_compress.costmodel.__main__ import main as costmodel_main
    out = tmp_path / "bench.csv"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    rc = bench.main(["--launch", "loopback", "-n", "2", "--timeout", "240"] + _tiny_args(out))
    printed = capfd.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    _check_outputs(out, [2])
    assert "vs fp32 allreduce" in printed.out
    # The cost model's own command line reads the primitives file as it is.
    assert costmodel_main(["--fit", str(out), "--format", "json"]) == 0
    fits = {f["collective"]: f for f in json.loads(capfd.readouterr().out)["fits"]}
    assert fits["allreduce"]["beta_s_per_byte"] > 0 or fits["allreduce"]["alpha_s"] > 0
    # --analyze redoes the analysis from the CSVs alone
    os.remove(bench.output_paths(out)["summary"])
    assert bench.main(["--analyze", str(out)]) == 0
    assert bench.output_paths(out)["summary"].exists()


@pytest.mark.interpreter
def test_worker_refuses_to_run_without_a_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_"))}
    r = subprocess.run([sys.executable, "-m", "labs.netem.bench", "--out", str(tmp_path / "x.csv")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "launcher" in r.stderr


@pytest.mark.netns
@pytest.mark.usefixtures("emulated_network")      # probed when this test runs, not at import
def test_tiny_netem_run_counts_wire_bytes(tmp_path):
    out = tmp_path / "net.csv"
    r = subprocess.run([sys.executable, "-m", "labs.netem", "bench", "-n", "2",
                        "--rate", "1gbit", "--timeout", "240", "--"] + _tiny_args(out),
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    prim, schemes = _check_outputs(out, [2])
    assert (prim["transport"] == "netem").all() and (prim["link_rate_bps"] == 1e9).all()
    # Each rank's NIC sent at least what the collective must move (headers come on top).
    assert (prim["wire_tx_bytes"] >= prim["bytes_per_rank"]).all()
    bit8 = schemes[schemes["scheme"] == "bit8_allgather"]
    assert (bit8["wire_tx_bytes"] >= bit8["bytes_sent"]).all()
    assert not math.isnan(pd.read_csv(bench.output_paths(out)["summary"])["wire_tx_bytes"].max())


@pytest.mark.multiprocess
@across_ranks("bench_checks")
def test_time_cases_gives_each_case_its_own_repetitions(controller, np, request):
    # On real ranks (tests/workers/bench_checks.py): a 0.5 ms case gets the cap (30), a 0.4 s
    # one the floor (3), timed in interleaved rounds, the same rows on every rank.
    names = passed_checks(request)
    for what in ("small_case_gets_max_reps", "large_case_gets_min_reps", "reps_numbered",
                 "seconds_at_least_the_sleep", "rounds_interleaved", "small_alone_after_large_is_done",
                 "same_rows_on_every_rank"):
        assert f"time_cases.{what}" in names
