"""tests/early.py, scenarios started when the session starts: a crafted test file run by pytest
(pytester, in this process) whose scenarios run beside its one-process test, each checked
against its own kind and giving its processes that kind, its result, failure or skip raised in
the test that asks; and the one-process tests run first."""
import pytest

from test_kinds import outcomes

pytestmark = pytest.mark.unit

CONFTEST = ("from kinds import pytest_collection_modifyitems, pytest_configure, "
            "pytest_make_collect_report, pytest_runtest_call, pytest_runtest_protocol, "
            "pytest_runtest_setup, pytest_runtest_teardown, pytest_unconfigure\n"
            "from conftest_hooks import pytest_collection_finish, pytest_sessionfinish\n")
HOOKS = """
def pytest_collection_finish(session):
    import early
    early.start_collected(session)


def pytest_sessionfinish(session):
    import early
    early.kill_all()
"""


def test_scenarios_run_beside_the_tests_with_their_own_kind(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(conftest_hooks=HOOKS)
    pytester.makepyfile(test_crafted="""
        import os
        import subprocess
        import sys
        import time

        import pytest

        from early import early

        ORDER = []

        def wait_for(what):
            end = time.monotonic() + 60
            while what not in ORDER and time.monotonic() < end:
                time.sleep(0.01)

        @early("multiprocess")
        def seen_by_a_child(tmp):
            wait_for("unit")                   # started with the session, it runs beside it
            ORDER.append("scenario")
            child = "import os; print(os.environ.get('HVD_COMPRESS_TEST_KIND'))"
            return subprocess.run([sys.executable, "-c", child], capture_output=True,
                                  text=True).stdout.strip(), tmp.mktemp("mine").is_dir()

        @early("multiprocess")
        def builds_a_namespace(tmp):
            subprocess.run(["ip", "netns", "add", "hvdc-never"])

        @early("netns")
        def cannot_emulate(tmp):
            pytest.skip("no namespaces here")

        @pytest.mark.multiprocess
        def test_reads_the_scenario():
            assert seen_by_a_child.result() == ("multiprocess", True)
            assert ORDER == ["unit", "scenario", "unit done"]

        @pytest.mark.multiprocess
        def test_scenario_refused():
            builds_a_namespace.result()

        @pytest.mark.netns
        def test_scenario_skipped():
            cannot_emulate.result()

        @pytest.mark.unit
        def test_unit_meanwhile():
            ORDER.append("unit")
            wait_for("scenario")                # the scenario starts a child meanwhile
            ORDER.append("unit done")
        """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    found = outcomes(result)
    ran = [r.nodeid.split("::")[-1] for r in result.reprec.getreports("pytest_runtest_logreport")
           if r.when == "call"]
    assert ran[0] == "test_unit_meanwhile", ran                   # one-process tests first
    assert found["test_unit_meanwhile"][0] == "passed", found
    assert found["test_reads_the_scenario"][0] == "passed", found
    outcome, message = found["test_scenario_refused"]
    assert outcome == "failed" and "KindError" in message, message
    assert "builds_a_namespace (started early) is marked `multiprocess`" in message, message
    assert "mark it `@pytest.mark.netns`" in message, message
    assert result.parseoutcomes() == {"failed": 1, "passed": 2, "skipped": 1}
