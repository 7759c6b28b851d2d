"""Compression.auto(objective="time_to_accuracy"): beside the per-bucket value plan, the
methods that change convergence (PowerSGD ranks, top-k ratios, 1-bit, int8), chosen and
re-chosen as training goes by the fewest seconds per unit of float32's progress
(docs/planner.md, "Time to accuracy").

The communicator (communicator.AutoCommunicator) exchanges by a *mode*: "value" (its value plan,
measured, tried and re-planned as under the step-time objective) or one method on every
bucket. This object holds the mode and what decides it:

    each step     the averaged gradient's running sum (convergence.Regime). No collective.
    sampled steps at the window's steps convergence.sampled_positions names (`shadow_samples`
                  of them, the same on every rank; none during a probe), this rank's gradient
                  (before the exchange) and the received average (after) feed the candidates'
                  shadows (shadow.Shadows), and at the step after, the inner products of their
                  updates with that step's reference gradient (convergence.Progress): the
                  window's estimate is formed from the sampled steps alone.
    each window   (convergence.INTERVAL steps, the same step on every rank) one allreduce of
                  a small float64 vector averages the products and the step times over the
                  ranks (a separable method's shadow is each rank's own share); then every
                  rank decides alike: a critical interval (Regime) runs the value mode; else
                  convergence.choose among the candidates whose ratio clears the accuracy
                  guard (R_MIN), the mode in force kept within MARGIN; the ratios it reads are
                  pooled over the calm windows since the last critical one or switch. A mode
                  in force whose last window's ratio falls under R_MIN is left at once for the
                  value mode.
    step times    a mode's seconds per step: `step_s` where the settings inject them (a link
                  measured elsewhere: a step benchmark's cells), else measured by the job: the
                  mode in force's steps, and for a candidate never run a short probe (PROBE
                  steps of it, the first untimed) once the regime first allows one.

A switch keeps no stale state: the method that takes over starts with empty residuals (and
PowerSGD a fresh Q): nothing of the trajectory in force was left unsent by it; the method
left hands its residual (what it had not yet sent) to the next exchange once, added to each
bucket's gradient, and forgets it; its shadow starts again from the new trajectory.
"""
from __future__ import annotations

import math
import statistics

import torch

from ..exchange.base import Exchange
from ..exchange.memory import ResidualMemory
from ..exchange.routes import make_communicator
from . import convergence
from .convergence import TIME_TO_ACCURACY, VALUE
from .shadow import Shadows, exchange_route, method_value

__all__ = ["PROBE", "RETIRE", "TimeToAccuracy"]
# Steps a candidate never run is tried for, the first untimed (its first exchange allocates
# and negotiates, as a plan's first step in the trial): a median of three.
PROBE = 4
# A method the accuracy guard refuses in this many calm windows in a row is no longer shadowed
# until the next critical interval (its shadow starts again then): the shadows cost compute
# at every sampled step, and one that keeps failing the guard is not about to be chosen.
RETIRE = 3


class _Done:
    """A lossy mode's exchange that start() completed (a per-tensor method, run tensor by
    tensor at launch): finish() has nothing left to wait for."""
    route = None

    def finish(self, exchange):
        pass

    def drop(self, exchange):
        pass


_DONE = _Done()


class TimeToAccuracy:
    """The mode, its candidates' shadows and communicators, and the window's decision."""

    def __init__(self, settings, op, fusion_threshold_bytes, scale_block, engine):
        self.settings = settings
        self.engine = engine
        self.methods = tuple(settings.methods)
        self.scale_block = scale_block
        self.subs, self.memories = {}, {}
        for m in self.methods:
            route = exchange_route(m)
            comm = make_communicator(method_value(m), route and route.value, op,
                                     fusion_threshold_bytes, scale_block, engine=engine)
            self.subs[m] = comm
            if route is not None:
                self.memories[m] = ResidualMemory()      # the codecs' error feedback
        self.injected = dict(settings.step_s or {})
        self.buckets = []                    # the buckets of the last step (a hand-over's)
        self.on_switch = lambda text: None   # the communicator's event log
        self.shadows = Shadows(self.methods, scale_block)
        self.sample_at = convergence.sampled_positions(
            settings.interval, getattr(settings, "shadow_samples", convergence.SHADOW_SAMPLES))
        self.reset()

    # ---- state ---------------------------------------------------------------------------
    def reset(self):
        self.mode = VALUE
        self.steps = 0                       # steps ended (a checkpoint keeps the count)
        self.regime = convergence.Regime(interval=self.settings.interval)
        self.progress = convergence.Progress()
        self.shadows.reset()
        self.grad_sum = None
        self.window = 0                      # steps in the window so far
        self.times = {}                      # mode -> this window's step times (this rank)
        self.measured = {}                   # mode -> seconds per step (ranks' mean)
        self.ratios = {}                     # the last window's r_c
        # the windows' products summed (averaged over the ranks) since the regime last turned
        # critical or the mode last changed: the ratios the choice reads (one window of 50
        # steps is known to a few tenths; the calm run of windows, better)
        self.pooled = convergence.Progress()
        self.probing = []                    # candidates still to probe, then the mode back
        self.probe_back = None
        self.carry = {}                      # bucket index -> residual to send once
        self.refusals = {}                   # method -> calm windows refused in a row
        self.retired = set()                 # methods not shadowed (RETIRE)
        self.local, self.received = {}, {}
        self.windows = []                    # per window: step, critical, ratios, step_s, mode
        self.switches = []                   # (step, from, to, why)
        for m in self.methods:
            self._forget(m)

    def _forget(self, m):
        self.subs[m].reset_state()
        if m in self.memories:
            self.memories[m] = ResidualMemory()

    # ---- the exchange ------------------------------------------------------------------
    def before(self, index, bucket, memory=None):
        """Bucket `index`'s gradient as this rank has it, before anything is added to it."""
        kept = self.local.get(index)
        if kept is None or kept.shape != bucket.buffer.shape:
            self.local[index] = bucket.buffer.detach().clone()
        else:
            kept.copy_(bucket.buffer)
        carry = self.carry.pop(index, None)
        if carry is not None and carry.shape == bucket.buffer.shape:
            bucket.buffer.add_(carry)

    def start(self, bucket, memory=None):
        """Exchange `bucket` by the lossy mode in force: the codecs by their packet route with
        the mode's memory, top-k and PowerSGD tensor by tensor through their own communicator
        (their residuals and Q kept there, by tensor name). The front's residual (a value
        plan's error feedback) is carried once first."""
        if memory is not None:
            memory.compensate(bucket.name, bucket.buffer, inplace=True)
            memory.remember(bucket.name, bucket.buffer, bucket.buffer)
        sub = self.subs[self.mode]
        if self.mode in self.memories:
            return sub, sub.start(bucket, self.memories[self.mode])
        names = [f"{bucket.name}/{n}" for n in bucket.names]
        results = sub.reduce([bucket.view(j) for j in range(len(bucket))], names)
        for j, r in enumerate(results):
            bucket.view(j).copy_(r)
        return _DONE, Exchange(bucket, None)

    def after(self, index, bucket):
        """Bucket `index`'s received average (its buffer after the exchange)."""
        self.received[index] = bucket.buffer

    # ---- at a step boundary ------------------------------------------------------------
    def end_step(self, buckets, step_s):
        """A step ended (every rank, the same count): shadows, products, the window."""
        self.steps += 1
        steps = self.steps
        if not buckets or any(i not in self.local or i not in self.received
                              for i in range(len(buckets))):
            self.local, self.received = {}, {}
            return                           # an empty step (no backward): nothing to read
        self.buckets = list(buckets)
        local = [self.local[i] for i in range(len(buckets))]
        received = [self.received[i].detach() for i in range(len(buckets))]
        reference = received if self.mode == VALUE else local    # read now, kept as copies
        sampled = not self.probing and self.window in self.sample_at
        products = self.shadows.observe(sampled, local, reference, buckets, self.retired)
        if products is not None:
            try:
                self.progress.add(*products)
            except ValueError:
                pass                         # a non-finite gradient: no measure of this step
        if self.grad_sum is None or len(self.grad_sum) != len(received):
            self.grad_sum = [torch.zeros_like(r) for r in received]
        for s, r in zip(self.grad_sum, received):
            s.add_(r)
        self.received = {}
        if math.isfinite(step_s):
            self.times.setdefault(self.mode, []).append(step_s)
        if self.probing:
            self._probe_step(steps)
            return
        self.window += 1
        if self.window >= self.settings.interval:
            self._end_window(steps)

    def _probe_step(self, steps):
        m = self.probing[0]
        if len(self.times.get(m, [])) >= PROBE:
            self.probing.pop(0)
            if self.probing:
                self._switch(self.probing[0], steps, "probe: its step timed")
            else:
                self._finish_probe(steps)

    def _finish_probe(self, steps):
        """Every rank: the probed modes' step times (their median after the untimed first),
        averaged over the ranks; the mode before the probe back."""
        probed = [m for m in self.methods if m not in self.measured and m not in self.injected]
        local = [statistics.median(self.times.get(m, [math.nan])[1:] or [math.nan])
                 for m in probed]
        mean = self._average(local, "hvdc.auto.tta.probe")
        for m, t in zip(probed, mean):
            self.measured[m] = t
            self.times.pop(m, None)
        self._switch(self.probe_back, steps, "probe done")
        self.probe_back = None

    def _average(self, values, name):
        vec = torch.tensor([float(v) for v in values], dtype=torch.float64)
        n = self.engine.size()
        if n > 1:
            vec = self.engine.allreduce(vec, name) / n          # a sum over the ranks
        return vec.tolist()

    def _end_window(self, steps):
        """Every rank: one allreduce (products and step times averaged over the ranks), the
        regime, the decision."""
        modes = (VALUE,) + self.methods
        p = self.progress
        local = [p.exact] + [p.made.get(m, 0.0) for m in self.methods]
        for m in modes:
            ts = self.times.get(m, [])
            local += [statistics.median(ts) if ts else math.nan]
        mean = self._average(local, "hvdc.auto.tta.window")
        exact, made = mean[0], dict(zip(self.methods, mean[1:1 + len(self.methods)]))
        medians = dict(zip(modes, mean[1 + len(self.methods):]))
        for m, t in medians.items():
            if math.isfinite(t) and t > 0:
                self.measured[m] = t
        norm = math.sqrt(sum(float(torch.dot(s, s)) for s in self.grad_sum or ()))
        critical = self.regime.end_interval(norm)
        self.ratios = {m: v / exact for m, v in made.items()} if exact > 0 else {}
        if critical:
            self.pooled = convergence.Progress()
            self.refusals, self.retired = {}, set()
        else:
            self.pooled.add(exact, made)
        pooled = self.pooled.ratios()
        if not critical:
            for m in self.methods:
                refused = m not in self.retired and pooled.get(m, 0.0) < self.settings.r_min
                self.refusals[m] = self.refusals.get(m, 0) + 1 if refused else 0
                if self.refusals[m] >= RETIRE and m not in self.retired and m != self.mode:
                    self.retired.add(m)
                    self.shadows.reset(m)
            pooled = {m: r for m, r in pooled.items() if m not in self.retired}
        step_s = self.step_times()
        before = self.mode
        if critical:
            mode, why = VALUE, "critical interval: the value codecs"
        elif self.mode != VALUE and self.ratios.get(self.mode, 0.0) < self.settings.r_min:
            mode, why = VALUE, (f"{self.mode}'s progress {self.ratios.get(self.mode, math.nan):.3g}"
                                f" fell under {self.settings.r_min:g}")
        else:
            missing = [m for m in self.methods if m not in step_s
                       and pooled.get(m, 0.0) >= self.settings.r_min]
            if missing:
                mode, why = None, "probe: " + ", ".join(missing)
                self.probing, self.probe_back = missing, self.mode
            else:
                mode = convergence.choose(step_s, pooled, self.mode, self.settings.r_min,
                                          convergence.MARGIN)
                why = "the fewest seconds per unit of float32's progress"
        self.windows.append({"step": steps, "critical": critical, "norm": norm,
                             "ratios": {m: r for m, r in self.ratios.items()
                                        if m not in self.retired},
                             "pooled": dict(pooled), "retired": sorted(self.retired),
                             "step_s": dict(step_s),
                             "mode": before, "next": mode or self.probing[0]})
        self.progress = convergence.Progress()
        self.grad_sum = None
        self.window = 0
        self.times = {}
        if mode is None:
            self._switch(self.probing[0], steps, why)
        elif mode != self.mode:
            self._switch(mode, steps, why)

    def step_times(self):
        """{mode: seconds per step}: the injected ones, else the measured ones."""
        out = {m: t for m, t in self.measured.items() if math.isfinite(t) and t > 0}
        out.update({m: float(t) for m, t in self.injected.items()})
        return out

    def _switch(self, mode, steps, why):
        """From the next step on, exchange by `mode`. The mode left hands its residual to the
        next exchange once; the mode taken starts empty (module docstring)."""
        old = self.mode
        if old == mode:
            return
        if old != VALUE:
            self._hand_over(old)
        if mode != VALUE:
            self._forget(mode)
            self.shadows.reset(mode)
        self.mode = mode
        self.pooled = convergence.Progress()     # another trajectory from here on
        self.switches.append((steps, old, mode, why))
        self.on_switch(f"mode: {old} -> {mode} ({why})".replace("; ", ", "))

    def _hand_over(self, m):
        """Method `m`'s residuals, by bucket index, into self.carry (sent once), then forgotten."""
        buckets = self._buckets()
        if m in self.memories:
            for i, b in enumerate(buckets):
                r = self.memories[m].residuals.get(b.name)
                if r is not None:
                    self.carry[i] = self.carry.get(i, 0) + r.reshape(-1)
        else:
            memory = getattr(self.subs[m], "memory", None)
            for i, b in enumerate(buckets):
                parts = []
                for j, n in enumerate(b.names):
                    r = None if memory is None else memory.residuals.get(f"{b.name}/{n}")
                    parts.append(r.reshape(-1) if r is not None else
                                 torch.zeros(b.numels[j], dtype=torch.float32, device=b.device))
                if any(memory is not None and f"{b.name}/{n}" in memory.residuals
                       for n in b.names):
                    self.carry[i] = torch.cat(parts)
        self._forget(m)

    def _buckets(self):
        return self.buckets

    # ---- what it shows, and checkpoints -------------------------------------------------
    def report(self):
        return {"objective": TIME_TO_ACCURACY, "mode": self.mode,
                "critical": self.regime.critical, "ratios": dict(self.ratios),
                "step_s": self.step_times(), "injected": sorted(self.injected),
                "windows": list(self.windows),
                "switches": [list(s) for s in self.switches]}

    def state_dict(self):
        sh = self.shadows
        return {
            "mode": self.mode, "window": self.window, "steps": self.steps,
            "regime": {"critical": self.regime.critical, "previous": self.regime._previous,
                       "history": [list(h) for h in self.regime.history]},
            "progress": {"made": dict(self.progress.made), "exact": self.progress.exact,
                         "steps": self.progress.steps},
            "measured": dict(self.measured), "times": {m: list(t) for m, t in self.times.items()},
            "ratios": dict(self.ratios), "probing": list(self.probing),
            "refusals": dict(self.refusals), "retired": sorted(self.retired),
            "pooled": {"made": dict(self.pooled.made), "exact": self.pooled.exact,
                       "steps": self.pooled.steps},
            "probe_back": self.probe_back,
            "grad_sum": None if self.grad_sum is None else [t.clone() for t in self.grad_sum],
            "carry": {i: t.clone() for i, t in self.carry.items()},
            "shadows": {"residual": {m: {i: t.clone() for i, t in d.items()}
                                     for m, d in sh.residual.items()},
                        "qs": {m: {f"{a}.{b}": t.clone() for (a, b), t in d.items()}
                               for m, d in sh.qs.items()},
                        "sent": None if sh.sent is None else
                        {m: [t.clone() for t in us] for m, us in sh.sent.items()},
                        "reference": None if sh.reference is None else
                        [t.clone() for t in sh.reference]},
            "subs": {m: self.subs[m].state_dict() for m in self.methods
                     if m not in self.memories},
            "memories": {m: mem.state_dict() for m, mem in self.memories.items()},
            "windows": list(self.windows), "switches": [list(s) for s in self.switches]}

    def load_state_dict(self, s):
        """Take up a saved state (the same step on every rank: the mode and the window's
        sums are then alike everywhere)."""
        unknown = set(s["shadows"]["residual"]) - set(self.methods)
        if unknown:
            raise ValueError(f"Compression.auto: the saved time-to-accuracy state has "
                             f"candidates {sorted(unknown)} these settings do not")
        self.reset()
        self.mode = s["mode"]
        self.window = int(s["window"])
        self.steps = int(s["steps"])
        r = s["regime"]
        self.regime.critical, self.regime._previous = bool(r["critical"]), r["previous"]
        self.regime.history = [tuple(h) for h in r["history"]]
        self.progress = convergence.Progress(dict(s["progress"]["made"]),
                                             float(s["progress"]["exact"]),
                                             int(s["progress"]["steps"]))
        self.measured, self.ratios = dict(s["measured"]), dict(s["ratios"])
        self.refusals, self.retired = dict(s["refusals"]), set(s["retired"])
        self.pooled = convergence.Progress(dict(s["pooled"]["made"]), float(s["pooled"]["exact"]),
                                           int(s["pooled"]["steps"]))
        self.times = {m: list(t) for m, t in s["times"].items()}
        self.probing, self.probe_back = list(s["probing"]), s["probe_back"]
        self.grad_sum = s["grad_sum"]
        self.carry = {int(i): t for i, t in s["carry"].items()}
        sh = s["shadows"]
        self.shadows.residual = {m: {int(i): t for i, t in d.items()}
                                 for m, d in sh["residual"].items()}
        self.shadows.qs = {m: {tuple(int(x) for x in k.split(".")): t for k, t in d.items()}
                           for m, d in sh["qs"].items()}
        self.shadows.sent, self.shadows.reference = sh["sent"], sh["reference"]
        for m, st in s["subs"].items():
            self.subs[m].load_state_dict(st)
        for m, st in s["memories"].items():
            self.memories[m] = ResidualMemory()
            self.memories[m].load_state_dict(st)
        self.windows = list(s["windows"])
        self.switches = [tuple(x) for x in s["switches"]]

