"""normal_form.parse takes the grader's parses one at a time (tests/test_classroom_parse.py says
why), but Python 3.11's traceback module parses too: formatting a traceback underlines each
line's failing expression, and finds it with ast.parse. The grader formats one whenever it
fails to judge a kit (grade.guarded, for the instructor), while other threads read other kits'
Python (grade.reference_imports). These tests run the two from two threads, every garbage
collection sleeping so that one parse pauses while the other runs, as in test_classroom_parse."""
import pytest

from labs.classroom.grade import guarded, reference_imports
from sleepy_gc import run_together

pytestmark = pytest.mark.unit

SOURCE = "\n".join(f"import labs.m{i}\ndef f{i}(a, b):\n    return [a + b * {i} for _ in range(3)]"
                   for i in range(40))


def _judge():
    table = {"a": {"b": 1}}
    return [table["a"]["c"] + table["a"]["b"]]     # a KeyError in an expression: carets drawn


def _in_two_threads(kit, rounds):
    """The errors either thread raised, and the results of guarded."""
    errors, judged = [], []

    def read():
        for _ in range(rounds):
            try:
                assert len(reference_imports(kit)) == 40
            except Exception as err:
                errors.append(f"reference_imports: {type(err).__name__}: {err}")

    def judge():
        for _ in range(rounds):
            try:
                judged.append(guarded(kit, lambda: [("codecs", "compression.x")], _judge))
            except Exception as err:
                errors.append(f"guarded: {type(err).__name__}: {err}")

    run_together(read, judge)
    return errors, judged


def test_a_traceback_formatted_while_a_kit_is_read_breaks_no_parse(tmp_path, capsys):
    (tmp_path / "compression.py").write_text(SOURCE)
    errors, judged = _in_two_threads(tmp_path, rounds=30)
    assert errors == []
    assert len(judged) == 30 and all(not c.passed and "KeyError" in c.en for r in judged for c in r)
    assert "KeyError" in capsys.readouterr().err      # the instructor's traceback still printed
