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
