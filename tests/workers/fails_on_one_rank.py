"""A worker module that fails on purpose, for tests/test_worker_jobs.py (not in the suite):
HVDC_FAIL=check makes rank 1 fail a check while rank 0 waits in an allreduce that rank 1 never
joins; HVDC_FAIL=wedge makes rank 1 hang instead, logging nothing more."""
import os
import time

import torch

import checks


def run(hvd):
    checks.check("before.passes", True)
    if hvd.rank() == 1:
        if os.environ["HVDC_FAIL"] == "check":
            checks.check("planted.failure", False, "planted detail 42")
        time.sleep(3600)
    hvd.allreduce(torch.ones(1), name="never.joined")


if __name__ == "__main__":
    checks.main(run)
