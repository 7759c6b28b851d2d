"""The cost model's time to accuracy at n ranks (hvd_compress/costmodel/accuracy.py): the steps
curve through two measurements, held to what the model allows; the step at n ranks; the CLI."""
import math

import pytest

from hvd_compress.costmodel import __main__ as cli, methods
from hvd_compress.costmodel.accuracy import StepsCurve, step_seconds, time_to_accuracy
from hvd_compress.costmodel.model import Link

pytestmark = pytest.mark.unit

BASIC = methods.MODEL_SHAPES["basic"]


def test_the_curve_through_two_measurements_is_mccandlish_s_with_its_critical_batch():
    s_min, b_crit = 300.0, 500.0
    truth = lambda b: s_min * (1 + b_crit / b)                        # noqa: E731
    curve = StepsCurve.fit(128, truth(128), 256, truth(256))
    assert curve.s_min == pytest.approx(s_min) and curve.b_crit == pytest.approx(b_crit)
    assert curve.steps(64 * 64) == pytest.approx(truth(64 * 64))
    assert curve.e_min == pytest.approx(s_min * b_crit)


def test_a_larger_batch_that_bought_no_steps_keeps_them_and_better_than_perfect_is_perfect():
    flat = StepsCurve.fit(128, 800, 256, 900)
    assert (flat.s_min, flat.e_min) == (900, 0) and flat.steps(4096) == 900
    perfect = StepsCurve.fit(128, 800, 256, 350)            # fewer images at the larger batch
    assert perfect.s_min == 0 and perfect.e_min == 256 * 350
    assert perfect.steps(512) == pytest.approx(175) and math.isinf(perfect.b_crit)


@pytest.mark.parametrize("bad", [(256, 800, 128, 500), (128, 0, 256, 500),
                                 (128, math.nan, 256, 500), (0, 800, 256, 500)])
def test_the_curve_refuses_what_it_cannot_fit(bad):
    with pytest.raises(ValueError):
        StepsCurve.fit(*bad)


def test_a_step_is_its_compute_where_the_exchange_hides_behind_backward():
    fast = Link.from_bandwidth(0.0, 1e15)
    assert step_seconds("none", BASIC, 8, fast, 0.1) == pytest.approx(0.1)
    slow = Link.from_bandwidth(50e-6, 100e6 / 8)
    steps = [step_seconds("bit8", BASIC, n, slow, 0.1) for n in (2, 4, 8, 16)]
    assert steps == sorted(steps) and steps[0] > 0.1       # the allgather grows with n
    two_phase = [step_seconds("bit8", BASIC, n, slow, 0.1, route="alltoall") for n in (2, 64)]
    assert two_phase[1] < 2 * two_phase[0]                  # the two-phase route does not


def test_time_to_accuracy_is_overhead_plus_steps_times_step():
    curve = StepsCurve(s_min=200.0, e_min=76800.0)
    assert time_to_accuracy(curve, 64, 8, 0.25, overhead_s=10) == pytest.approx(
        10 + (200 + 76800 / 512) * 0.25)


def test_the_command_line_predicts_each_method_at_each_n(tmp_path, capsys):
    path = tmp_path / "scaling.csv"
    path.write_text(",".join(cli.TTA_COLUMNS) + "\n"
                    "basic,none,none,,,0.88,64,2,800,4,500,0.1,20\n"
                    "basic,powersgd1,powersgd,1,,0.88,64,2,1200,4,900,0.11,20\n"
                    "basic,topk0.01,topk,0.01,,0.88,64,2,,4,900,0.11,20\n")
    assert cli.main(["--tta", str(path), "--nodes", "8", "64", "--bandwidth", "10Gbit/s",
                     "--latency", "50us", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 2 * 2                          # top-k never reached at 2 ranks
    header = lines[0].split(",")
    none8 = dict(zip(header, lines[1].split(",")))
    assert none8["method"] == "none" and float(none8["steps"]) == pytest.approx(350)
    assert float(none8["vs_float32"]) == 1.0
    with pytest.raises(SystemExit):
        cli.main(["--tta", str(path), "--nodes", "8"])
