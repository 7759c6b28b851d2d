"""The network table's numbers: each row's exchange predicted beside the measured one, bytes on
the wire beside the bytes counted, the link rate at which compression breaks even, and how far
each step is from its bound (max of the compute floor and the wire time of its bytes).

Inputs: the network table's summary.csv and run manifests (labs/kit/matrix.py, a run over an
emulated link: labs.netem), the link's calibration (labs.netem.bench's *_fit.json: alpha and
beta per collective and rank count, hvd_compress.costmodel.fit), and the loopback table's
summary.csv for the codec term (decompress time of the same configuration, measured on this
machine in a run where the link costs next to nothing).

The prediction of one step's exchange, first bucket launched to last gradient reduced
(hvd_compress.costmodel.methods.exchange_seconds; the units are the buckets, or the tensors,
in the order backward produces them):

    T = max(S, t_1 + ... + t_(k-1)) + t_k + D

t_i = alpha_c m_i + beta_c b_i, each collective c of unit i on its own fitted link; S the
slowest rank's launch span (first launch to last, measured: backward's pace, the exchange
cannot end before the last unit of the last rank leaves); for the two-phase route t_i is the
alltoall and the allgathers of the reduced chunks follow (+ p_1 + ... + p_k); D the decode (and
the two-phase route's middle step) of the loopback run. Encoding is left out: it happens
before each launch, inside S or while earlier units are on the wire.

Two calibrations of the link: one with every core kept busy, as backward keeps them for the
first S seconds of the exchange, and one on idle cores, as they are after it; each collective
is timed by the first until S and by the second after (exchange_seconds' links_after). Where
ranks outnumber cores, a collective's fixed cost is mostly the scheduler's: a calibration on
busy cores overstates the collectives that run after backward, one on idle cores understates
those that run during it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hvd_compress.costmodel import methods
from hvd_compress.costmodel.model import Cost, Link

from .flags import AUTO

# Where a prediction is judged: rows whose measured exchange is at least this long.
JUDGED_MS = 5.0
TOLERANCE = 0.25


class NetworkError(RuntimeError):
    pass


def load_links(fit_json):
    """{n: {collective: Link}} from a calibration's per-(collective, n) fits."""
    path = Path(fit_json)
    try:
        fits = json.loads(path.read_text())["fits"]
    except (OSError, ValueError, KeyError) as err:
        raise NetworkError(f"{path}: not a calibration fit ({err}); run the calibration "
                           f"again (python -m labs.kit.job)") from None
    links = {}
    for fit in fits:
        if fit.get("n") is None or fit["collective"] == "all":
            continue
        links.setdefault(int(fit["n"]), {})[fit["collective"]] = Link(
            alpha=float(fit["alpha_s"]), beta=float(fit["beta_s_per_byte"]))
    if not links:
        raise NetworkError(f"{path}: no per-rank-count fits in it")
    return links


def idle_fit_path(fit_json):
    """Where the calibration on idle cores lies beside the busy one (labs/kit/job.py)."""
    return Path(fit_json).with_name("link_idle_fit.json")


def load_calibration(fit_json):
    """(links timed on busy cores, links timed on idle cores or None if that calibration is
    not there): the exchange while backward runs, and after it."""
    idle = idle_fit_path(fit_json)
    return load_links(fit_json), (load_links(idle) if idle.is_file() else None)


def units_of(manifest):
    """The exchange's units for a run, from its manifest (shapes, method, route, block), and
    whether it is the two-phase route."""
    shapes = [tuple(s) for s in manifest["parameter_shapes"]]
    block = (manifest.get("args") or {}).get("scale_block")
    method, route = manifest["compression"], manifest.get("reduction")
    units = methods.exchange_units(method, shapes, manifest["world_size"],
                                   manifest.get("method_parameter"), route, block)
    return units, methods.two_phase(method, route)


def fixed_and_bytes(units, n, links, rate_bps):
    """One exchange as a Cost at the calibrated link: messages = its alpha seconds, bytes = the
    bytes that, at rate_bps, take its beta seconds (so 8 bytes / rate is its bandwidth term
    at any other rate)."""
    alpha = beta_s = 0.0
    for unit in units:
        for collective, nbytes in unit:
            cost = methods.COLLECTIVE_COSTS[collective](n, nbytes)
            link = links[collective]
            alpha += cost.messages * link.alpha
            beta_s += cost.bytes * link.beta
    return Cost(alpha, beta_s * rate_bps / 8)


@dataclass
class Prediction:
    run: str
    ranks: int
    compression: str
    measured_ms: float            # the row's mean exchange span (exchange_ms)
    predicted_ms: float           # the link's part + the codec term (loopback decompress)
    break_even_bps: float         # nan for float32 itself

    @property
    def error(self):
        return self.predicted_ms / self.measured_ms - 1

    @property
    def judged(self):
        return self.measured_ms >= JUDGED_MS


def predictions(net_frame, net_manifests, loop_frame, links, links_after=None):
    """One Prediction per parallel row of the network table; `links_after` (the link timed on
    idle cores) for what is on the wire after backward, if there is such a calibration."""
    loop = {row.run: row for row in loop_frame.itertuples()}
    rows = {row.run: row for row in net_frame.itertuples()}
    out = []
    for row in net_frame.itertuples():
        if row.ranks < 2 or row.compression == AUTO:    # a plan predicts its own step
            continue
        n = int(row.ranks)
        if n not in links or (links_after is not None and n not in links_after):
            raise NetworkError(f"the calibration has no fits at n = {n} for {row.run}")
        twin = loop.get(row.run)
        if twin is None:
            raise NetworkError(f"the loopback table has no {row.run} to take the codec term from")
        manifest = net_manifests[row.run]
        units, phased = units_of(manifest)
        # the slowest rank's launch span: every rank's exchange waits for its last bucket
        span_ms = getattr(row, "slowest_launch_span_ms", row.launch_span_ms)
        wire = methods.exchange_seconds(units, n, links[n], launch_span=span_ms / 1000,
                                        second_phase_after_backward=phased,
                                        links_after=links_after and links_after[n])
        decode = twin.decompress_ms
        base = f"np{n}-none"
        be = math.nan
        if row.compression != "none" and base in rows:
            fp32_units, _ = units_of(net_manifests[base])
            alone = (links_after or links)[n]    # without overlap: after backward
            be = methods.break_even_rate(
                fixed_and_bytes(fp32_units, n, alone, row.netem_rate_bps),
                fixed_and_bytes(units, n, alone, row.netem_rate_bps),
                loop[base].decompress_ms / 1000 if base in loop else 0.0, decode / 1000)
        out.append(Prediction(row.run, n, row.compression, row.exchange_ms,
                              1000 * wire + decode, be))
    return out


@dataclass
class StepBound:
    """How far a row's step is from what the machine and the link allow:
    bound = max(the compute floor, the wire time of the step's bytes)."""
    step_ms: float
    floor_ms: float               # the mean step less its mean wait for the exchange
    wire_ms: float                # the bytes a rank counted per step, at the link's rate

    @property
    def bound_ms(self):
        return max(self.floor_ms, self.wire_ms)

    @property
    def ratio(self):
        return self.step_ms / self.bound_ms


def step_bound(row, rate_bps):
    """A table row's StepBound. The floor is what the lab measures of the step without its
    waits: step_ms less communicate_ms (pop_stats' compute_s); the wire counts the bytes the
    communicator counted (bytes_per_step) at `rate_bps`, not TCP's and Ethernet's framing
    (wire_bytes_per_step / bytes_per_step says how much that adds). A row with no wait
    measured (no pop_stats) has no floor: NetworkError, not a guess."""
    step, wait, sent = (float(getattr(row, k)) for k in ("step_ms", "communicate_ms",
                                                        "bytes_per_step"))
    if not all(map(math.isfinite, (step, wait, sent))) or not rate_bps > 0:
        raise NetworkError(f"{row.run}: no step / bound without its step, its wait for the "
                           f"exchange and its bytes (step {step} ms, communicate {wait} ms, "
                           f"{sent} bytes) and the link's rate ({rate_bps} bit/s)")
    return StepBound(step, step - wait, 1000 * 8 * sent / rate_bps)


@dataclass
class PlanRow:
    """An --auto-allreduce row of a table: the plan it ran, the optimizer's own prediction of
    its step beside the step it measured, and the step the table measured."""
    run: str
    ranks: int
    plan: str                     # scheme:route per bucket, launch order
    predicted_ms: float           # the plan's predicted step (the optimizer's)
    plan_measured_ms: float       # the optimizer's median measured step since the plan
    step_ms: float                # the table's mean step over the whole run (calibration in)
    calibration_s: float          # what deciding cost (the optimizer's calibration seconds)
    train_time_s: float           # the run's training time, which that is a share of

    @property
    def error(self):
        return self.predicted_ms / self.plan_measured_ms - 1


def plan_rows(frame):
    """A PlanRow per --auto-allreduce row of a summary (labs/kit/matrix.py). A run that never
    planned (its calibration failed: it trained on float32 and said why) is a row too, its plan
    that fallback and no prediction; a row with neither, or a plan without its predicted and
    measured step, is an error: the report never shows a blank where the plan should be."""
    out = []
    for row in frame.itertuples():
        if row.compression != AUTO:
            continue
        plan = getattr(row, "plan", "")
        plan = plan.strip() if isinstance(plan, str) else ""
        fallback = getattr(row, "plan_fallback", "")
        fallback = fallback.strip() if isinstance(fallback, str) else ""
        if not plan and not fallback:
            raise NetworkError(f"{row.run}: no plan and no fallback in its steps (did the "
                               f"optimizer decide before the run ended?)")
        found = PlanRow(row.run, int(row.ranks),
                        plan or f"float32 on every bucket ({fallback})",
                        float(row.plan_predicted_ms), float(row.plan_measured_ms),
                        float(row.step_ms), float(getattr(row, "plan_calibration_s", math.nan)),
                        float(row.train_time_s))
        if plan and not all(map(math.isfinite, (found.predicted_ms, found.plan_measured_ms))):
            raise NetworkError(f"{row.run}: its plan has no predicted or no measured step "
                               f"(predicted {found.predicted_ms}, measured "
                               f"{found.plan_measured_ms} ms)")
        if not math.isfinite(found.calibration_s):
            raise NetworkError(f"{row.run}: its manifest's plan_report has no calibration_s "
                               f"(what deciding cost)")
        out.append(found)
    return out


def rate_text(bps):
    if math.isinf(bps):
        return "any rate"
    if bps <= 0 or math.isnan(bps):
        return "never"
    if bps >= 1e9:
        return f"{bps / 1e9:.2f} Gbit/s"
    return f"{bps / 1e6:.0f} Mbit/s"
