"""The report never contradicts a number beside it: the committed run's loopback rows, where
bit8's step was 1.28x float32's because the host slowed between the two runs (forward+backward,
the same work, +23%), beside the cost model's 'no break-even rate'."""
import math
from types import SimpleNamespace

import pytest

from labs.kit import report

pytestmark = pytest.mark.unit

MBIT100 = 100e6


def row(step_ms, forward_backward_ms, **extra):
    return SimpleNamespace(step_ms=step_ms, forward_backward_ms=forward_backward_ms, **extra)


def test_rows_from_one_machine_state_get_no_note():
    assert report.state_note(row(293.7, 259.3), row(258.9, 235.1)) == ""      # +10%


def test_rows_from_different_machine_states_say_so_with_the_rest_of_the_step():
    note = report.state_note(row(330.4, 289.3), row(258.9, 235.1))         # the committed np2
    assert "different machine state" in note and "+23%" in note
    assert "x1.73" in note                 # (330.4 - 289.3) / (258.9 - 235.1): the exchange part


def test_any_rate_is_never_said_beside_a_loopback_row_where_it_did_not_pay():
    note = report.state_note(row(330.4, 289.3), row(258.9, 235.1))
    text = report.pays_sentence(2, "bit8", 0.52, 1.28, note, math.inf, MBIT100)
    assert "pays at any rate" not in text
    assert "x1.28 over loopback (not faster there)" in text
    assert "does not pay at every rate on this host" in text and "different machine states" in text


def test_any_rate_stands_where_every_measurement_agrees():
    text = report.pays_sentence(2, "bit16", 0.73, 0.95, "", math.inf, MBIT100)
    assert "no break-even rate" in text and "does not pay" not in text and "against" not in text


def test_a_break_even_the_link_measurement_contradicts_is_said_to():
    # the model says it pays below 80 Mbit/s; at 100 Mbit/s it measured 0.9: faster anyway
    text = report.pays_sentence(4, "fp16", 0.9, 1.1, "", 80e6, MBIT100)
    assert "break-even at 80 Mbit/s" in text and "it pays, against the model" in text
    agree = report.pays_sentence(4, "fp16", 0.71, 1.15, "", 949e6, MBIT100)
    assert "against the model" not in agree and "(pays there)" in agree


def test_the_findings_put_the_note_beside_the_ratio():
    import pandas as pd
    frame = pd.DataFrame([
        dict(run="np2-none", ranks=2, train_time_s=243.0, final_test_accuracy=0.8933, step_ms=258.9,
             forward_backward_ms=235.1, compress_ms=0.1, decompress_ms=0.1, bytes_per_step=4799528),
        dict(run="np2-bit8", ranks=2, train_time_s=300.0, final_test_accuracy=0.8973, step_ms=330.4,
             forward_backward_ms=289.3, compress_ms=4.3, decompress_ms=2.5, bytes_per_step=1218636)])
    text = report.findings(frame, cpus=2)
    line = next(l for l in text.splitlines() if "bit8 vs float32" in l)
    assert "(x1.28) [measured in a different machine state" in line
