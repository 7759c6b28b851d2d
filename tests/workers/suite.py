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


def main(modules):
    hvd.init()
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


if __name__ == "__main__":
    main(sys.argv[1:])
