"""The step watchdog ends a stuck process with a clear error, and leaves a live one alone."""
import os
import subprocess
import sys
import threading
import time

import pytest

from labs.kit.watchdog import EXIT_CODE, FLOOR_S, PERIOD_S, StepWatchdog, suspects

pytestmark = pytest.mark.unit


def test_beats_keep_it_quiet_and_silence_trips_it():
    fired = threading.Event()
    with StepWatchdog(0.4, on_timeout=lambda idle: fired.set()) as dog:
        for _ in range(8):                      # 0.8 s of steady progress
            time.sleep(0.1)
            dog.beat()
        assert not fired.is_set()
        assert fired.wait(3.0), "no beat for > 0.4 s must trip the watchdog"


@pytest.mark.interpreter
def test_stuck_process_exits_with_clear_error():
    code = ("import time; from labs.kit.watchdog import StepWatchdog\n"
            "with StepWatchdog(0.5, rank=3):\n    time.sleep(30)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CODE
    assert "rank 3: no training step finished" in proc.stderr and "--resume" in proc.stderr
    assert time.monotonic() - start < 20


def test_invalid_timeout_is_refused():
    with pytest.raises(ValueError):
        StepWatchdog(0)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_adaptive_limit_follows_the_slowest_of_each_kind():
    clock = FakeClock()
    dog = StepWatchdog(None, clock=clock, floor_s=20, factor=10, startup_s=300)
    assert dog.limit() == 300                     # nothing seen yet: start-up
    clock.now = 50.0
    dog.beat()                                    # the first step is start-up, not a sample
    assert dog.limit() == 300
    for t in (50.1, 50.2, 53.2, 53.3):            # steps of 0.1 s and one of 3 s
        clock.now = t
        dog.beat()
    assert dog.limit() == pytest.approx(30)       # 10 x 3 s
    dog.begin("evaluation")
    assert dog.limit() == 300                     # the first evaluation: start-up limit
    clock.now = 60.0
    dog.end("evaluation")                         # took 6.7 s
    assert dog.kind == "step" and dog.limit() == pytest.approx(30)
    with dog.phase("evaluation"):
        assert dog.limit() == pytest.approx(67)
    fast = StepWatchdog(None, clock=clock, floor_s=20)
    for t in (61, 61.01, 61.02):
        clock.now = t
        fast.beat()
    assert fast.limit() == 20                     # the floor
    assert StepWatchdog(7.5, clock=clock).limit() == 7.5   # --step-timeout fixes it


def test_the_default_limit_ends_a_stall_within_60_s_and_before_gloo_gives_up():
    """Issue 15: with the lab's defaults a wedged rank ends a run of fast steps within 60 s of
    the stall, and the watchdog (naming the rank) speaks before Gloo's receive timeout (the
    lab's HOROVOD_GLOO_TIMEOUT_SECONDS). tests/test_lab_failures.py runs the same adaptive limit
    end to end, with a lower floor (--step-timeout-floor)."""
    from labs.kit.ranks import HOROVOD_DEFAULTS
    clock = FakeClock()
    dog = StepWatchdog(None, clock=clock)
    for t in (10.0, 10.05, 10.1, 10.2):           # start-up, then steps of 0.05-0.1 s
        clock.now = t
        dog.beat()
    assert dog.limit() == FLOOR_S
    # the thread checks every PERIOD_S: the stall is seen at most a period after the floor
    assert FLOOR_S + PERIOD_S < 60
    assert FLOOR_S + PERIOD_S < float(HOROVOD_DEFAULTS["HOROVOD_GLOO_TIMEOUT_SECONDS"])


def test_suspects_name_the_silent_rank_or_the_one_behind(tmp_path):
    import json
    now = 1000.0
    for r, (age, steps) in enumerate([(0.5, 40), (30.0, 39), (0.7, 40)]):
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"rank": r, "steps": steps, "time": now - age}))
    text = suspects(tmp_path, 3, exclude=0, now=now)
    assert text.startswith("Stalled: rank 1 (silent 30 s, 39 steps done)") and "rank 2" not in text
    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1, "steps": 39, "time": now - 1}))
    assert "deadlock" in suspects(tmp_path, 3, now=now) and "rank 1 (39 steps)" in suspects(tmp_path, 3, now=now)
    assert suspects(tmp_path, 3, now=now, deadlock=False) == ""     # only what was observed
    assert suspects(tmp_path, 4, now=now).startswith("Stalled: rank 3")      # never wrote one
    for r in range(3):
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"rank": r, "steps": 40, "time": now}))
    assert suspects(tmp_path, 3, now=now) == ""


@pytest.mark.interpreter
def test_suspects_name_a_rank_whose_process_exited_before_its_heartbeat_ages(tmp_path):
    """A SIGKILLed rank's last heartbeat is fresh for up to STALE_S, and Gloo reports the dead
    peer at once: the heartbeat's pid on this host says it is dead, not a deadlock."""
    import json
    import socket
    now = 1000.0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                   # reaped: its pid names no process
    host = socket.gethostname()
    beats = [(40, os.getpid(), host), (39, dead.pid, host), (40, dead.pid, "elsewhere")]
    for r, (steps, pid, on) in enumerate(beats):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "steps": steps, "time": now - 0.5, "pid": pid, "host": on}))
    text = suspects(tmp_path, 3, exclude=0, now=now)
    assert text.startswith(f"Dead: rank 1 (process {dead.pid}, 39 steps done)"), text
    assert "rank 2" not in text and "deadlock" not in text     # another host: cannot tell
    # a link's fault comes first: a rank whose own watchdog ended it on that fault exited too
    for r, (steps, pid, on) in enumerate(beats):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(
            {"rank": r, "steps": steps, "time": now - 0.5, "pid": pid, "host": on,
             "link": {"iface": "eth0", "rx_bytes": 1, "window_s": 10.0, "state": "up",
                      "rx_bps": 0.0}}))
    assert suspects(tmp_path, 3, exclude=0, now=now).startswith("No traffic: every link is up")
    # the heartbeat the thread writes carries them
    dog = StepWatchdog(timeout_s=60, rank=0, size=1, heartbeat_dir=tmp_path / "hb")
    (tmp_path / "hb").mkdir()
    dog.heartbeat()
    beat = json.loads((tmp_path / "hb" / "rank0.json").read_text())
    assert (beat["pid"], beat["host"]) == (os.getpid(), host)


def test_suspects_name_a_link_down_a_network_that_delivers_nothing_or_a_crawl(tmp_path):
    """On an emulated network the heartbeats carry each rank's link: every process running,
    the sentence names the link that is down, or a network that delivers nothing, or a crawl;
    a stopped process still comes first, healthy links say nothing."""
    import json
    now = 1000.0

    def write(links, ages=(0.5, 0.5), steps=(40, 40)):
        for r, link in enumerate(links):
            beat = {"rank": r, "steps": steps[r], "time": now - ages[r]}
            if link is not None:
                beat["link"] = dict({"iface": "eth0", "rx_bytes": 1, "window_s": 10.0}, **link)
            (tmp_path / f"rank{r}.json").write_text(json.dumps(beat))

    write([{"state": "up", "rx_bps": 0.0}, {"state": "down", "rx_bps": 0.0}])
    assert suspects(tmp_path, 2, exclude=0, now=now).startswith(
        "Link down: rank 1's network interface eth0 is down")
    write([{"state": "up", "rx_bps": 10.0}, {"state": "up", "rx_bps": 0.0}])
    assert suspects(tmp_path, 2, now=now).startswith("No traffic: every link is up")
    write([{"state": "up", "rx_bps": 2500.0}, {"state": "up", "rx_bps": 1e7}])
    text = suspects(tmp_path, 2, now=now)
    assert text.startswith("The network crawls") and "rank 0 received 20 kbit/s" in text
    assert "rank 1" not in text
    write([{"state": "up", "rx_bps": 2500.0}, {"state": "up", "rx_bps": 1e7}], steps=(40, 39))
    assert suspects(tmp_path, 2, now=now).startswith("The network crawls")   # not "deadlock"
    write([{"state": "up", "rx_bps": 0.0}, {"state": "up", "rx_bps": 0.0}], steps=(40, 39))
    assert suspects(tmp_path, 2, now=now).startswith("No traffic")
    write([{"state": "up", "rx_bps": 1e7}, {"state": "up", "rx_bps": 1e7}], steps=(40, 39))
    assert "deadlock" in suspects(tmp_path, 2, now=now)          # healthy links: the steps speak
    write([{"state": "up", "rx_bps": 1e7}, {"state": "up", "rx_bps": 1e7}])
    assert suspects(tmp_path, 2, now=now) == ""
    write([{"state": "up", "rx_bps": 0.0}, {"state": "up", "rx_bps": 0.0}], ages=(0.5, 30))
    assert suspects(tmp_path, 2, exclude=0, now=now).startswith("Stalled: rank 1")
    write([{"state": "up", "rx_bps": 0.0}, {"state": "up"}])      # no full window yet
    assert suspects(tmp_path, 2, now=now) == ""
    write([None, None])                                           # loopback: nothing to say
    assert suspects(tmp_path, 2, now=now) == ""


def test_the_watchdog_measures_what_its_link_received(tmp_path):
    """The heartbeat's rx_bps is the received bytes over the window (a fake probe and clock)."""
    import json
    received = {"bytes": 0}

    def probe():
        return {"iface": "eth0", "state": "up", "rx_bytes": received["bytes"]}
    t = [100.0]
    dog = StepWatchdog(None, rank=0, size=1, heartbeat_dir=tmp_path, link_probe=probe,
                       clock=lambda: t[0])
    dog.heartbeat()
    assert "rx_bps" not in json.loads((tmp_path / "rank0.json").read_text())["link"]
    t[0], received["bytes"] = 106.0, 60_000
    dog.heartbeat()
    link = json.loads((tmp_path / "rank0.json").read_text())["link"]
    assert link["rx_bps"] == pytest.approx(10_000) and link["window_s"] == pytest.approx(6)


def test_a_step_the_crawl_met_halfway_does_not_lift_the_limit(tmp_path):
    """A step during which the link received under 1 Mbit/s measured the fault, not a step:
    learnt from, the 11 s one that a crawl met halfway would have lifted the limit to 110 s,
    past the crawl's 37 s steps (test_link_faults once saw it). A slow step on a link that
    delivers is learnt from as before."""
    clock, received = FakeClock(), {"bytes": 0}

    def probe():
        return {"iface": "eth0", "state": "up", "rx_bytes": received["bytes"]}
    dog = StepWatchdog(None, heartbeat_dir=tmp_path, link_probe=probe, clock=clock,
                       floor_s=20, factor=10)

    def step(seconds, bytes_per_s):
        """One step of `seconds`, the watchdog's thread sampling the link every second."""
        end = clock.now + seconds
        while clock.now < end:
            clock.now = min(end, clock.now + 1.0)
            received["bytes"] += int(bytes_per_s * 1.0)
            dog.heartbeat()
        dog.beat()
    for _ in range(3):
        step(0.5, 10e6)                           # start-up, then healthy steps
    assert dog.limit() == 20
    step(3.0, 10e6)                               # slow, but the link delivers: learnt
    assert dog.limit() == pytest.approx(30)
    step(11.0, 2_500)                             # 20 kbit/s: not a sample of a step
    assert dog.limit() == pytest.approx(30)


@pytest.mark.interpreter
def test_heartbeats_are_written_and_a_stall_names_the_silent_rank(tmp_path):
    code = ("import json, time; from labs.kit.watchdog import StepWatchdog\n"
            f"open('{tmp_path}/rank1.json', 'w').write(json.dumps(dict(rank=1, steps=3, time=time.time() - 60)))\n"
            f"with StepWatchdog(0.5, rank=0, size=2, heartbeat_dir='{tmp_path}', period_s=0.1):\n"
            "    time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CODE
    assert "Stalled: rank 1 (silent 6" in proc.stderr, proc.stderr
    assert (tmp_path / "rank0.json").is_file()


def test_disabled_watchdog_never_fires():
    fired = threading.Event()
    with StepWatchdog(0.1, enabled=False, on_timeout=lambda idle: fired.set()):
        time.sleep(0.3)                         # three times its limit
    assert not fired.is_set()


def test_under_gloo_a_learnt_limit_stays_below_gloos_timeout():
    """A run of slow steps on a crowded machine (7 s: a learnt limit of 70 s) under horovodrun's
    Gloo controller: the limit stops GLOO_MARGIN_S short of Gloo's receive timeout, so the
    watchdog names the stopped rank before Gloo ends the job without naming it. Start-up's limit
    too (a wait that long fails in Gloo anyway); a fixed --step-timeout is left alone; no
    ceiling under MPI."""
    from labs.kit.ranks import HOROVOD_DEFAULTS
    from labs.kit.watchdog import GLOO_MARGIN_S, gloo_ceiling
    gloo = {"HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_GLOO_TIMEOUT_SECONDS": HOROVOD_DEFAULTS["HOROVOD_GLOO_TIMEOUT_SECONDS"]}
    ceiling = gloo_ceiling(gloo)
    assert ceiling == float(gloo["HOROVOD_GLOO_TIMEOUT_SECONDS"]) - GLOO_MARGIN_S
    assert gloo_ceiling({"HOROVOD_CONTROLLER": "mpi"}) is None and gloo_ceiling({}) is None
    clock = FakeClock()
    capped = StepWatchdog(None, clock=clock, ceiling_s=ceiling)
    free = StepWatchdog(None, clock=clock)
    assert free.limit() > ceiling and capped.limit() == pytest.approx(ceiling)  # start-up too
    for t in (10.0, 17.0, 24.0):                               # start-up, then 7 s steps
        clock.now = t
        capped.beat()
        free.beat()
    assert free.limit() == pytest.approx(70)
    assert capped.limit() == pytest.approx(ceiling)
    assert capped.limit() + PERIOD_S < float(gloo["HOROVOD_GLOO_TIMEOUT_SECONDS"])
    assert StepWatchdog(90, clock=clock, ceiling_s=ceiling).limit() == 90   # fixed: as asked


@pytest.mark.interpreter
def test_a_stopped_peer_ends_the_wait_at_the_floor_even_at_the_first_evaluation(tmp_path):
    """A peer stopped (SIGSTOP) with its heartbeat stale is certain: the watchdog fires at its
    floor, not at the first evaluation's start-up limit (300 s: under MPI the job waited that
    long, under Gloo until Gloo gave up). A peer that is merely slow to write (heartbeat stale,
    process running) or on another host is left to the limit."""
    import json
    import signal
    import socket
    from labs.kit.watchdog import STALE_S, stopped
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        beat = {"rank": 1, "steps": 63, "time": time.time() - 2 * STALE_S, "pid": peer.pid,
                "host": socket.gethostname()}
        (tmp_path / "rank1.json").write_text(json.dumps(beat))
        assert stopped(tmp_path, 2, exclude=0) == []               # running: not certain
        os.kill(peer.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while stopped(tmp_path, 2, exclude=0) != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped(tmp_path, 2, exclude=0) == [1]
        (tmp_path / "rank1.json").write_text(json.dumps(dict(beat, host="elsewhere")))
        assert stopped(tmp_path, 2, exclude=0) == []               # another host: cannot tell
        (tmp_path / "rank1.json").write_text(json.dumps(dict(beat, time=time.time())))
        assert stopped(tmp_path, 2, exclude=0) == []               # fresh heartbeat
        (tmp_path / "rank1.json").write_text(json.dumps(beat))

        fired = threading.Event()
        clock = FakeClock()
        dog = StepWatchdog(None, rank=0, size=2, heartbeat_dir=tmp_path, floor_s=1.0,
                           period_s=0.05, clock=clock, on_timeout=lambda idle: fired.set())
        dog.slowest["startup"] = 0.0                 # past start-up; first evaluation now
        dog.begin("evaluation")
        assert dog.limit() == pytest.approx(dog.startup_s)
        with dog:
            clock.now += 0.5                         # within the floor: no verdict yet
            time.sleep(0.3)
            assert not fired.is_set()
            clock.now += 1.0
            assert fired.wait(3.0), "a stopped peer must end the wait at the floor"
    finally:
        peer.kill()
        peer.wait()
