"""Compression.auto: the optimizer chooses each bucket's scheme and route from what the job
measures (docs/planner.md). This module is the method's settings, a value like
Compression.topk(0.01), and, as top-k and PowerSGD do, it names its communicator
(`communicator()`, communicator.AutoCommunicator: measure, plan, exchange by the plan), imported
only when the optimizer asks for it: the planner and its CLI never import this module.

    compression=hc.Compression.auto                      the defaults below
    compression=hc.Compression.auto(warmup_steps=10, margin=0.0)
    compression=hc.Compression.auto(trial_steps=5)       # time the plan against its rivals
    compression=hc.Compression.auto(candidates=("bit8", "e2m1"))   # a plugin scheme
    compression=hc.Compression.auto(plan="plan.json")    # pinned: a plan measured before
    compression=hc.Compression.auto(objective="time_to_accuracy")   # and the lossy methods
    compression=hc.Compression.auto(objective="time_to_accuracy",
                                    step_s={"value": 0.053, "topk0.1": 0.042})  # a link's steps

`objective`: "step_time" (the default) chooses among the value codecs by step time under the
per-bucket error bound; "time_to_accuracy" also weighs the methods that change convergence
(`methods`: PowerSGD ranks, top-k ratios, 1-bit, int8), by the job's own measure of their
progress per step (objective.py, docs/planner.md "Time to accuracy"). It is not the default:
on the links this project measured the value codecs reached the target first (the lossy
methods pay only where a step is mostly the link's), and the shadows cost compute.
`step_s` injects each mode's seconds per step ("value": the value plan's; a method's label),
a link measured elsewhere (a step benchmark's cells), a dict or the path of a JSON file of
one; a mode without one is measured by the job. `interval` (steps per window: the regime's
interval and the decision's), `r_min` (the accuracy guard) and `shadow_samples` (the steps of
a window the shadows run at; `interval` of them: every step) are convergence.py's.

A candidate is any registered scheme whose entry says `carries_values` (registry.Scheme; the
plugins of $HVD_COMPRESS_SCHEMES included), by any of its routes; the error guard then decides
per bucket whether a lossy one may be taken (planner.candidates_for).

A plan measured in one launch need not be the next launch's (docs/planner.md, "From launch to
launch"); `plan=` pins one: a plan report (optimizer.plan_report(), or its to_dict()), a lab
manifest or a checkpoint's compression state holding one, or the path of a JSON file of any of
these. A pinned plan is in force from the first step whose buckets it names; nothing is
measured, tried or re-planned.
"""
import json
import math

from .. import registry
from ..registry import label, parse_label
from . import convergence, planner
from .convergence import DEFAULT_METHODS, OBJECTIVES, check_method

__all__ = ["Auto", "WARMUP_STEPS", "NOT_BY_DEFAULT", "default_candidates"]

# Steps measured before the first plan: the first discarded (first touches, Horovod's first
# negotiation), the median of five, which one slow step cannot move.
WARMUP_STEPS = 6
# Off by default: the trial's rivals are lossy steps, whose verdicts on a loaded machine cost
# accuracy (docs/planner.md, "The trial").
DEFAULT_TRIAL_STEPS = 0
# Schemes that carry values but are candidates only when named: int8 sends bit8's bytes with
# more codec time and a coarser error on small values; bf16 sends bit16's bytes with a coarser
# rounding (8 significant bits against 11), so bit16 is the one of the two auto weighs.
NOT_BY_DEFAULT = ("int8", "bf16")
_DEFAULT = object()             # Auto.communicator's scale block when none is passed


def default_candidates():
    """Every route of every registered scheme that carries values (registry order: the least
    lossy first, plugins last), but those in NOT_BY_DEFAULT: planner.DEFAULT_CANDIDATES, and a
    plugin's scheme that declares `carries_values`."""
    return tuple(label(s.name, r) for s in registry.schemes().values()
                 if s.carries_values and s.name not in NOT_BY_DEFAULT for r in s.routes)


class Auto:
    """The planner's settings; call it with options for another value. Equal settings compare
    equal (the ranks' agreement check at construction compares them). `candidates` None: the
    defaults (default_candidates()), read from the registry when asked, so a plugin loaded
    after this value was made is among them."""
    name = "auto"
    error_feedback = False        # as bit8/bit16: off unless asked (docs/planner.md says why)

    def __init__(self, candidates=None, warmup_steps=WARMUP_STEPS,
                 error_bound=planner.ERROR_BOUND, margin=planner.TIE_MARGIN,
                 replan_every=planner.REPLAN_EVERY, trial_steps=DEFAULT_TRIAL_STEPS, plan=None,
                 objective="step_time", methods=None, step_s=None,
                 interval=convergence.INTERVAL, r_min=convergence.R_MIN,
                 shadow_samples=convergence.SHADOW_SAMPLES):
        texts = None if candidates is None else _checked(candidates)
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, "
                             f"got {objective!r}")
        if isinstance(interval, bool) or int(interval) != interval or interval < 2:
            raise ValueError(f"interval must be a whole number of steps >= 2, got {interval!r}")
        if not (isinstance(r_min, (int, float)) and 0 < r_min <= 1):
            raise ValueError(f"r_min must be in (0, 1], got {r_min!r}")
        convergence.sampled_positions(interval, shadow_samples)     # its ValueError names it
        if isinstance(warmup_steps, bool) or int(warmup_steps) != warmup_steps or warmup_steps < 2:
            raise ValueError(f"warmup_steps must be an integer >= 2 (the first is discarded), "
                             f"got {warmup_steps!r}")
        if not (isinstance(error_bound, (int, float)) and error_bound >= 0):
            raise ValueError(f"error_bound must be a number >= 0, got {error_bound!r}")
        if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if isinstance(replan_every, bool) or not (replan_every == math.inf or (
                int(replan_every) == replan_every and replan_every >= 1)):
            raise ValueError(f"replan_every must be an integer >= 1 (or math.inf: never), "
                             f"got {replan_every!r}")
        if isinstance(trial_steps, bool) or int(trial_steps) != trial_steps or trial_steps < 0:
            raise ValueError(f"trial_steps must be an integer >= 0 (0: no trial), "
                             f"got {trial_steps!r}")
        self._candidates = texts
        self.warmup_steps = int(warmup_steps)
        self.error_bound = float(error_bound)
        self.margin = float(margin)
        self.replan_every = replan_every if replan_every == math.inf else int(replan_every)
        self.trial_steps = int(trial_steps)
        self.plan = pinned_plan(plan)
        self.objective = objective
        self.methods = tuple(dict.fromkeys(check_method(m) for m in (
            DEFAULT_METHODS if methods is None else methods)))
        self.step_s = step_times(step_s, self.methods)
        self.interval = int(interval)
        self.r_min = float(r_min)
        self.shadow_samples = int(shadow_samples)

    @property
    def candidates(self):
        """The labels auto may choose from, float32 first."""
        return _checked(default_candidates()) if self._candidates is None else self._candidates

    def communicator(self, op=None, fusion_threshold_bytes=None, scale_block=_DEFAULT,
                     engine=None):
        """The communicator these settings exchange by (make_communicator calls it, as it does
        top-k's and PowerSGD's, with the optimizer's op, fusion threshold and scale block):
        AutoCommunicator, which composes the route communicators of its candidates. Imported
        here, when asked: it needs torch and Horovod."""
        from ..codecs import SCALE_BLOCK
        from .communicator import AutoCommunicator
        return AutoCommunicator(self, **({} if op is None else {"op": op}),
                                fusion_threshold_bytes=fusion_threshold_bytes,
                                scale_block=SCALE_BLOCK if scale_block is _DEFAULT else scale_block,
                                engine=engine)

    def __call__(self, **options):
        """Compression.auto(warmup_steps=10, ...): these settings with some changed."""
        return Auto(**{**self.options(), "candidates": self._candidates, **options})

    def options(self):
        """The settings by name, as Compression.auto(...) takes them (candidates resolved)."""
        return {"candidates": self.candidates, "warmup_steps": self.warmup_steps,
                "error_bound": self.error_bound, "margin": self.margin,
                "replan_every": self.replan_every, "trial_steps": self.trial_steps,
                "plan": self.plan, "objective": self.objective, "methods": self.methods,
                "step_s": self.step_s, "interval": self.interval, "r_min": self.r_min,
                "shadow_samples": self.shadow_samples}

    def __repr__(self):
        return "Auto(" + ", ".join(f"{k}={v!r}" for k, v in self.options().items()) + ")"

    def __eq__(self, other):
        return isinstance(other, Auto) and self.options() == other.options()

    def __hash__(self):
        return hash((Auto, tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                                 for k, v in self.options().items())))


def _checked(candidates):
    """The labels, normalised, float32 first; each a scheme that carries values."""
    texts = tuple(label(*parse_label(str(t))) for t in candidates)
    if "none:allreduce" not in texts:
        texts = ("none:allreduce",) + texts     # float32 is always a candidate (fallback)
    for text in texts:
        scheme, _ = parse_label(text)
        if not registry.scheme(scheme).carries_values:
            raise ValueError(f"Compression.auto: {text} is not a codec of values the "
                             "per-bucket exchange can carry (its registry entry does not say "
                             "carries_values)")
    return texts


def pinned_plan(spec):
    """((bucket name, float32 bytes, label), ...) in launch order, from what `plan=` names
    (the module docstring), or None for no pinned plan; ValueError where it holds no plan."""
    if spec is None:
        return None
    if hasattr(spec, "to_dict"):
        spec = spec.to_dict()
    elif isinstance(spec, (str, bytes)) or hasattr(spec, "__fspath__"):
        try:
            with open(spec) as f:
                spec = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"Compression.auto(plan={spec!r}): cannot read a plan from it: "
                             f"{err}") from None
    if isinstance(spec, dict):
        spec = spec.get("plan_report") or spec.get("communicator") or spec
        if "auto_plan" in spec:                  # a checkpoint: the communicator's state
            saved = spec["auto_plan"]
            labels = saved.get("decision", {}).get("labels") or []
            buckets = [(n, b, t) for (n, b), t in zip(saved["buckets"], labels)]
        elif spec.get("plan") and "buckets" in spec:
            buckets = [(b["name"], b["bytes"], b["label"]) for b in spec["buckets"]]
        else:
            raise ValueError("Compression.auto(plan=...): no plan in force in it (a plan report "
                             f"with a plan, a manifest or a checkpoint holding one); phase "
                             f"{spec.get('phase', '?')!r}")
    else:
        buckets = list(spec)
    try:
        plan = tuple((str(n), int(b), label(*parse_label(str(t)))) for n, b, t in buckets)
    except (TypeError, ValueError) as err:
        raise ValueError(f"Compression.auto(plan=...): not a plan of (bucket, bytes, label) "
                         f"triples: {err}") from None
    for _, _, text in plan:
        if not registry.scheme(parse_label(text)[0]).carries_values:
            raise ValueError(f"Compression.auto(plan=...): {text} is not a codec of values the "
                             "per-bucket exchange can carry")
    if not plan:
        raise ValueError("Compression.auto(plan=...): the plan names no bucket")
    return plan


def step_times(spec, methods):
    """{mode: seconds per step} from what `step_s=` names (a dict, or the path of a JSON file
    of one), None for none; every key "value" or one of `methods`, every value > 0."""
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            with open(spec) as f:
                spec = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"Compression.auto(step_s={spec!r}): cannot read step times "
                             f"from it: {err}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"Compression.auto(step_s=...): a dict of mode -> seconds, got "
                         f"{type(spec).__name__}")
    out = {}
    for key, value in spec.items():
        mode = key if key == convergence.VALUE else check_method(key)
        if mode != convergence.VALUE and mode not in methods:
            raise ValueError(f"Compression.auto(step_s=...): {key!r} is no candidate "
                             f"(methods: {', '.join(methods)}, or 'value')")
        if isinstance(value, bool) or not (isinstance(value, (int, float))
                                           and math.isfinite(value) and value > 0):
            raise ValueError(f"Compression.auto(step_s=...): {key!r} must be a number of "
                             f"seconds > 0, got {value!r}")
        out[mode] = float(value)
    return out
