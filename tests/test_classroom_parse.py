"""The grader parses Python from threads (it grades kits in parallel), and CPython counts the
AST constructor's depth per interpreter, not per thread: a parse that pauses while another
thread parses fails with "SystemError: AST constructor recursion depth mismatch", which a CI
run showed as a grader error on the copied-solution kit. normal_form.parse takes the parses one
at a time; these tests make the pause happen on purpose (a garbage collection that sleeps), show
that bare ast.parse breaks under it on this Python (3.11; a Python where it no longer does
needs the lock no more), and that the grader's parse does not."""
import ast

import pytest

from labs.classroom import normal_form
from sleepy_gc import run_together
from labs.classroom.grade import reference_imports

pytestmark = pytest.mark.unit

SOURCE = "\n".join(f"def f{i}(a, b):\n    return [a + b * {i} for _ in range(3)]"
                   for i in range(40))


def _nested(depth, parse):
    return parse(SOURCE) if depth == 0 else _nested(depth - 1, parse)


def _parse_in_two_threads(parse, rounds):
    """SystemErrors raised by `parse` called from two threads at different stack depths (the
    counter is set from the caller's depth), with every garbage collection sleeping so that
    the other thread runs in the middle of a parse."""
    errors = []

    def work(depth):
        for _ in range(rounds):
            try:
                _nested(depth, parse)
            except SystemError as err:
                errors.append(str(err))

    run_together(lambda: work(0), lambda: work(10))
    return errors


def test_bare_ast_parse_from_two_threads_raises_the_error_the_grader_saw():
    errors = []
    for _ in range(5):                      # each try raised it at least once here
        errors += _parse_in_two_threads(ast.parse, rounds=20)
        if errors:
            break
    assert any("recursion depth mismatch" in e for e in errors), errors


def test_the_graders_parse_from_two_threads_never_raises_it():
    assert _parse_in_two_threads(normal_form.parse, rounds=20) == []
    assert isinstance(normal_form.parse(SOURCE), ast.Module)


def test_reference_imports_reads_hostile_python_without_an_error(tmp_path):
    (tmp_path / "deep.py").write_text("x = 1" + " + 1" * 200_000 + "\n")   # RecursionError
    (tmp_path / "negated.py").write_text("x = " + "-" * 100_000 + "1\n")     # MemoryError
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "nul.py").write_bytes(b"import os\x00\n")
    (tmp_path / "copy.py").write_text("from hvd_compress.codecs import fp8_numpy\nimport labs.classroom\n")
    assert reference_imports(tmp_path) == ["hvd_compress.codecs", "labs.classroom"]
