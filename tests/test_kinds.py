"""tests/kinds.py, the check of every test's kind marker: a crafted test file run by pytest
(pytester, in this process): the collection is refused when a test has no kind or two, and a
test that launches what its kind rules out, itself or through a Python process it starts, fails
naming the marker it needs; then the reading of commands on its own."""
import re
import sys

import horovod.torch  # noqa: F401
import pytest

import launch_guard

# Imported here, before any pytester run: pytester restores sys.modules after each in-process
# run, so a module first imported inside one (horovod.torch, and torch with it, by the crafted
# hvd.init() test) would be dropped and imported again by a later test, and torch's C extension
# cannot be loaded twice (a segfault in tests/test_import_graph.py when it ran after this file).

pytestmark = pytest.mark.unit

CONFTEST = ("from kinds import pytest_collection_modifyitems, pytest_configure, "
            "pytest_make_collect_report, "
            "pytest_runtest_call, pytest_runtest_protocol, pytest_runtest_setup, "
            "pytest_runtest_teardown, pytest_unconfigure\n")


def run_pytest(pytester, source, *args):
    """pytest on one crafted test file with tests/kinds.py's hooks (in this process)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_crafted=source)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def outcomes(result):
    """{test name: ("failed", its report's text) or ("passed", "")} of a pytester run."""
    found = {}
    for report in result.reprec.getreports("pytest_runtest_logreport"):
        name = report.nodeid.split("::")[-1]
        if report.failed:
            found[name] = ("failed", str(report.longrepr))
        elif report.when == "call" and name not in found:
            found[name] = (report.outcome, "")
    return found


def test_a_test_without_one_kind_stops_the_collection(pytester):
    result = run_pytest(pytester, """
        import pytest

        def test_without_a_kind():
            pass

        @pytest.mark.unit
        @pytest.mark.multiprocess
        def test_with_two_kinds():
            pass

        @pytest.mark.unit
        def test_with_one_kind():
            pass
        """, "-m", "unit")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED, out + result.stderr.str()
    assert "ERROR collecting test_crafted.py" in out and "1 error" in out
    assert "exactly one kind marker" in out
    assert "test_crafted.py::test_without_a_kind: no kind marker" in out
    assert "test_crafted.py::test_with_two_kinds: kind markers multiprocess, unit" in out
    assert "test_crafted.py::test_with_one_kind:" not in out
    assert not result.reprec.getreports("pytest_runtest_logreport")      # nothing ran


def test_a_launch_its_kind_rules_out_fails_the_test(pytester):
    result = run_pytest(pytester, """
        import subprocess
        import sys

        import pytest

        @pytest.fixture(scope="module")
        def ranks():
            subprocess.run(["horovodrun", "-np", "2", "true"])

        @pytest.mark.unit
        def test_unit_starts_horovodrun():
            subprocess.run(["/venv/bin/horovodrun", "-np", "2", "python", "x.py"])

        @pytest.mark.unit
        def test_unit_starts_mpirun_through_a_shell():
            subprocess.run("cd /tmp && mpirun -np 2 true", shell=True)

        @pytest.mark.unit
        def test_unit_builds_a_namespace():
            subprocess.run(["ip", "netns", "add", "hvdc-never"])

        @pytest.mark.unit
        def test_unit_runs_a_netem_cluster():
            subprocess.run([sys.executable, "-m", "labs.netem", "run", "-n", "2", "--", "true"])

        @pytest.mark.unit
        def test_unit_initialises_horovod():
            import horovod.torch as hvd
            hvd.init()

        @pytest.mark.unit
        def test_unit_fixture_starts_ranks(ranks):
            pass

        @pytest.mark.multiprocess
        def test_multiprocess_builds_a_namespace():
            subprocess.Popen(["ip", "netns", "add", "hvdc-never"])

        @pytest.mark.interpreter
        def test_interpreter_runs_a_tool_that_starts_ranks():
            tool = "import subprocess; subprocess.run(['mpirun', '-np', '2', 'true'])"
            assert subprocess.run([sys.executable, "-c", tool]).returncode != 0

        @pytest.mark.interpreter
        def test_interpreter_runs_horovod_in_a_child():
            serial = "from horovod.common.basics import HorovodBasics as H; H.init(None)"
            assert subprocess.run([sys.executable, "-c", serial]).returncode != 0

        @pytest.mark.unit
        def test_unit_builds_a_virtualenv():
            subprocess.run([sys.executable, "-m", "venv", "/tmp/hvdc-never"])

        @pytest.mark.interpreter
        def test_interpreter_compiles_through_a_tool():
            tool = "import subprocess; subprocess.run(['ninja', '-C', '/tmp/hvdc-never'])"
            assert subprocess.run([sys.executable, "-c", tool]).returncode != 0

        @pytest.mark.build
        def test_build_starts_horovodrun():
            subprocess.run(["horovodrun", "-np", "2", "true"])

        @pytest.mark.build
        def test_build_builds_a_virtualenv(tmp_path):
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "v"],
                           check=True)

        @pytest.mark.unit
        def test_unit_runs_a_plain_process():
            assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                                  text=True).stdout == "42\\n"

        @pytest.mark.unit
        def test_unit_runs_python_hidden_in_a_shell_line():
            subprocess.run(["sh", "-c", "p=" + sys.executable + "; $p -c pass"], check=True)

        @pytest.mark.unit
        def test_unit_runs_a_program_that_is_not_python():
            assert subprocess.run(["sh", "-c", "echo 42"], capture_output=True,
                                  text=True).stdout == "42\\n"

        @pytest.mark.interpreter
        def test_interpreter_runs_a_plain_process():
            assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                                  text=True).stdout == "42\\n"

        @pytest.mark.netns
        def test_netns_lists_namespaces():
            assert subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0
        """)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    found = outcomes(result)
    needs = {"test_unit_starts_horovodrun": "multiprocess",
             "test_unit_starts_mpirun_through_a_shell": "multiprocess",
             "test_unit_builds_a_namespace": "netns",
             "test_unit_runs_a_netem_cluster": "netns",
             "test_unit_initialises_horovod": "multiprocess",
             "test_unit_fixture_starts_ranks": "multiprocess",
             "test_multiprocess_builds_a_namespace": "netns",
             "test_interpreter_runs_a_tool_that_starts_ranks": "multiprocess",
             "test_interpreter_runs_horovod_in_a_child": "multiprocess",
             "test_unit_builds_a_virtualenv": "build",
             "test_interpreter_compiles_through_a_tool": "build",
             "test_build_starts_horovodrun": "multiprocess",
             "test_unit_runs_a_plain_process": "interpreter",
             "test_unit_runs_python_hidden_in_a_shell_line": "interpreter"}
    for name, kind in needs.items():
        outcome, message = found[name]
        assert outcome == "failed", (name, outcome)
        assert "KindError" in message and f"mark it `@pytest.mark.{kind}`" in message, message
        assert f"test_crafted.py::{name} is marked" in message, message
    assert "calls hvd.init() in the pytest process" in found["test_unit_initialises_horovod"][1]
    assert "'horovodrun -np 2 true'" in found["test_unit_fixture_starts_ranks"][1]
    assert found["test_interpreter_runs_a_plain_process"][0] == "passed"
    assert found["test_unit_runs_a_program_that_is_not_python"][0] == "passed"
    assert found["test_build_builds_a_virtualenv"][0] == "passed"
    assert "(in child process" in found["test_interpreter_compiles_through_a_tool"][1]
    in_a_child = re.compile(r"but \(in child process \d+\)")
    assert not in_a_child.search(found["test_unit_runs_a_plain_process"][1])    # refused at once
    assert in_a_child.search(found["test_unit_runs_python_hidden_in_a_shell_line"][1])
    assert found["test_netns_lists_namespaces"][0] == "passed"
    for name in ("test_interpreter_runs_a_tool_that_starts_ranks",
                 "test_interpreter_runs_horovod_in_a_child"):
        assert "(in child process" in found[name][1], found[name][1]
    assert "'mpirun -np 2 true'" in found["test_interpreter_runs_a_tool_that_starts_ranks"][1]
    assert "calls hvd.init()" in found["test_interpreter_runs_horovod_in_a_child"][1]
    assert result.parseoutcomes() == {"failed": 13, "errors": 1, "passed": 4}


@pytest.mark.parametrize("argv,kind", [
    (["/x/.venv/bin/horovodrun", "-np", "2", "--gloo", "python", "a.py"], "multiprocess"),
    (["mpirun", "--allow-run-as-root", "-np", "4", "python", "a.py"], "multiprocess"),
    (["env", "A=1", "mpiexec", "-n", "2", "true"], "multiprocess"),
    ([sys.executable, "-m", "horovod.runner.launch", "-np", "2", "true"], "multiprocess"),
    ([sys.executable, "-m", "labs.kit.horovodrun", "-np", "2", "--gloo", "true"], "multiprocess"),
    ("bash -c 'sleep 1; horovodrun -np 2 true'", "multiprocess"),
    (["ip", "netns", "add", "hvdc-1"], "netns"),
    (["ip", "-n", "hvdc-1", "link", "set", "lo", "up"], "netns"),
    (["tc", "-n", "hvdc-1", "qdisc", "show"], "netns"),
    ([sys.executable, "-m", "labs.netem", "run", "-n", "2", "--", "true"], "netns"),
    ([sys.executable, "/repo/labs/netem/cli.py", "bench", "-n", "2"], "netns"),
    ([sys.executable, "-m", "labs.netem", "check"], "netns"),
    ([sys.executable, "-m", "labs.netem", "commands", "-n", "2"], "netns"),  # probes: a namespace
    ([sys.executable, "/repo/labs/netem/cli.py", "--help"], "interpreter"),
    ([sys.executable, "-m", "hvd_compress.costmodel", "--methods", "basic"], "interpreter"),
    ([sys.executable, "labs/mnist.py", "--epochs", "0"], "interpreter"),
    (["python3.11", "-c", "pass"], "interpreter"),
    ("bash -c 'cd /tmp && python3 -c pass'", "interpreter"),
    (["bwrap", "--ro-bind", "/usr", "/usr", "--", "setpriv", "--reuid=9", "--",
      "/v/bin/python", "/grader/run.py"], "interpreter"),
    (["bwrap", "--ro-bind", "/usr", "/usr", "--", "true"], None),
    (["ip", "-o", "link"], None),
    (["mpirun", "--version"], None),                     # the run records say which MPI
    ([sys.executable, "-m", "pip", "install", "-q", "x.whl"], "build"),
    (["/v/bin/pip", "wheel", "--no-deps", "."], "build"),
    ([sys.executable, "-m", "venv", "/tmp/v"], "build"),
    (["ninja", "-C", "/cache/kernel"], "build"),
    (["env", "CCACHE_DISABLE=1", "c++", "-O3", "blocks.cpp"], "build"),
    (["bash", "setup.sh", "--no-horovod"], "build"),
    ("bash -c 'cd kit && bash ./setup.sh'", "build"),
    ([sys.executable, "-m", "hvd_compress.codecs.native"], "build"),
    (["ninja", "--version"], None),                      # torch asks before it builds
    ([sys.executable, "-m", "pip", "--version"], None),
    ("echo horovodrun", None),
    ([], None),
])
def test_launch_kind_reads_the_command(argv, kind):
    assert launch_guard.launch_kind(argv) == kind


def test_a_script_is_read_by_its_first_line(tmp_path):
    (tmp_path / "tool").write_text("#!/usr/bin/env python3\nprint(1)\n")
    (tmp_path / "shell").write_text("#!/bin/sh\necho python\n")
    assert launch_guard.launch_kind([str(tmp_path / "tool"), "--help-me"]) == "interpreter"
    assert launch_guard.launch_kind([str(tmp_path / "shell")]) is None
    assert launch_guard.launch_kind([str(tmp_path / "absent")]) is None


def test_a_tests_own_kind_overrides_its_modules_and_decides_what_m_selects(pytester):
    result = run_pytest(pytester, """
        import pytest

        pytestmark = pytest.mark.unit

        def test_of_the_module():
            pass

        @pytest.mark.interpreter
        def test_of_its_own():
            pass
        """, "-m", "unit")
    assert set(outcomes(result)) == {"test_of_the_module"}, result.stdout.str()
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "interpreter")
    assert set(outcomes(result)) == {"test_of_its_own"}, result.stdout.str()
