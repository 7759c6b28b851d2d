"""Run under horovodrun: the worker modules named on the command line, in order, in one job.

    horovodrun -np 2 python tests/workers/suite.py exchange_checks topk_checks ...

Horovod starts once (hvd.init() here, never in a module) and each module's run(hvd) logs its
checks between BEGIN and END lines (checks.py). The first module that raises on a rank ends
that rank at once with a FAILED line and a non-zero exit: its partners may be waiting in a
collective it will never join, so nothing can go on safely; the launcher (horovodrun, mpirun)
then ends the other ranks, and the test side reports the later modules as not run.
"""
import importlib
import os
import sys
import traceback

import horovod.torch as hvd

import checks


def wait_by_sleeping():
    """Under Gloo, Horovod's own waits (hvd.allreduce, allgather, broadcast, allgather_object,
    the stock DistributedOptimizer) go through exchange.wait_for: poll, sleep, then Horovod's
    synchronize.

    Why: synchronize() spins on sched_yield until its handle is done (exchange.wait_for says
    more). Under Gloo every collective needs Horovod's background thread and Gloo's receive
    thread to be woken in each rank, hop after hop; on 2 cores the spinning main threads hold
    the cores those threads wait for (measured: the 4-rank job's exchange and course route in
    about half the time; docs/testing.md). Not under MPI: there Horovod's background thread
    polls MPI itself, needs no wake-up, and the sleeps only added latency (the 2- and 4-rank
    MPI jobs took about twice as long). The results are Horovod's own: synchronize() still
    returns them, and raises its errors.
    """
    from horovod.torch import functions, mpi_ops, optimizer
    from hvd_compress.exchange.base import wait_for
    for module in (mpi_ops, optimizer, functions):     # each bound the name when imported
        module.synchronize = wait_for


def main(modules):
    hvd.init()
    if hvd.gloo_enabled():
        wait_by_sleeping()
    checks.start(hvd.rank())
    for name in modules:
        checks.begin(name)
        try:
            importlib.import_module(name).run(hvd)
        except BaseException as err:       # SystemExit too: a module must not end the job
            checks.failed(name, err)
            traceback.print_exc()
            sys.stderr.write(f"rank {hvd.rank()}: worker module {name} failed\n")
            sys.stderr.flush()
            os._exit(1)                    # no atexit shutdown: it could wait on the others
        checks.end(name)
    checks.done()
    # Horovod shut down together (what atexit would do), then no interpreter teardown: unloading
    # torch's modules took seconds of the 4-rank jobs' end (2.4 s at load 10) and checks nothing
    hvd.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
