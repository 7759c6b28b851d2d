"""Run as one rank of a torch.distributed job (tests/ddprun.py starts n of them): the worker
modules named on the command line, in order, each run(dist) logging its checks (checks.py).

The first module that raises ends this rank at once (its partners may be waiting in a
collective it will never join); the launcher then ends the others.
"""
import importlib
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import checks


def main(modules):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    checks.start(dist.get_rank())
    for name in modules:
        checks.begin(name)
        try:
            importlib.import_module(name).run(dist)
        except BaseException as err:
            checks.failed(name, err)
            traceback.print_exc()
            sys.stderr.write(f"rank {dist.get_rank()}: worker module {name} failed\n")
            sys.stderr.flush()
            os._exit(1)
        checks.end(name)
    checks.done()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
