"""Compression.auto's reading of its own convergence (hvd_compress/auto/convergence.py):
Accordion's critical-regime rule on the norms of interval gradients."""
import math

import pytest

from hvd_compress.auto.convergence import ETA, Regime, changed

pytestmark = pytest.mark.unit


def test_a_change_of_eta_or_more_is_critical_and_less_is_not():
    assert changed(10.0, 15.0) and changed(10.0, 5.0)             # +-50%: Accordion's eta
    assert not changed(10.0, 14.9) and not changed(10.0, 5.1)
    assert changed(None, 3.0) and changed(10.0, math.nan) and changed(0.0, 1.0)
    assert not changed(0.0, 0.0) and ETA == 0.5


def test_the_first_interval_is_critical_then_each_follows_its_change():
    regime = Regime(interval=10)
    assert regime.critical
    assert regime.end_interval(100.0) is True                    # nothing to compare with
    assert regime.end_interval(60.0) is False                    # -40%
    assert regime.end_interval(20.0) is True                     # -67%: critical again
    assert regime.end_interval(25.0) is False
    assert [c for _, c in regime.history] == [True, False, True, False]


@pytest.mark.parametrize("settings", [{"eta": 0}, {"eta": -1}, {"eta": math.inf},
                                      {"interval": 0}, {"interval": 2.5}, {"interval": True}])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ValueError):
        Regime(**settings)


def test_progress_is_each_candidates_share_of_the_exact_updates_progress():
    from hvd_compress.auto.convergence import Progress
    progress = Progress()
    assert progress.ratios() == {}
    progress.add(2.0, {"topk0.1": 1.5, "powersgd1": 0.4})
    progress.add(2.0, {"topk0.1": 1.5, "powersgd1": 0.8})
    assert progress.ratios() == pytest.approx({"topk0.1": 0.75, "powersgd1": 0.3})
    with pytest.raises(ValueError):
        progress.add(math.nan, {})


def test_choose_takes_the_fewest_seconds_per_unit_of_progress_behind_the_guard():
    from hvd_compress.auto.convergence import VALUE, choose
    steps = {VALUE: 1.3, "powersgd4": 0.36, "powersgd1": 0.1, "topk0.001": 0.02}
    ratios = {"powersgd4": 0.9, "powersgd1": 0.3, "topk0.001": 0.02}
    # 0.40 s a unit of float32's progress for rank 4; rank 1's 0.33 and top-k's 1.0 refused
    assert choose(steps, ratios) == "powersgd4"
    assert choose(steps, ratios, r_min=0.2) == "powersgd1"
    fast_link = {VALUE: 0.15, "powersgd4": 0.16}
    assert choose(fast_link, {"powersgd4": 0.9}) == VALUE
    # the mode in force stays unless another promises more than the margin
    assert choose({VALUE: 1.0, "a": 0.97}, {"a": 1.0}, current=VALUE) == VALUE
    assert choose({VALUE: 1.0, "a": 0.90}, {"a": 1.0}, current=VALUE) == "a"
    with pytest.raises(ValueError):
        choose({"a": 1.0}, {"a": 1.0})
