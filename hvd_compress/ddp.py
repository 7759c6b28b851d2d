"""hvd_compress on PyTorch DDP: a communication hook that carries DDP's gradient buckets by any
registered scheme and route, top-k, PowerSGD or Compression.auto, over torch.distributed
(Gloo on CPU, NCCL on CUDA), with the same codecs, routes, error feedback and planner as the
Horovod optimizer (docs/ddp.md).

    import hvd_compress.ddp as hcd
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = hcd.HookState("bit8", route="alltoall", model=model)
    model.register_comm_hook(state, hcd.hook)
    ...
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, path)
    state.load_state_dict(checkpoint["hook"])

How a step goes, and why:
- DDP calls the hook once per bucket, in bucket order (0 first: the last layers), while
  backward still runs. The hook compresses the bucket and launches its collective at once
  (communicator.start), so the exchange overlaps backward as DDP's own hooks do.
- A one-phase exchange (the allreduce and allgather routes, top-k) is decoded in its
  collective's callback, as soon as it completes, as DDP's own hooks do. The hook of the last
  bucket (GradBucket.is_last()) moves every multi-phase exchange on (the two-phase route's
  allgather, PowerSGD's second allreduce, auto's buckets) and finishes them, in bucket order,
  on the main thread. Every collective is launched from the main thread in the same order on
  every rank, which is how torch.distributed matches them (not by name); DDP's own PowerSGD
  hook launches its second allreduce from a callback of its first, in whichever order the
  first ones complete.
- On Gloo over a slow link, large gathers go in pieces (HookState gather_pieces: decided after
  the first steps from how fast the whole ones ran; why: engine/distributed.py).
- Bit for bit: `none` equals DDP's default allreduce and `fp16` equals fp16_compress_hook (the
  engine averages as DDP does: divide, then sum); the packet routes decode and sum in rank
  order with the plugin's codecs, so bit8 on DDP equals bit8 on Horovod for the same buckets.
- The first time a bucket layout is seen, the ranks compare what they are about to send
  (scheme, route, bucket sizes and dtypes): ranks that disagree fail with a message naming
  the difference instead of hanging or mixing codes.
- DDP rebuilds its buckets after the first iteration: each layout gets its own buckets (and,
  for the packet routes, its own residuals); per-tensor state (top-k's and PowerSGD's
  residuals, PowerSGD's Q) is keyed by the parameters' names when `model` is given, so it
  survives the rebuild and a checkpoint.
"""
import time

import torch

from . import registry
from .auto.communicator import AutoCommunicator
from .auto.settings import Auto
from .codecs import SCALE_BLOCK
from .compression import Compression
from .compressors import compressor_name
from .engine.base import AVERAGE
from .engine.distributed import TorchEngine
from .exchange.fusion import Bucket
from .exchange.memory import ResidualMemory
from .exchange.routes import AllgatherCommunicator, AllreduceCommunicator, make_communicator
from .methods.topk import TopKCommunicator

__all__ = ["HookState", "FlatBucket", "hook", "register", "resolve_compression"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Communicators whose exchange is one collective, then finish(): decoded in the collective's
# callback (no collective is launched there, so the ranks' order of launches is kept).
_ONE_PHASE = (AllreduceCommunicator, AllgatherCommunicator, TopKCommunicator)
# gather_pieces=None: after this many steps, Gloo's large gathers go in pieces if rank 0's large
# collectives (any: auto's first steps allreduce float32) sent fewer bits a second than this
# (engine sent_times: its bytes sent over launch to done). At 100 Mbit/s, 2 ranks, pieces took
# bit8's step from 193 to 148 ms; over loopback they cost 12-40 ms a 1.14 MB gather.
PIECES_DECIDED_AT = 3
PIECES_BELOW_BITS_PER_S = 200e6


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


class _Layout:
    """One DDP bucket's layout (index, sizes, shapes), the plugin's buckets that carry it, and
    its parameters' names and sizes (in the bucket's order)."""

    def __init__(self, key, buckets, members, names, numels):
        self.key, self.buckets, self.members = key, buckets, members
        self.names, self.numels = names, numels


class HookState:
    """The hook's state: the communicator (scheme and route, over a TorchEngine), error
    feedback's residuals, the buckets of each layout DDP has used, and the exchanges of the
    step in flight.

    compression: a name ('none', 'fp16', 'bit16', 'bf16', 'bit8', 'int8', 'onebit', 'topk',
        'powersgd', 'auto') or a Compression value (Compression.topk(0.001), Compression.auto(...)).
    route: None (the scheme's default) or 'allgather' / 'alltoall' / 'allreduce' where the
        scheme has it (registry.SCHEMES).
    process_group: DDP's (None: the default group).
    error_feedback: carry each rank's quantisation error to the next step (packet schemes);
        None: the scheme's default (on for onebit; top-k and PowerSGD keep their own).
    model: the DDP model (or its module), to name per-tensor state by parameter name.
    decode_in_callback: a one-phase exchange is decoded in its collective's callback (True,
        DDP's way) or on the main thread at the last bucket, with the others (False).
    gather_pieces: send Gloo's large allgathers and alltoalls in pieces (True), whole (False),
        or None: whole for the first PIECES_DECIDED_AT steps, then in pieces where rank 0's
        large collectives sent below PIECES_BELOW_BITS_PER_S (a slow link; why:
        engine/distributed.py GATHER_PIECE_BYTES), the same on every rank (a broadcast).
    """

    def __init__(self, compression="bit8", route=None, process_group=None, error_feedback=None,
                 scale_block=SCALE_BLOCK, model=None, decode_in_callback=True,
                 gather_pieces=None):
        self.compression = resolve_compression(compression)
        self.engine = TorchEngine(process_group)
        if isinstance(self.compression, Auto):
            if route is not None:
                raise ValueError("Compression.auto chooses each bucket's route: pass no route")
            self.communicator = AutoCommunicator(self.compression, AVERAGE, 0, scale_block,
                                                 engine=self.engine)
        else:
            self.communicator = make_communicator(self.compression, route, AVERAGE, 0,
                                                  scale_block, engine=self.engine)
        comm = self.communicator
        if error_feedback is None:
            error_feedback = bool(getattr(self.compression, "error_feedback", False)) and comm.takes_memory
        if error_feedback and not (comm.takes_memory or comm.own_memory):
            raise ValueError("error_feedback needs a packet scheme (bit8, bit16, int8, onebit, "
                             f"bf16), not {compressor_name(self.compression)}")
        self.memory = ResidualMemory() if error_feedback and comm.takes_memory else None
        self.decode_in_callback = bool(decode_in_callback)
        self.gather_pieces = gather_pieces
        if gather_pieces is not None:
            self.engine.in_pieces, self.engine.timed = bool(gather_pieces), False
        self._names = {}
        if model is not None:
            module = getattr(model, "module", model)
            self._names = {id(p): n for n, p in module.named_parameters()}
        self._layouts = {}                 # DDP bucket index -> _Layout in use
        self._checked = set()              # layout keys the ranks agreed on
        self._pending = []                 # (layout, exchanges, future, buffer) this step
        self._changed = False              # a bucket's layout changed in this step
        self._restored = None              # a checkpoint's communicator state, not yet taken
        self._by_parameter = {}            # error feedback's residuals by parameter name
        self._first_hook = None
        self._last_index = None
        self.steps = 0

    # ---- what the hook does -----------------------------------------------------------------
    def describe(self):
        return self.communicator.describe()

    def exchange(self, grad_bucket):
        """Start this bucket's exchange. A one-phase exchange finishes when its collective
        completes (decoded in the collective's callback, as DDP's own hooks do); the others
        are finished, in bucket order, by the last bucket's hook."""
        buffer = grad_bucket.buffer()
        try:
            if self._first_hook is None:
                self._first_hook = time.perf_counter()
            layout = self._layout(grad_bucket, buffer)
            comm, exchanges = self.communicator, []
            memory = self.memory if comm.takes_memory else None
            start_group = getattr(comm, "start_group", None)   # PowerSGD: a bucket at once
            for members, bucket in zip(layout.members, layout.buckets):
                with comm.stats.timing("copy_s"):
                    for j, view in enumerate(members):
                        bucket.put(j, view)
                if start_group is None:
                    exchanges.append(comm.start(bucket, memory))
            if start_group is not None:
                exchanges.append(start_group(layout.buckets, memory))
            if self.decode_in_callback and isinstance(comm, _ONE_PHASE):
                future = torch.futures.collect_all(
                    [self.engine.future(ex.handle) for ex in exchanges]).then(
                    lambda _: self._finish(layout, exchanges, buffer))
            else:
                future = torch.futures.Future()
                self._pending.append((layout, exchanges, future, buffer))
            self._last_index = layout.key[0]
            if grad_bucket.is_last():
                self._finish_step()
        except BaseException as err:
            self._fail(err)
            raise
        return future

    def _finish(self, layout, exchanges, buffer):
        """Write one DDP bucket's reduced values into its buffer; the buffer."""
        comm = self.communicator
        for ex in exchanges:
            comm.finish(ex)
        with comm.stats.timing("copy_s"):
            for members, bucket in zip(layout.members, layout.buckets):
                for j, view in enumerate(members):
                    result = bucket.result(j)
                    if result is not view:
                        view.copy_(result.view(view.shape))
        return buffer

    def _finish_step(self):
        comm = self.communicator
        backward_end = time.perf_counter()
        comm.advance([ex for _, exchanges, _, _ in self._pending for ex in exchanges])
        for layout, exchanges, future, buffer in self._pending:
            future.set_result(self._finish(layout, exchanges, buffer))
        self._pending, first_hook, self._first_hook = [], self._first_hook, None
        self.steps += 1
        if self.gather_pieces is None and self.steps == PIECES_DECIDED_AT:
            self._decide_pieces()
        if self._changed:
            self._settle_layouts(self._last_index)
        end_step = getattr(comm, "end_step", None)
        if end_step is not None:
            end_step(first_hook, backward_end)

    def _decide_pieces(self):
        """Gloo's large gathers in pieces from now on if rank 0's large collectives were slow
        (a slow link), said by rank 0 so that every rank cuts alike (gather_pieces=None)."""
        engine, rate = self.engine, None
        if engine.rank() == 0 and engine.sent_times:
            nbytes = sum(b for b, _ in engine.sent_times)
            rate = 8 * nbytes / sum(t for _, t in engine.sent_times)
        slow = rate is not None and rate < PIECES_BELOW_BITS_PER_S
        engine.in_pieces = bool(engine.broadcast_object(slow, root_rank=0, name="hvdc.pieces"))
        engine.timed = False                 # decided: nothing more to time

    def _settle_layouts(self, last):
        """After a step in which DDP's buckets changed: forget layouts past the last bucket,
        tell auto its buckets (it plans again), take up a restored plan that fits them."""
        self._changed = False
        for index in [i for i in self._layouts if i > last]:
            del self._layouts[index]
        comm = self.communicator
        if isinstance(comm, AutoCommunicator):
            comm.use_buckets([self._layouts[i].buckets[0] for i in sorted(self._layouts)])
        if self._restored is not None:
            comm.load_state_dict(self._restored)
            if comm.state_dict() is not None:
                self._restored = None

    def _fail(self, err):
        """An exchange failed: complete DDP's futures with the error (no hang), forget the step."""
        for _, _, future, _ in self._pending:
            if not future.done():
                future.set_exception(err)
        self._pending, self._first_hook = [], None

    # ---- buckets ----------------------------------------------------------------------------
    def _layout(self, grad_bucket, buffer):
        if buffer.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.describe()} carries floating-point gradients; DDP bucket "
                             f"{grad_bucket.index()} holds {buffer.dtype}")
        if buffer.is_sparse or not buffer.is_contiguous():
            raise ValueError(f"DDP bucket {grad_bucket.index()} is not a dense contiguous "
                             "buffer; the hook carries DDP's flat buckets only")
        params = grad_bucket.parameters()
        shapes = tuple(tuple(p.shape) for p in params)
        key = (grad_bucket.index(), buffer.numel(), str(buffer.dtype), shapes)
        layout = self._layouts.get(key[0])
        if layout is None or layout.key != key:
            layout = self._layouts[key[0]] = self._make_layout(key, buffer, params)
            self._changed = True
        else:
            layout = self._rebind(layout, buffer)
        if key not in self._checked:
            self._check_ranks_agree(key)
            self._checked.add(key)
        return layout

    def _param_names(self, index, params):
        return [self._names.get(id(p), f"ddp.{index}.{j}") for j, p in enumerate(params)]

    def _make_layout(self, key, buffer, params):
        index, numel = key[0], key[1]
        comm = self.communicator
        names, numels = self._param_names(index, params), [p.numel() for p in params]
        self._keep_residuals()
        if not _tensorwise(comm):
            # the whole DDP bucket as one of ours: one flat buffer (packet routes, auto) or one
            # tensor (the allreduce route)
            name = f"ddp.{index}.{numel}"
            bucket = Bucket(name, [name], [buffer], flat=comm.fuses)
            layout = _Layout(key, [bucket], [[buffer]], names, numels)
            self._take_residual(layout)
        else:                                  # top-k, PowerSGD: tensor by tensor
            views, offset = [], 0
            for p in params:
                views.append(buffer[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            buckets = [Bucket(n, [n], [v], flat=False) for n, v in zip(names, views)]
            layout = _Layout(key, buckets, [[v] for v in views], names, numels)
        if isinstance(comm, AutoCommunicator):
            comm.use_bucket(index, layout.buckets[0])
        return layout

    def _rebind(self, layout, buffer):
        """DDP may hand a new buffer object for the same layout: point the views at it."""
        first = layout.members[0][0]
        if first.data_ptr() == buffer.data_ptr():
            # the same buffer (the views hold its storage: no other can have its address)
            return layout
        if len(layout.members) == 1:
            layout.members = [[buffer]]
            return layout
        views, offset = [], 0
        for [old] in layout.members:
            views.append(buffer[offset:offset + old.numel()].view(old.shape))
            offset += old.numel()
        layout.members = [[v] for v in views]
        return layout

    # ---- error feedback by parameter: what outlives DDP's buckets ------------------------------
    def _keep_residuals(self):
        """Each bucket residual, cut into its parameters' pieces (by name): a new layout (DDP's
        rebuild, a restart) takes up its parameters' residuals from here."""
        if self.memory is None:
            return
        for layout in self._layouts.values():
            residual = self.memory.residuals.get(layout.buckets[0].name)
            if residual is not None and len(layout.buckets) == 1:
                for name, piece in zip(layout.names, residual.split(layout.numels)):
                    self._by_parameter[name] = piece

    def _take_residual(self, layout):
        """A new bucket's residual from its parameters' pieces, where every one is known (and
        named by the model: DDP's positions are not stable across layouts)."""
        name = layout.buckets[0].name
        if self.memory is None or name in self.memory.residuals:
            return
        pieces = [self._by_parameter.get(n) for n in layout.names]
        if all(p is not None and p.numel() == k for p, k in zip(pieces, layout.numels)) and \
                all(not n.startswith("ddp.") for n in layout.names):
            self.memory.residuals[name] = torch.cat(pieces).to(layout.members[0][0].device)

    def _check_ranks_agree(self, key):
        if self.engine.size() == 1:
            return
        mine = {"scheme": self.describe(), "error_feedback": self.memory is not None,
                "bucket": key[0], "numel": key[1], "dtype": key[2]}
        every = self.engine.allgather_object(mine, "hvdc.ddp.layout")
        for rank, other in enumerate(every):
            if other != every[0]:
                diff = "; ".join(f"{k}: rank 0 has {every[0][k]!r}, rank {rank} has {other[k]!r}"
                                 for k in mine if other[k] != every[0][k])
                raise RuntimeError(f"hvd_compress.ddp: ranks disagree ({diff})")

    # ---- checkpoints and counters -----------------------------------------------------------
    def state_dict(self):
        """This rank's compression state: error-feedback residuals, the communicator's own
        (PowerSGD's Q and residuals, top-k's residuals, auto's plan). Differs by rank: save one
        per rank."""
        self._keep_residuals()
        state = {"scheme": self.describe(), "steps": self.steps,
                 "residuals": {k: v.clone() for k, v in self._by_parameter.items()},
                 "bucket_residuals": self.memory.state_dict() if self.memory is not None else {}}
        own = self.communicator.state_dict()
        if own is not None:
            state["communicator"] = own
        return state

    def load_state_dict(self, state, plan=True):
        """Restore a state_dict() of this rank. plan=False leaves auto's plan out: the ranks
        changed (torchrun restarted the job), so auto measures and plans again, as Horovod's
        elastic reset does; residuals, PowerSGD's Q and top-k's state are restored all the
        same (they belong to the checkpoint's model)."""
        if state.get("scheme") != self.describe():
            raise ValueError(f"this checkpoint's hook state is for {state.get('scheme')!r}, "
                             f"not {self.describe()!r}")
        if self.memory is not None:
            self._by_parameter = {k: v.clone() for k, v in state["residuals"].items()}
            # the same buckets take their own residuals; others, their parameters' pieces
            self.memory.load_state_dict(state.get("bucket_residuals", {}))
            for layout in self._layouts.values():
                self._take_residual(layout)
        own = state.get("communicator")
        if own is not None and not (plan is False and isinstance(self.communicator,
                                                                 AutoCommunicator)):
            if isinstance(self.communicator, AutoCommunicator):
                # auto's plan is for DDP's buckets, which the hook learns in the first step
                # after a restart: taken up at the end of the first step whose buckets fit it
                self._restored = own
                if self._layouts:
                    self.communicator.load_state_dict(own)
                    if self.communicator.state_dict() is not None:
                        self._restored = None
            else:
                self.communicator.load_state_dict(own)
        self.steps = int(state.get("steps", 0))

    def reset_state(self):
        """Forget residuals and per-tensor state (torchrun's elastic restart: the ranks changed)."""
        if self.memory is not None:
            self.memory.load_state_dict({})
        self._by_parameter = {}
        self.communicator.reset_state()

    def pop_stats(self):
        return self.communicator.pop_stats()

    def plan_report(self):
        report = getattr(self.communicator, "plan_report", None)
        return report() if report is not None else None


class FlatBucket:
    """A bucket that does not come from DDP, as the hook reads one (buffer, index, is_last,
    parameters): the same flat buffer through the hook and through Horovod's communicator
    (tests), or on a device with no model (scripts/check_cuda.py)."""

    def __init__(self, buffer, index=0, last=True, shapes=None):
        self._buffer, self._index, self._last = buffer, index, last
        shapes = shapes or [tuple(buffer.shape)]
        self._params = [torch.empty(s, device="meta") for s in shapes]

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params


def _tensorwise(comm):
    return not comm.fuses and getattr(comm, "own_memory", False)


def hook(state, bucket):
    """DDP communication hook: `model.register_comm_hook(HookState(...), hook)`."""
    return state.exchange(bucket)


def register(model, compression="bit8", route=None, **options):
    """Register the hook on a DDP `model`; the HookState (keep it for checkpoints, stats)."""
    state = HookState(compression, route, process_group=getattr(model, "process_group", None),
                      model=model, **options)
    model.register_comm_hook(state, hook)
    return state
