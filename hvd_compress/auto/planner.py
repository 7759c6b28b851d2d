"""Which scheme and route each bucket takes: the plan with the smallest predicted step.

Pure (no torch, no Horovod; NumPy, as the cost model's fit): from a job's measurements --
when backward makes each bucket ready, each collective's fitted link, each codec's cost, each
scheme's error on each bucket's gradients -- predict the step of any plan on the exchange's
timeline, and search for the best one. The same measurements give the same plan on every
rank (docs/planner.md, "The search").

This module is the planner's one entry: the rest of the package (and its users) import these
names from here. Each job is a module of its own:

    measurements.py  what a plan is chosen from (Bucket, CodecCost, Measurements)
    candidates.py    the candidates, their tie order, the accuracy guard
    options.py       one bucket on one candidate: its codec, wire and CPU seconds
    timeline.py      a plan's step, event by event (predict), and the fold the DP runs on
    search.py        the searches: every plan, or a Pareto-front DP the timeline improves
    replan.py        when a job re-plans: the measured steps against the prediction

The fits the job's measurements go through live in the cost model (costmodel/fit.py: the links;
costmodel/affine.py: codec and CPU costs); the runtime (the auto package's calibration) reaches
them through here, never the cost model itself (tests/test_import_graph.py).
"""
from __future__ import annotations

from ..costmodel.affine import Affine, fit_affine
from ..costmodel.fit import BETA_FLOOR, fit_links
from .candidates import DEFAULT_CANDIDATES, ERROR_BOUND, candidates_for
from .measurements import Bucket, CodecCost, Measurements
from .options import wire_units
from .replan import (REPLAN_EVERY, REPLAN_FIRST, REPLAN_MARGIN, REPLAN_WINDOW, Replan,
                     should_replan)
from .search import EXHAUSTIVE_PLANS, MAX_FRONT, TIE_MARGIN, Plan, Ranked, exhaustive, search
from .timeline import Timeline, fixed_plan, predict

__all__ = ["Affine", "CodecCost", "Bucket", "Measurements", "Timeline", "Plan",
           "DEFAULT_CANDIDATES", "ERROR_BOUND", "TIE_MARGIN", "REPLAN_MARGIN",
           "REPLAN_EVERY", "REPLAN_WINDOW", "REPLAN_FIRST", "MAX_FRONT", "EXHAUSTIVE_PLANS",
           "candidates_for", "wire_units", "predict", "fixed_plan", "search", "exhaustive",
           "should_replan", "Replan", "Ranked", "fit_affine", "fit_links", "BETA_FLOOR"]
