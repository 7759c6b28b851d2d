"""Run under horovodrun (tests/workers/suite.py, or alone): the collectives benchmark's timing
loop (labs/netem/bench.time_cases) on real ranks. A 0.5 ms case and a 0.4 s one, with a budget
of 1 s each, get about 2000 repetitions (capped at 30) and about 2.5 (raised to 3), timed in
interleaved rounds; every rank returns the same rows.

The budget is 10 times the one-process test's that this replaces (0.1 s, a 40 ms case): with
ranks the slowest rank's warm-up sets the count, and the small case stays capped at 30 until
its warm-up takes 33 ms (a loaded machine stretches a 0.5 ms sleep by a few ms, not 60 times),
while the large case gets 3 whatever the load (a sleep is never shorter than asked)."""
import math
import time

import torch

import checks
from labs.netem import bench


def run(hvd):
    order = []

    def case(name, seconds):
        def run_case():
            order.append(name)
            time.sleep(seconds)
        return bench.Case("primitive", name, run_case, lambda out: 0.0, row={"collective": name})
    rows = bench.time_cases(hvd, torch, [case("small", 0.0005), case("large", 0.4)], warmup=1,
                            min_reps=3, max_reps=30, budget_s=1.0, wire=lambda: math.nan)
    small, large = rows
    checks.check("time_cases.small_case_gets_max_reps", len(small) == 30, f"{len(small)} repetitions")
    checks.check("time_cases.large_case_gets_min_reps", len(large) == 3, f"{len(large)} repetitions")
    checks.check("time_cases.reps_numbered", [r["rep"] for r in small] == list(range(30))
                 and [r["rep"] for r in large] == list(range(3)))
    checks.check("time_cases.seconds_at_least_the_sleep",
                 all(r["seconds"] >= 0.0005 for r in small) and all(r["seconds"] >= 0.4 for r in large))
    timed = order[4:]                    # after one check and one warm-up of each
    checks.check("time_cases.rounds_interleaved", timed[:6] == ["small", "large"] * 3, f"{timed[:8]}")
    checks.check("time_cases.small_alone_after_large_is_done", set(timed[6:]) == {"small"})
    mine = repr(rows)                    # repr: NaN (no statistics here) equals itself
    checks.check("time_cases.same_rows_on_every_rank", hvd.allgather_object(mine) == [mine] * hvd.size())


if __name__ == "__main__":
    checks.main(run)
