"""Scenarios that mostly wait, started when the session starts (issue 23).

Some tests spend their time waiting, not computing: elastic's survivors wait out Gloo's
timeout, a link fault waits for the watchdog. Such a test's scenario (launch the jobs, inject
the fault, collect the files) is declared with `@early(kind)`; when the session has collected
a test of its module, it runs in a thread of its own from the first test on, beside the
one-process tests (tests/kinds.py runs them first: they use one core), and the test that needs
it waits for its result and asserts on it. A failure or skip inside the scenario is raised in
every test that asks for it.

    @early("netns")
    def fault_runs(tmp):                    # tmp: the session's TempPathFactory
        ...
        return runs

    def test_it_ends(): runs = fault_runs.result()

What the scenario starts is checked against its own kind, not the kind of the test that
happens to run meanwhile (tests/launch_guard.py's per-thread state), and the processes it
starts get their environment for that kind. Every process group a scenario starts through
subprocess with start_new_session=True is killed when the session ends, so an interrupted
run leaves no job behind.
"""
import os
import signal
import threading
import traceback

import pytest

import launch_guard

SCENARIOS = []           # every @early scenario imported, in import order


class Scenario:
    """One scenario: run once a session, in a thread when started early, else when first asked."""

    def __init__(self, run, kind):
        if kind not in launch_guard.ALLOWED and kind != "netns":
            raise ValueError(f"kind must be multiprocess or netns, not {kind!r}")
        self.run, self.kind = run, kind
        self.module, self.name = run.__module__, run.__qualname__
        self._thread = self._outcome = self._factory = None
        self._lock = threading.Lock()
        self._groups = []

    def start(self, tmp_path_factory):
        """Run in a thread of its own (once)."""
        with self._lock:
            if self._thread is None:
                self._factory = tmp_path_factory
                self._thread = threading.Thread(target=self._run, name=f"early {self.name}",
                                                daemon=True)
                self._thread.start()

    def result(self):
        """The scenario's return value, once it has ended; its exception (a skip too) if it
        raised."""
        if self._thread is None:
            raise RuntimeError(f"scenario {self.name} was not started: tests/conftest.py starts "
                               "the scenarios of the collected modules")
        self._thread.join()
        kind, value = self._outcome
        if kind == "raised":
            raise value
        return value

    def _run(self):
        report = self._factory.getbasetemp() / f"early-{self.name}-kinds.txt"
        launch_guard.enter_thread(self.kind, f"{self.module}::{self.name} (started early)",
                                  report, self._groups)
        try:
            value = self.run(self._factory)
            refused = report.read_text().strip() if report.exists() else ""
            self._outcome = (("raised", launch_guard.KindError(refused)) if refused
                             else ("returned", value))
        except BaseException as err:               # a skip or failure: the tests re-raise it
            traceback.print_exc()
            self._outcome = ("raised", err)

    def kill(self):
        """The session ends with the scenario still running (interrupted): end the process
        groups it started, SIGTERM first (labs.netem removes its namespaces on it)."""
        if self._thread is None or not self._thread.is_alive():
            return                         # it ended: its own finally blocks cleaned up
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
            for pgid in self._groups:
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            self._thread.join(wait_s)


def early(kind):
    """Declare a scenario to start when the session starts (the module docstring says how)."""
    def declare(run):
        scenario = Scenario(run, kind)
        SCENARIOS.append(scenario)
        return scenario
    return declare


# ---- the hooks (tests/conftest.py imports them) ---------------------------------------------

def start_collected(session):
    """Start every scenario of a module that has a collected, selected test."""
    modules = {item.module.__name__ for item in session.items if isinstance(item, pytest.Function)}
    factory = session.config._tmp_path_factory
    for scenario in SCENARIOS:
        if scenario.module in modules:
            factory.getbasetemp()      # made here, once: two threads making it would race
            scenario.start(factory)


def kill_all():
    for scenario in SCENARIOS:
        scenario.kill()


__all__ = ["early", "start_collected", "kill_all"]
