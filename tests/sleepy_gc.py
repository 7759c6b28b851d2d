"""Two threads at once with every garbage collection sleeping: a thread that collects inside a
C routine (the AST constructor, say) drops the GIL there, so the other thread runs in its
middle. The races of tests/test_classroom_parse.py and test_classroom_threads_traceback.py."""
import gc
import threading
import time


def pause(phase, info):
    if phase == "start":
        time.sleep(0.0002)


def run_together(*targets):
    """Run each callable in a thread of its own, every collection sleeping, until all end."""
    threshold = gc.get_threshold()
    gc.callbacks.append(pause)
    gc.set_threshold(20)
    try:
        threads = [threading.Thread(target=t) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.callbacks.remove(pause)
        gc.set_threshold(*threshold)
