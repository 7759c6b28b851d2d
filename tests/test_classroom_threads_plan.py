"""Step 2's inputs are planned once per process (replay.plan, cached) and the checks are then
replayed against each kit's outputs; the error bound's inputs are one step's gradients of a
network (compressor_checks.real_gradients, cached), which torch's global RNG initialises. Two
graders in one process (grade() called from two threads, as tests/test_classroom_grade.py
does) made their first plans at once: both seeded the global RNG, the second's network drew
from where the first's had left it, and the cache kept one thread's gradients beside the other
thread's plan. Every kit's Bit8Compressor.error_bound then failed, its inputs never sent.
This test makes that interleaving on purpose (each first call pauses where the other must run)
and replays a kit that answers every planned call with the reference."""
import threading

import pytest
import torch

import labs.mnist
from labs.classroom import compressor_checks, replay
from labs.classroom.student_side import unpack

pytestmark = pytest.mark.unit

WAIT_S = 1.5                    # how long a pause waits for the other thread (it never comes
                                # where the planning is one thread's at a time)


def _clear():
    for cached in (replay.plan, replay.check_names, compressor_checks.real_gradients,
                   getattr(compressor_checks, "_real_gradients", None)):
        getattr(cached, "cache_clear", lambda: None)()


def _reference_kit():
    """replay.ReplayedKit of a kit whose outputs are the reference's, for every planned call."""
    index, arrays = replay.plan()
    calls = {}
    for call in index["calls"]:
        x = unpack(call["input"], arrays, call["id"])
        if call["op"] == "call":
            calls[call["id"]] = {"out": replay.CODEC_REFERENCE[call["target"]](x)}
        else:
            reference = compressor_checks.SPECS[call["target"]][0]
            packet, ctx = reference.compress(x)
            calls[call["id"]] = {"packet": packet, "y": reference.decompress(packet, ctx)}
    names = list(replay.CODEC_REFERENCE) + list(replay.COMPRESSORS)
    return replay.ReplayedKit({"names": names, "calls": calls})


def test_two_first_plans_at_once_keep_the_plan_and_the_gradients_together(monkeypatch):
    first_seeded, second_drawn, first_packing, second_planned = (threading.Event() for _ in range(4))
    order, lock = [], threading.Lock()
    seed, net, pack = torch.manual_seed, labs.mnist.Net, replay.pack

    def first():
        with lock:
            if not order:
                order.append(threading.current_thread())
            return order[0] is threading.current_thread()

    def paused_seed(value):
        out = seed(value)
        if first():
            first_seeded.set()
            second_drawn.wait(WAIT_S)       # the second thread's network draws now
        return out

    class PausedNet(net):
        def __init__(self):
            super().__init__()
            if not first():
                second_drawn.set()
                first_packing.wait(WAIT_S)  # the first thread caches its gradients meanwhile

    def paused_pack(value, arrays, key):
        if first() and not first_packing.is_set():
            first_packing.set()
            second_planned.wait(WAIT_S)     # the second thread's plan is cached first
        return pack(value, arrays, key)

    def second():
        first_seeded.wait(WAIT_S)
        replay.plan()
        second_planned.set()

    _clear()
    monkeypatch.setattr(torch, "manual_seed", paused_seed)
    monkeypatch.setattr(labs.mnist, "Net", PausedNet)
    monkeypatch.setattr(replay, "pack", paused_pack)
    try:
        threads = [threading.Thread(target=replay.plan), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        monkeypatch.undo()
        failed = [(c.name, c.en) for c in replay.all_checks(_reference_kit()) if not c.passed]
    finally:
        _clear()                            # the next test's plan: made afresh, one thread
    assert failed == []
