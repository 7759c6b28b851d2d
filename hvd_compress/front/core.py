"""FrontCore: what every front shares, once (docs/architecture.md, "A front and its core").

A front owns its engine's life cycle: when a gradient is final, which buckets gradients form,
when an update is applied. The core owns the rest:

- the compression, from a value or a name (resolve_compression), and its communicator, made
  only by exchange.routes.make_communicator (Compression.auto's included), over the front's
  engine; what the communicator can do is its declared capabilities, never its class;
- error feedback: on or off (the method's default, or asked), refused where the communicator
  cannot carry it, and kept by parameter name (exchange/memory.py: a bucket's residual follows
  its parameters when the buckets change);
- the ranks' agreement, through the engine: first that every rank reached the check (a rank
  that never comes is named after `agree_timeout_s`, where the engine can tell), then that
  every rank's setup equals rank 0's, else a RuntimeError on every rank naming the difference;
- one checkpoint format (state_dict / load_state_dict / reset_state; the fronts name them
  compression_state_dict, load_compression_state_dict, reset_compression_state);
- the exchange of a bucket (start, progress, advance, finish, drop), the write-back of its
  reduced values, and the end of a step (its counters, the communicator's step boundary).
"""
import time

from .. import registry
from ..codecs import SCALE_BLOCK
from ..compression import Compression
from ..compressors import compressor_name
from ..engine.base import AVERAGE
from ..exchange.fusion import Bucket
from ..exchange.memory import ResidualMemory
from ..exchange.routes import make_communicator

__all__ = ["FrontCore", "FrontAPI", "StepRecord", "resolve_compression", "named_params",
           "AGREE_TIMEOUT_S", "FORMAT"]

# The checkpoint format: {"format", "scheme", "steps", "residuals" (by parameter name),
# "communicator" (its own state, if any)}. An earlier version's is still read: the optimizer's
# residuals by bucket (exchange/memory.py tells them apart), the DDP hook's by parameter.
FORMAT = 2
# How long the agreement waits for every rank to reach it. The ranks reach it in the same
# step, after work of the same kind, but a rank may load data, print or evaluate on its own
# before its first step.
AGREE_TIMEOUT_S = 30.0


def resolve_compression(compression):
    """A Compression value from a value or a name ('bit8', 'topk', 'powersgd', 'auto')."""
    if not isinstance(compression, str):
        return compression
    if compression == "auto":
        return Compression.auto
    entry = registry.scheme(compression)
    if entry.parameter is not None:            # top-k, PowerSGD: their default parameter
        return entry.load()(entry.parameter)
    return entry.load()


def named_params(param_groups, named_parameters=None):
    """(name, parameter) for every parameter of `param_groups` that needs a gradient, in their
    order (the same on every rank for the same model code), named by `named_parameters`
    ((name, parameter) pairs, as model.named_parameters() gives) or param.<i>."""
    group_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(group_params) if p.requires_grad]
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually produced by model.named_parameters()")
    seen = set()
    dups = {n for n, _ in named if n in seen or seen.add(n)}
    if dups:
        raise ValueError(f"parameter names must be unique; duplicates: {sorted(dups)}")
    names = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(group_params) if id(p) not in names]
    if unnamed:
        raise ValueError(f"named_parameters does not name {len(unnamed)} of the optimizer's "
                         "parameters")
    return [(names[id(p)], p) for p in group_params if p.requires_grad]


def packet_schemes():
    """The registered schemes whose codes carry error feedback through the front's memory."""
    return [s.name for s in registry.schemes().values() if s.packet]


class StepRecord:
    """One step's exchange: its exchanges in flight (by the front's key, where it keeps them
    here), when its first gradient was ready, its first and last launch, when backward ended
    (time.perf_counter()); what the end of the step counts and tells the communicator."""
    __slots__ = ("exchanges", "first_hook", "first_launch", "last_launch", "backward_end")

    def __init__(self):
        self.exchanges = {}
        self.first_hook = self.first_launch = self.last_launch = self.backward_end = None


class FrontCore:
    """The compression and communicator of one front, its error feedback, its ranks'
    agreement, its checkpoint and the end of its steps. `front` names the front in messages
    ('hvd_compress.DistributedOptimizer', 'hvd_compress.ddp')."""

    def __init__(self, front, compression, route=None, op=AVERAGE, fusion_threshold_bytes=None,
                 scale_block=SCALE_BLOCK, error_feedback=None, engine=None):
        self.front = front
        self.compression = resolve_compression(compression)
        self.communicator = make_communicator(self.compression, route, op,
                                              fusion_threshold_bytes, scale_block, engine=engine)
        self.engine = self.communicator.engine
        self.capabilities = can = self.communicator.capabilities
        if error_feedback is None:               # the method's default (on for onebit)
            error_feedback = bool(getattr(self.compression, "error_feedback", False)) and \
                can.takes_memory
        if error_feedback and not (can.takes_memory or can.own_memory):
            raise ValueError(f"error_feedback needs a packet scheme "
                             f"({', '.join(packet_schemes())}), not "
                             f"{compressor_name(self.compression)}")
        self.memory = ResidualMemory() if error_feedback and can.takes_memory else None
        self.steps = 0                           # step boundaries (end_step)
        self.step = StepRecord()                 # the step under way
        self._buckets_known = False              # plan() or use_buckets() said which
        self._restored = None                    # a saved plan for buckets not yet known

    def describe(self):
        return self.communicator.describe()

    # ---- buckets -------------------------------------------------------------------------
    def plan(self, named):
        """The communicator's buckets for (name, tensor) pairs in launch order, each bound to
        its members for error feedback: [(member indices, Bucket)]."""
        planned = self.communicator.plan([n for n, _ in named], [t for _, t in named])
        for _, bucket in planned:
            self.bind(bucket)
        self._buckets_known = True
        return planned

    def bucket(self, name, names, tensors):
        """A bucket the front cuts itself (one of DDP's), bound to its members `names`."""
        bucket = Bucket(name, names, tensors, flat=self.capabilities.fuses)
        self.bind(bucket)
        return bucket

    def bind(self, bucket):
        """From now on `bucket` holds its members: error feedback's residuals follow them."""
        if self.memory is not None and bucket.buffer is not None:
            self.memory.bind(bucket.name, bucket.names, bucket.numels, bucket.device)

    def use_bucket(self, index, bucket):
        """A front's own bucket `index`, before its first start() (auto's per-bucket plan)."""
        self.communicator.use_bucket(index, bucket)

    def use_buckets(self, buckets):
        """The front's own buckets, in launch order, after a step in which they changed; a
        checkpoint's plan waiting for them is taken up if it fits them."""
        self.communicator.use_buckets(buckets)
        self._buckets_known = True
        if self._restored is not None:
            self._take_restored()

    # ---- one step's exchanges ---------------------------------------------------------------
    def hooked(self):
        """A gradient of this step is ready (the first one's time is the step's backward start)."""
        if self.step.first_hook is None:
            self.step.first_hook = time.perf_counter()

    def start(self, bucket, key=None):
        """Compress and launch `bucket` (with error feedback, if on); its Exchange, kept in
        this step's record under `key` if given."""
        began = time.perf_counter()
        exchange = self.communicator.start(bucket, self.memory)
        self._launched(began, key, exchange)
        return exchange

    def start_group(self, buckets, key=None):
        """Several per-tensor buckets as one exchange (capabilities.groups)."""
        began = time.perf_counter()
        exchange = self.communicator.start_group(buckets, self.memory)
        self._launched(began, key, exchange)
        return exchange

    def _launched(self, began, key, exchange):
        step = self.step
        if step.first_launch is None:
            step.first_launch = began
        step.last_launch = began
        if key is not None:
            step.exchanges[key] = exchange

    def backward_ended(self, exchanges=()):
        """Backward is over: how long each exchange already ran beside it (overlap_s)."""
        now = self.step.backward_end = time.perf_counter()
        self.communicator.stats.add("overlap_s", sum(now - ex.launched for ex in exchanges))

    def next_step(self):
        """The record of the step under way, and a fresh one for the next."""
        step, self.step = self.step, StepRecord()
        return step

    def progress(self, exchange):
        self.communicator.progress(exchange)

    def advance(self, exchanges):
        self.communicator.advance(exchanges)

    def finish(self, exchange):
        self.communicator.finish(exchange)

    def drop(self, exchange):
        self.communicator.drop(exchange)

    def write_grads(self, bucket, params):
        """The bucket's reduced values as `params`' gradients: a float32 member's view of the
        buffer becomes its .grad (nothing copied; autograd then accumulates the next backward
        into the bucket, as DDP's gradient_as_bucket_view), any other is copied into .grad."""
        with self.communicator.stats.timing("copy_s"):
            for j, p in enumerate(params):
                view = bucket.grad_view(j)
                if view is not None:
                    if p.grad is not view:
                        p.grad = view
                    continue
                result = bucket.result(j)
                if p.grad is None:
                    p.grad = result.clone()
                elif result is not p.grad:
                    p.grad.copy_(result)

    def copy_out(self, bucket, targets):
        """The bucket's reduced values into `targets` (the front's tensors, member by member)."""
        with self.communicator.stats.timing("copy_s"):
            for j, target in enumerate(targets):
                result = bucket.result(j)
                if result is not target:
                    target.copy_(result.view(target.shape))

    def end_step(self, step):
        """The exchange of `step` (a StepRecord) is over, on every rank at the same count: its
        counters (first launch to now, first to last launch) and the communicator's boundary."""
        if step.first_launch is not None:
            stats = self.communicator.stats
            stats.add("exchange_s", time.perf_counter() - step.first_launch)
            stats.add("launch_span_s", step.last_launch - step.first_launch)
        self.steps += 1
        self.communicator.end_step(step.first_hook, step.backward_end)

    # ---- the ranks agree -----------------------------------------------------------------
    def setup(self):
        """The core's part of what every rank must agree on."""
        comm = self.communicator
        return {"compression": compressor_name(self.compression),
                # a compression with settings of its own (Compression.auto) shows them
                "options": repr(self.compression)
                if callable(getattr(self.compression, "options", None)) else None,
                "route": comm.describe(), "op": str(comm.op),
                "error_feedback": self.memory is not None,
                "fusion_threshold_bytes": comm.fusion_threshold_bytes,
                "scale_block": comm.scale_block}

    def agree(self, setup, what="setup", timeout_s=AGREE_TIMEOUT_S, engine=None):
        """Raise, on every rank, if a rank did not reach this check within timeout_s (where
        the engine can tell) or if any rank's `setup` (a dict) differs from rank 0's. `engine`:
        the ranks to agree among, when they are not the exchange's own (HSDP's replicas)."""
        engine = engine or self.engine
        if engine.size() == 1:
            return
        absent = engine.absent(f"agree.{what}", timeout_s)
        if absent:
            ranks = ", ".join(map(str, absent))
            raise RuntimeError(
                f"{self.front}: rank {ranks} did not come to the ranks' agreement on the "
                f"{what} within {timeout_s:g} s: every rank must run {self.front} alike (a "
                "rank that registered no hook, or built no optimizer, runs other collectives)")
        every = engine.allgather_object(setup, f"hvdc.agree.{what}")
        for rank, other in enumerate(every):
            if other != every[0]:
                detail = "; ".join(
                    f"{k}: rank 0 has {_short(every[0].get(k))}, rank {rank} has "
                    f"{_short(other.get(k))}" for k in sorted(set(other) | set(every[0]))
                    if other.get(k) != every[0].get(k))
                raise RuntimeError(f"{self.front}: ranks disagree on the {what} ({detail})")

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self):
        """This rank's compression state (it differs from rank to rank: save one per rank):
        the scheme, the steps, error feedback's residuals by parameter name, and the
        communicator's own (PowerSGD's Q, top-k's residuals, auto's plan)."""
        state = {"format": FORMAT, "scheme": self.describe(), "steps": self.steps,
                 "residuals": self.memory.state_dict() if self.memory is not None else {}}
        own = self.communicator.state_dict()
        if own is None:
            own = self._restored                 # restored, waiting for its buckets
        if own is not None:
            state["communicator"] = own
        return state

    def load_state_dict(self, state, plan=True):
        """Restore a state_dict() of this rank (a state of another scheme is refused).
        plan=False leaves auto's plan out (the ranks changed: it is measured again); a plan
        for buckets the front has not cut yet is taken up when they are (use_buckets)."""
        scheme = state.get("scheme")
        if scheme is not None and scheme != self.describe():
            raise ValueError(f"this checkpoint's compression state is for {scheme!r}, "
                             f"not {self.describe()!r}")
        if self.memory is not None:
            self.memory.load_state_dict(state.get("residuals", {}))
        own = state.get("communicator")
        if own is not None and not (plan is False and self.capabilities.plans_buckets):
            if self.capabilities.plans_buckets:
                self._restored = own
                if self._buckets_known:
                    self._take_restored()
            else:
                self.communicator.load_state_dict(own)
        self.steps = int(state.get("steps", self.steps))

    def _take_restored(self):
        self.communicator.load_state_dict(self._restored)
        if self.communicator.state_dict() is not None:
            self._restored = None

    def reset_state(self):
        """Forget residuals and the communicator's state (the ranks changed)."""
        if self.memory is not None:
            self.memory.load_state_dict({})
        self._restored = None
        self.communicator.reset_state()

    # ---- what it shows -------------------------------------------------------------------
    def pop_stats(self, step_s=0.0, link_bits_per_s=None):
        """The communicator's counters since the last call (roles.Stats) and, given the time
        the front's steps took since then (step_s > 0), how far they are from what the machine
        and the link allow: step_s, compute_s (step_s less the waits, communicate_s: the
        compute floor) and, with the link's rate (1e8 for 100 Mbit/s), wire_s (bytes_sent at
        that rate), bound_s = max(compute_s, wire_s) and step_over_bound."""
        stats = self.communicator.pop_stats()
        if step_s > 0:
            stats["step_s"] = step_s
            stats["compute_s"] = step_s - stats.get("communicate_s", 0.0)
            if link_bits_per_s:
                stats["wire_s"] = 8 * stats.get("bytes_sent", 0) / float(link_bits_per_s)
                stats["bound_s"] = max(stats["compute_s"], stats["wire_s"])
                stats["step_over_bound"] = stats["step_s"] / stats["bound_s"]
        return stats

    def plan_report(self):
        return self.communicator.plan_report()

    def pause_step_clock(self):
        self.communicator.pause_step_clock()

    def close(self):
        self.communicator.close()


class FrontAPI:
    """What every front offers its user, the same on each, from its FrontCore (`self.core`):
    the compression state of a checkpoint, auto's plan report and step clock, the
    communicator. A front whose pending work must be done before its state is read (the
    optimizer's overlapped updates) says so in _settle(); _forget_step() drops an unfinished
    step's exchanges before a reset."""

    def _settle(self):
        """Before the compression state is read or restored (nothing by default)."""

    def _forget_step(self):
        """Before a reset: drop what an unfinished step has in flight (nothing by default)."""

    @property
    def communicator(self):
        return self.core.communicator

    @property
    def memory(self):
        return self.core.memory

    @property
    def steps(self):
        return self.core.steps

    def describe(self):
        return self.core.describe()

    def compression_state_dict(self):
        """This rank's compression state (FrontCore.state_dict: residuals by parameter name,
        PowerSGD's Q, top-k's residuals, auto's plan); it differs by rank: keep one per rank."""
        self._settle()
        return self.core.state_dict()

    def load_compression_state_dict(self, state, plan=True):
        """Restore compression_state_dict() of this rank; plan=False leaves auto's plan out
        (the ranks changed: it is measured and made again)."""
        self._settle()
        self.core.load_state_dict(state, plan)

    def reset_compression_state(self):
        """Forget residuals, PowerSGD's Q, auto's plan and any exchange of an unfinished step:
        what elastic training does when the ranks change (labs/elastic.py says why)."""
        self._forget_step()
        self.core.reset_state()

    def plan_report(self):
        """Compression.auto: the plan (auto.records.PlanReport: a label per bucket, its
        predicted and measured step, what it was chosen from, the events); None otherwise."""
        return self.core.plan_report()

    def pause_step_clock(self):
        """Compression.auto: the job did other work since its last step (an evaluation, a
        checkpoint): leave the next step's time out. Call it on every rank alike."""
        self.core.pause_step_clock()

    def close(self):
        self.core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _short(value, limit=200):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
