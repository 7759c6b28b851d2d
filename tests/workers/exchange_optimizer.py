"""Run under horovodrun (tests/workers/suite.py, or alone): the optimizer's side of the
compressed exchange on real ranks (exchange_checks.check_optimizer): hc.DistributedOptimizer
with none/fp16 trains to the bits of hvd.DistributedOptimizer (1 and 2 backward passes, a layer
only rank 0 uses); bit8/bit16 on both routes, with and without error feedback, train to finite
parameters identical on all ranks; exchanging from gradient hooks gives the bits of one
exchange after backward; skip_synchronize works.

A module of its own so that a job can run the exchange's routes without it: the 3-rank job
checks the routes' chunking at an odd world size, while these checks, which depend on no
world size, run at 2 and 4 ranks (tests/hvdrun.py's SUITE).
"""
import checks
import exchange_checks


def run(hvd):
    exchange_checks.N, exchange_checks.RANK = hvd.size(), hvd.rank()
    exchange_checks.check_optimizer()


if __name__ == "__main__":
    checks.main(run)
