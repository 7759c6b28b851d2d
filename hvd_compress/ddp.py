"""hvd_compress on PyTorch DDP: a communication hook that carries DDP's gradient buckets by any
registered scheme and route, top-k, PowerSGD or Compression.auto, over torch.distributed
(Gloo on CPU, NCCL on CUDA), with the same codecs, routes, error feedback and planner as the
Horovod optimizer (docs/ddp.md).

    import hvd_compress.ddp as hcd
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = hcd.register(model, "bit8", route="alltoall")
    ...
    torch.save({"model": model.state_dict(), "hook": state.compression_state_dict()}, path)
    state.load_compression_state_dict(checkpoint["hook"])

The DDP front: this module keeps DDP's life cycle; what every front shares is its FrontCore
(front/core.py). How a step goes, and why:
- DDP calls the hook once per bucket, in bucket order, while backward still runs; the hook
  fills the plugin's bucket, compresses it and launches its collective at once.
- A one-phase exchange (capabilities.one_phase) is decoded in its collective's callback, as
  DDP's own hooks do; the last bucket's hook (GradBucket.is_last()) moves every other on and
  finishes them in bucket order on the main thread. Every collective is launched from the
  main thread in the same order on every rank, which is how torch.distributed matches them.
- Bit for bit: `none` equals DDP's default allreduce and `fp16` fp16_compress_hook (the engine
  averages as DDP does: divide, then sum); the packet routes decode and sum in rank order
  with the plugin's codecs, so bit8 on DDP equals bit8 on Horovod for the same buckets.
- A flat bucket keeps its parameters in the order the hook first met them (canonical order),
  whatever order DDP hands them in: after its first step DDP rebuilds its buckets, and with
  one bucket it only reorders the parameters inside it. So a resumed job, whose first step
  has DDP's first order again, carries the same bucket as the job that never stopped, and
  error feedback's residuals, bound to the parameters by name (exchange/memory.py), follow
  them through any rebuild that changes the buckets' members. Per-tensor state (top-k's,
  PowerSGD's) is keyed by the parameter's name.
- The first time a bucket layout is seen, the ranks agree through the engine: first that
  every rank reached the hook within `agree_timeout_s` (a rank that registered no hook is
  named, instead of waited for), then on scheme, route and the bucket's size and dtype.
- On Gloo over a slow link, large gathers go in pieces (gather_pieces: decided after the
  first steps from how fast the whole ones ran; why: engine/distributed.py).
"""
import warnings

import torch

from .codecs import SCALE_BLOCK
from .engine.base import AVERAGE
from .engine.distributed import TorchEngine
from .front.core import AGREE_TIMEOUT_S, FrontAPI, FrontCore, resolve_compression

__all__ = ["HookState", "FlatBucket", "hook", "register", "resolve_compression"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# gather_pieces=None: after this many steps, Gloo's large gathers go in pieces if rank 0's large
# collectives (any: auto's first steps allreduce float32) sent fewer bits a second than this
# (engine sent_times: its bytes sent over launch to done); docs/ddp.md has the measurements.
PIECES_DECIDED_AT = 3
PIECES_BELOW_BITS_PER_S = 200e6


class _Layout:
    """One DDP bucket as the hook carries it: its key (index, size, dtype, its parameters in
    DDP's order), the plugin's buckets, and its members in canonical order: their names and
    (offset in DDP's buffer, numel, shape). kind: "whole" (one bucket binds DDP's buffer
    itself: the allreduce route), "flat" (one flat float32 bucket of the members, copied
    whole where `same_order`, canonical order being DDP's) or "tensors" (a bucket each)."""

    def __init__(self, key, kind, names, places, same_order):
        self.key, self.kind, self.names, self.places = key, kind, names, places
        self.same_order, self.buckets = same_order, []
        self.numels = [k for _, k, _ in places]
        self._views = (None, [])

    def views(self, buffer):
        """The members' views of DDP's buffer, in the layout's order (made again only when DDP
        hands a buffer of other memory)."""
        if self._views[0] != buffer.data_ptr():
            self._views = (buffer.data_ptr(), [buffer[a:a + k].view(shape)
                                               for a, k, shape in self.places])
        return self._views[1]


class HookState(FrontAPI):
    """The hook's state: its FrontCore (scheme and route over a TorchEngine, error feedback,
    the checkpoint), the layouts of DDP's buckets it has met, the exchanges of the step.

    compression: a name ('none', 'fp16', 'bit16', 'bf16', 'bit8', 'int8', 'onebit', 'topk',
        'powersgd', 'auto') or a Compression value (Compression.topk(0.001), .auto(plan=...)).
    route: None (the scheme's default) or where the scheme has it (registry.SCHEMES).
    process_group: DDP's (None: the default group).
    error_feedback: carry each rank's quantisation error to the next step (packet schemes);
        None: the scheme's default (on for onebit; top-k and PowerSGD keep their own).
    model: the DDP model (or its module), to name per-parameter state by parameter name (a
        checkpoint's keys); without it a parameter is named ddp.<bucket>.<position> where the
        hook first met it.
    decode_in_callback: a one-phase exchange is decoded in its collective's callback (True,
        DDP's way) or on the main thread at the last bucket, with the others (False).
    gather_pieces: Gloo's large allgathers and alltoalls in pieces (True), whole (False), or
        None: whole for the first PIECES_DECIDED_AT steps, then in pieces where rank 0's large
        collectives sent below PIECES_BELOW_BITS_PER_S (a slow link), alike on every rank.
    agree_timeout_s: how long the first exchange of a layout waits for every rank's hook.
    """

    def __init__(self, compression="bit8", route=None, process_group=None, error_feedback=None,
                 scale_block=SCALE_BLOCK, model=None, decode_in_callback=True,
                 gather_pieces=None, agree_timeout_s=AGREE_TIMEOUT_S):
        self.core = FrontCore("hvd_compress.ddp", compression, route, AVERAGE, 0, scale_block,
                              error_feedback, engine=TorchEngine(process_group))
        self.compression, self.engine = self.core.compression, self.core.engine
        self.decode_in_callback = bool(decode_in_callback)
        self.gather_pieces, self.agree_timeout_s = gather_pieces, float(agree_timeout_s)
        if gather_pieces is not None:
            self.engine.in_pieces, self.engine.timed = bool(gather_pieces), False
        module = getattr(model, "module", model)
        self._names = {} if model is None else {id(p): n for n, p in module.named_parameters()}
        self._met = {}                     # id(parameter) -> (it, canonical rank, name)
        self._layouts = {}                 # DDP bucket index -> _Layout in use
        self._checked = set()              # bucket layouts the ranks agreed on
        self._pending = []                 # (layout, exchanges, future, buffer) this step
        self._changed = False              # a bucket's layout changed in this step
        self._last_index = None

    # ---- what the hook does -----------------------------------------------------------------
    def exchange(self, grad_bucket):
        """Start this bucket's exchange; a future DDP waits on (completed with the buffer)."""
        buffer = grad_bucket.buffer()
        core, can = self.core, self.core.capabilities
        try:
            core.hooked()
            layout = self._layout(grad_bucket, buffer)
            with core.communicator.stats.timing("copy_s"):
                self._fill(layout, buffer)
            if can.groups:                     # PowerSGD: a DDP bucket in three allreduces
                exchanges = [core.start_group(layout.buckets)]
            else:
                exchanges = [core.start(bucket) for bucket in layout.buckets]
            if self.decode_in_callback and can.one_phase:
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

    def _fill(self, layout, buffer):
        """DDP's buffer into the plugin's buckets: bound as it is (whole), copied whole (the
        same order), or member by member in canonical order."""
        if layout.kind == "whole":
            layout.buckets[0].put(0, buffer)
        elif layout.kind == "tensors":
            for bucket, view in zip(layout.buckets, layout.views(buffer)):
                bucket.put(0, view)
        elif layout.same_order:
            layout.buckets[0].buffer.copy_(buffer)
        else:
            layout.buckets[0].put_all(list(enumerate(layout.views(buffer))))

    def _finish(self, layout, exchanges, buffer):
        """Write one DDP bucket's reduced values into its buffer; the buffer."""
        for ex in exchanges:
            self.core.finish(ex)
        bucket = layout.buckets[0]
        if layout.kind == "whole":
            self.core.copy_out(bucket, [buffer])
        elif layout.kind == "tensors":
            for bucket, view in zip(layout.buckets, layout.views(buffer)):
                self.core.copy_out(bucket, [view])
        elif layout.same_order:
            with self.core.communicator.stats.timing("copy_s"):
                buffer.copy_(bucket.buffer)
        else:
            self.core.copy_out(bucket, layout.views(buffer))
        return buffer

    def _finish_step(self):
        core = self.core
        exchanges = [ex for _, group, _, _ in self._pending for ex in group]
        core.backward_ended(exchanges)
        core.advance(exchanges)
        for layout, group, future, buffer in self._pending:
            future.set_result(self._finish(layout, group, buffer))
        self._pending = []
        if self.gather_pieces is None and core.steps + 1 == PIECES_DECIDED_AT:
            self._decide_pieces()
        if self._changed:
            self._settle_layouts(self._last_index)
        core.end_step(core.next_step())

    def _decide_pieces(self):
        """Gloo's large gathers in pieces from now on if rank 0's large collectives were slow
        (a slow link), said by rank 0 so that every rank cuts alike (gather_pieces=None)."""
        self.engine.decide_pieces(PIECES_BELOW_BITS_PER_S)

    def _settle_layouts(self, last):
        """After a step in which DDP's buckets changed: forget layouts past the last bucket,
        tell the communicator the buckets (auto plans again; a restored plan is taken up)."""
        self._changed = False
        for index in [i for i in self._layouts if i > last]:
            del self._layouts[index]
        self.core.use_buckets([self._layouts[i].buckets[0] for i in sorted(self._layouts)])

    def _fail(self, err):
        """Complete DDP's futures with the error (no hang) and forget the step."""
        for _, _, future, _ in self._pending:
            if not future.done():
                future.set_exception(err)
        self._pending = []
        self.core.next_step()

    # ---- buckets ----------------------------------------------------------------------------
    def _layout(self, grad_bucket, buffer):
        index = grad_bucket.index()
        if buffer.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.describe()} carries floating-point gradients; DDP bucket "
                             f"{index} holds {buffer.dtype}")
        if buffer.is_sparse or not buffer.is_contiguous():
            raise ValueError(f"DDP bucket {index} is not a dense contiguous buffer; the hook "
                             "carries DDP's flat buckets only")
        params = grad_bucket.parameters()
        key = (index, buffer.numel(), str(buffer.dtype), tuple(id(p) for p in params))
        agreed = (index, buffer.numel(), str(buffer.dtype), tuple(tuple(p.shape) for p in params))
        if agreed not in self._checked:
            self.core.agree(dict(self.core.setup(), bucket=index, numel=key[1], dtype=key[2]),
                            f"DDP bucket {index}", self.agree_timeout_s)
            self._checked.add(agreed)
        layout = self._layouts.get(index)
        if layout is None or layout.key != key:
            layout = self._layouts[index] = self._make_layout(key, params, buffer)
            self._changed = True
        return layout

    def _make_layout(self, key, params, buffer):
        """The plugin's buckets for a DDP bucket, bound to their parameters by name: a flat one
        in canonical order (the codecs' blocks must not change when DDP reorders them), or one
        each in DDP's order (their state is by name; DDP's PowerSGD hook draws in that order)."""
        index, numel, _, _ = key
        offsets = [0]
        for p in params[:-1]:
            offsets.append(offsets[-1] + p.numel())
        met = [self._meet(p, index, j) for j, p in enumerate(params)]
        can, core = self.core.capabilities, self.core
        kind = "tensors" if can.per_tensor else "flat" if can.fuses else "whole"
        order = list(range(len(params)))
        if kind == "flat":
            order.sort(key=lambda j: met[j][1])
        names = [met[j][2] for j in order]
        places = [(offsets[j], params[j].numel(), tuple(params[j].shape)) for j in order]
        layout = _Layout(key, kind, names, places, order == list(range(len(params))))
        views, name = layout.views(buffer), f"ddp.{index}.{numel}"
        if kind == "tensors":                  # top-k, PowerSGD: tensor by tensor
            layout.buckets = [core.bucket(n, [n], [v]) for n, v in zip(names, views)]
        else:
            layout.buckets = [core.bucket(name, names, views) if kind == "flat" else
                              core.bucket(name, [name], [buffer])]
        core.use_bucket(index, layout.buckets[0])
        return layout

    def _meet(self, p, index, j):
        """(p, its canonical rank, its name): the order and the name the hook first met it by
        (kept with a reference to it, so that its id is never another parameter's)."""
        if id(p) not in self._met:
            name = self._names.get(id(p), f"ddp.{index}.{j}")
            self._met[id(p)] = (p, len(self._met), name)
        return self._met[id(p)]

    # ---- deprecated names (the one checkpoint format is FrontAPI's) --------------------------
    def state_dict(self):
        """Deprecated: compression_state_dict()."""
        _deprecated("state_dict", "compression_state_dict")
        return self.compression_state_dict()

    def load_state_dict(self, state, plan=True):
        """Deprecated: load_compression_state_dict()."""
        _deprecated("load_state_dict", "load_compression_state_dict")
        self.load_compression_state_dict(state, plan)

    def reset_state(self):
        """Deprecated: reset_compression_state()."""
        _deprecated("reset_state", "reset_compression_state")
        self.reset_compression_state()

    def _forget_step(self):
        self._fail(RuntimeError("hvd_compress.ddp: the compression state was reset"))

    def pop_stats(self):
        return self.core.pop_stats()


def _deprecated(old, new):
    warnings.warn(f"HookState.{old}() is deprecated: call {new}() (the name every front uses)",
                  DeprecationWarning, stacklevel=3)


class FlatBucket:
    """A bucket that does not come from DDP, as the hook reads one (buffer, index, is_last,
    parameters): the same flat buffer through the hook and through Horovod's communicator
    (tests), or on a device with no model (scripts/check_cuda.py). Its parameters are the same
    objects for the same index and shapes, as DDP's are from step to step."""
    _PARAMS = {}

    def __init__(self, buffer, index=0, last=True, shapes=None):
        self._buffer, self._index, self._last = buffer, index, last
        shapes = tuple(tuple(s) for s in (shapes or [tuple(buffer.shape)]))
        self._params = self._PARAMS.setdefault(
            (index, shapes), [torch.empty(s, device="meta") for s in shapes])

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params


def hook(state, bucket):
    """DDP communication hook: `model.register_comm_hook(HookState(...), hook)`."""
    return state.exchange(bucket)


def register(model, compression="bit8", route=None, **options):
    """Register the hook on a DDP `model`; the HookState (keep it for checkpoints, stats)."""
    state = HookState(compression, route, process_group=getattr(model, "process_group", None),
                      model=model, **options)
    model.register_comm_hook(state, hook)
    return state
