"""The network table's arithmetic (hvd_compress.costmodel.methods, labs/kit/network.py): a
step's exchange call by call, its time on calibrated links, the break-even rate; and the job
that runs the lab end to end (labs/kit/job.py), planned without running it."""
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT

from hvd_compress.costmodel import methods
from hvd_compress.costmodel.model import Cost, Link
from labs.kit import job, network

pytestmark = pytest.mark.unit

CASES = [(m, r) for m in ("none", "fp16", "bit8", "int8", "onebit", "topk", "powersgd")
         for r in (None,)] + [("bit16", None), ("bit16", "allgather"), ("bit8", "alltoall"),
                              ("int8", "alltoall")]


@pytest.mark.parametrize("model", ["basic", "horovod"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("method,route", CASES)
def test_exchange_units_move_the_bytes_the_formula_counts(model, n, method, route):
    """Call by call, the bandwidth terms add up to bytes_per_step (which tests compare with
    the communicators' own counts), for both networks, every method and route; the formula
    rounds each ring allreduce's 2(n-1)/n share down to whole bytes, the model does not."""
    shapes = methods.MODEL_SHAPES[model]
    units = methods.exchange_units(method, shapes, n, route=route)
    moved = sum(methods.COLLECTIVE_COSTS[c](n, b).bytes for unit in units for c, b in unit)
    counted = methods.bytes_per_step(method, shapes, n, route=route)
    assert counted <= moved + 1e-6 and moved - counted < len(units) * 2
    counts = [methods.numel(s) for s in shapes]
    expected_units = (len(methods.buckets(counts)) if method in ("bit8", "bit16", "int8", "onebit")
                      else len(shapes))
    assert len(units) == expected_units


def test_exchange_seconds_by_hand():
    """Two units on a link of 1 ms and 1 us/byte at n = 2 (allgather: alpha + (n-1) b beta):
    t1 = 2 ms, t2 = 3 ms; serial 5 ms; if backward launches the last one 4 ms after the first,
    4 + 3 = 7 ms."""
    links = {"allgather": Link(alpha=1e-3, beta=1e-6)}
    units = [[("allgather", 1000)], [("allgather", 2000)]]
    assert methods.exchange_seconds(units, 2, links) == pytest.approx(5e-3)
    assert methods.exchange_seconds(units, 2, links, launch_span=4e-3) == pytest.approx(7e-3)
    assert methods.exchange_seconds(units, 2, links, launch_span=1e-3) == pytest.approx(5e-3)
    assert methods.exchange_seconds([], 2, links) == 0.0
    two = [[("allgather", 1000)] * 2, [("allgather", 2000)] * 2]        # phases of 2+2, 3+3 ms
    assert methods.exchange_seconds(two, 2, links, 6e-3, True) == pytest.approx(14e-3)  # 6+3+2+3
    assert methods.exchange_seconds(two, 2, links, 0.0, True) == pytest.approx(10e-3)


def test_exchange_after_backward_runs_at_the_idle_pace():
    """Busy cores until backward ends (launch_span), idle after: t1 = 2 ms busy / 1 ms idle,
    t2 = 3 / 1.5 ms. S = 4 ms: t1 busy (0-2), t2 idle (4-5.5). S = 1 ms: t1 half done at 1 ms,
    its other half at idle pace (0.5 ms), then t2 idle: 3 ms. S = 0: all idle, 2.5 ms."""
    busy = {"allgather": Link(alpha=1e-3, beta=1e-6)}
    idle = {"allgather": Link(alpha=0.5e-3, beta=0.5e-6)}
    units = [[("allgather", 1000)], [("allgather", 2000)]]
    assert methods.exchange_seconds(units, 2, busy, 4e-3, links_after=idle) == pytest.approx(5.5e-3)
    assert methods.exchange_seconds(units, 2, busy, 1e-3, links_after=idle) == pytest.approx(3e-3)
    assert methods.exchange_seconds(units, 2, busy, 0.0, links_after=idle) == pytest.approx(2.5e-3)
    assert methods.exchange_seconds(units, 2, busy, 20e-3, links_after=idle) == pytest.approx(21.5e-3)


def test_break_even_rate_is_where_the_two_times_meet():
    fp32, bit8 = Cost(1e-3, 1e6), Cost(3e-3, 0.25e6)
    rate = methods.break_even_rate(fp32, bit8, 0.0, 2e-3)
    assert rate == pytest.approx(8 * 0.75e6 / 4e-3)            # 1.5 Gbit/s

    def t(cost, codec, b):
        return cost.messages + codec + 8 * cost.bytes / b
    assert t(fp32, 0, rate) == pytest.approx(t(bit8, 2e-3, rate))
    assert t(bit8, 2e-3, rate / 2) < t(fp32, 0, rate / 2)        # slower links: it pays
    assert t(bit8, 2e-3, rate * 2) > t(fp32, 0, rate * 2)
    assert methods.break_even_rate(fp32, Cost(1e-3, 0.25e6), 0.0, 0.0) == math.inf
    assert methods.break_even_rate(fp32, Cost(0.5e-3, 2e6), 0.0, 0.0) == 0.0


def test_predictions_of_a_row(tmp_path):
    """A network row predicted from its manifest, the calibration and the loopback twin's
    decode time: the link part by exchange_seconds, plus the decode."""
    import json
    import pandas as pd
    fit = {"fits": [{"collective": c, "n": 2, "alpha_s": 1e-3, "beta_s_per_byte": 8e-8}
                    for c in ("allreduce", "allgather", "alltoall")]
           + [{"collective": "all", "n": 2, "alpha_s": 1e-3, "beta_s_per_byte": 8e-8}]}
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    links = network.load_links(tmp_path / "fit.json")
    assert set(links) == {2} and set(links[2]) == {"allreduce", "allgather", "alltoall"}
    shapes = methods.MODEL_SHAPES["basic"]
    manifests = {f"np2-{c}": {"parameter_shapes": shapes, "compression": c, "world_size": 2,
                              "reduction": r, "args": {"scale_block": 256}}
                 for c, r in (("none", "allreduce"), ("bit8", "allgather"))}
    net = pd.DataFrame({"run": ["np2-none", "np2-bit8"], "ranks": [2, 2],
                        "compression": ["none", "bit8"], "exchange_ms": [400.0, 120.0],
                        "launch_span_ms": [50.0, 110.0], "netem_rate_bps": [1e8, 1e8]})
    loop = pd.DataFrame({"run": ["np2-none", "np2-bit8"], "decompress_ms": [0.5, 4.0]})
    preds = {p.run: p for p in network.predictions(net, manifests, loop, links)}
    units = methods.exchange_units("bit8", shapes, 2, route="allgather", block=256)
    wire = methods.exchange_seconds(units, 2, links[2], launch_span=0.110)
    assert preds["np2-bit8"].predicted_ms == pytest.approx(1000 * wire + 4.0)
    assert preds["np2-bit8"].error == pytest.approx(preds["np2-bit8"].predicted_ms / 120 - 1)
    assert math.isnan(preds["np2-none"].break_even_bps)
    assert preds["np2-bit8"].break_even_bps > 1e8                # it pays at 100 Mbit/s
    with pytest.raises(network.NetworkError, match="loopback table has no np2-bit8"):
        network.predictions(net, manifests, loop[loop["run"] == "np2-none"], links)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(network.NetworkError, match="not a calibration fit"):
        network.load_links(tmp_path / "bad.json")

    # the idle-core calibration beside it: read with it, and used after backward
    assert network.load_calibration(tmp_path / "fit.json")[1] is None
    idle_fit = {"fits": [dict(f, alpha_s=0.2e-3, beta_s_per_byte=4e-8) for f in fit["fits"]]}
    network.idle_fit_path(tmp_path / "fit.json").write_text(json.dumps(idle_fit))
    busy, idle = network.load_calibration(tmp_path / "fit.json")
    assert busy == links and idle[2]["allgather"].alpha == pytest.approx(0.2e-3)
    split = {p.run: p for p in network.predictions(net, manifests, loop, busy, idle)}
    wire = methods.exchange_seconds(units, 2, busy[2], launch_span=0.110, links_after=idle[2])
    assert split["np2-bit8"].predicted_ms == pytest.approx(1000 * wire + 4.0)
    assert split["np2-bit8"].predicted_ms < preds["np2-bit8"].predicted_ms   # idle is faster
    with pytest.raises(network.NetworkError, match="no fits at n = 2"):
        network.predictions(net, manifests, loop, busy, {4: idle[2]})


def test_step_bound_of_a_row():
    """bound = max(floor, wire): the floor is the step less its wait for the exchange, the
    wire the bytes counted at the link's rate; a row without its wait has no bound."""
    import pandas as pd
    rows = pd.DataFrame({"run": ["np2-none", "np2-bit8", "np2-stock"],
                         "step_ms": [580.0, 300.0, 500.0], "communicate_ms": [300.0, 40.0, math.nan],
                         "bytes_per_step": [4_800_000, 1_200_000, 4_800_000]})
    wired, floored, blind = rows.itertuples()
    bound = network.step_bound(wired, 1e8)
    assert (bound.floor_ms, bound.wire_ms) == (pytest.approx(280.0), pytest.approx(384.0))
    assert bound.bound_ms == pytest.approx(384.0) and bound.ratio == pytest.approx(580 / 384)
    bound = network.step_bound(floored, 1e8)
    assert bound.bound_ms == pytest.approx(260.0) and bound.wire_ms == pytest.approx(96.0)
    assert bound.ratio == pytest.approx(300 / 260)
    assert network.step_bound(floored, 1e7).bound_ms == pytest.approx(960.0)   # 10 Mbit/s
    with pytest.raises(network.NetworkError, match="np2-stock: no step / bound"):
        network.step_bound(blind, 1e8)
    with pytest.raises(network.NetworkError, match="link's rate"):
        network.step_bound(wired, math.nan)


def test_rate_text():
    assert network.rate_text(math.inf) == "any rate"
    assert network.rate_text(0.0) == "never"
    assert network.rate_text(1.5e9) == "1.50 Gbit/s"
    assert network.rate_text(3.2e8) == "320 Mbit/s"


@pytest.mark.interpreter
def test_job_plans_the_table_the_calibration_and_the_network_rows(tmp_path):
    """The whole lab, planned: 9 runs of the table over loopback, two calibrations of the link,
    the 8 parallel rows over it with --steps-per-epoch, in a folder beside the table's."""
    out = tmp_path / "matrix"
    done = subprocess.run([sys.executable, "-m", "labs.kit.job", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = [l for l in lines if l.startswith("[table ")]
    net = [l for l in lines if l.startswith("[network ")]
    assert len(table) == 9 and len(net) == 8
    assert all("--model basic" in l and "--momentum 0.9" in l and "--lr 0.02" in l
               and "--epochs 2" in l for l in table)
    assert all("labs.netem run" in l and "--rate 100mbit" in l and "--steps-per-epoch 40" in l
               and str(tmp_path / "matrix-netem-100mbit") in l for l in net)
    calibration = [l for l in lines if l.startswith("calibration (")]
    assert len(calibration) == 2                                 # busy cores, then idle ones
    assert all("labs.netem.bench --launch netem --rate 100mbit" in l for l in calibration)
    assert "(2 core(s) kept busy)" in calibration[0] and "link.csv" in calibration[0]
    assert "(0 core(s) kept busy)" in calibration[1] and "link_idle.csv" in calibration[1]
    assert not out.exists()                                      # a dry run writes nothing


def test_job_progress_line():
    progress = job.JobProgress([100, 100, 200])
    assert progress.line().startswith("[lab 0% | 0.0 min | estimating]")
    progress.advance(100, ran=False)              # found done: counts, but sets no pace
    assert "25%" in progress.line() and "estimating" in progress.line()
    progress.advance(100, ran=True)
    assert "50%" in progress.line() and "min left" in progress.line()
    progress.advance(200, ran=True)
    assert progress.line().endswith("| done]")


def test_faults_find_their_cluster_and_refuse_what_cannot_be_done(tmp_path, monkeypatch):
    """`python -m labs.netem fault`: the running cluster is found by its control folder, a
    dead owner's folder passed over; loss needs the bridge; a probability outside [0, 1] or a rank outside the cluster is refused."""
    import json
    from labs.netem import faults
    from labs.netem.links import NetemError
    monkeypatch.setattr(faults, "CONTROL_DIR", tmp_path)
    with pytest.raises(NetemError, match="no emulated cluster is running"):
        faults.find_cluster()
    def cluster(tag, bridge, pid):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "cluster.json").write_text(json.dumps(
            {"tag": tag, "n": 2, "rank_ns": [f"hvdc-{tag}-r0", f"hvdc-{tag}-r1"],
             "switch_ns": f"hvdc-{tag}-sw", "bridge": bridge, "mtu": 1500, "pid": pid}))
    # a cluster killed with SIGKILL leaves its folder behind: its owner is dead, so it is
    # not a running cluster (pid_max is at most 2**22: 999999999 cannot be alive)
    cluster("999999999-0", True, 999999999)
    with pytest.raises(NetemError, match="no emulated cluster is running; 999999999-0 left by a "
                                         "process that is gone"):
        faults.find_cluster()
    with pytest.raises(NetemError, match="no emulated cluster is running with tag 999999999-0"):
        faults.find_cluster("999999999-0")
    cluster("11-0", False, os.getpid())
    assert faults.find_cluster()[0].name == "11-0"        # the only live one: no --tag needed
    cluster("12-0", True, os.getpid())
    with pytest.raises(NetemError, match="several clusters are running.*: 11-0, 12-0$"):
        faults.find_cluster()
    assert faults.find_cluster("12-0")[1]["bridge"] is True
    with pytest.raises(NetemError, match="loss needs the userspace bridge"):
        faults.loss(0.1, tag="11-0")
    with pytest.raises(NetemError, match=r"need a probability in \[0, 1\]"):
        faults.loss(1.5, tag="12-0")
    assert "probability 0.05" in faults.loss(0.05, tag="12-0")
    assert float((tmp_path / "12-0" / "loss").read_text()) == 0.05
    with pytest.raises(NetemError, match="the cluster has ranks 0..1"):
        faults.link_state(2, False, tag="11-0")


def test_calibration_table_shows_both_fits():
    from labs.kit.report import calibration_table
    busy = {4: {"alltoall": Link(alpha=7.7e-3, beta=8 / 75e6), "allreduce": Link(2.3e-3, 8 / 79e6)}}
    idle = {4: {"alltoall": Link(alpha=6.8e-3, beta=8 / 75e6)}}
    text = calibration_table(busy, idle)
    assert "| alltoall | 4 | 7.700 | 75.0 | 6.800 | 75.0 |" in text
    assert "| allreduce | 4 | 2.300 | 79.0 | — | — |" in text          # no idle fit for it
    assert "alpha, idle (ms)" in text and "idle" not in calibration_table(busy)
