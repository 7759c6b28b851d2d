"""The contract between the layers, declared: what a compressor, a memory and a communicator
provide, and what the optimizer may ask of them. GRACE states three roles; so do we.

    Memory          compensate(name, x) before compressing; remember(name, x, kept) after
    Compressor      Horovod's two static methods: compress(t) -> (c, ctx), decompress(c, ctx)
    PacketCompressor  codes allreduce cannot sum: six methods (below), the rest derived
    Communicator    start(bucket) launches a collective; advance(exchanges) launches later
                    phases; finish(exchange) leaves the reduced values in the bucket; it
                    declares what it can do (Capabilities), counts what it does in its Stats
                    (pop_stats), and hears the step's boundary (end_step)

One step serves every route: compensate -> compress -> remember -> collective -> decompress.
Which Communicator carries a scheme is decided in one place, `exchange.routes.make_communicator`,
from the scheme's entry in registry.py (a method such as top-k declares its own communicator).
docs/extending.md walks through writing one; docs/architecture.md shows where each layer sits.
"""
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

try:                                 # Horovod's own classes where Horovod is installed, so that
    from horovod.torch.compression import Compressor, FP16Compressor, NoneCompressor
except ModuleNotFoundError as missing:   # hvd.Compression.fp16 is Compression.fp16
    if missing.name not in ("horovod", "horovod.torch", "horovod.torch.compression"):
        raise

    class Compressor:
        """Horovod's two-method interface, for a job without Horovod (hvd_compress.ddp)."""

        @staticmethod
        def compress(tensor):
            raise NotImplementedError

        @staticmethod
        def decompress(tensor, ctx):
            raise NotImplementedError

    class NoneCompressor(Compressor):
        """No compression: the tensor as it is (Horovod's Compression.none)."""

        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class FP16Compressor(Compressor):
        """Floating-point tensors cast to float16 and back (Horovod's Compression.fp16)."""

        @staticmethod
        def compress(tensor):
            return (tensor.type(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

        @staticmethod
        def decompress(tensor, ctx):
            return tensor.type(ctx) if ctx.is_floating_point else tensor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "PacketCompressor", "Memory",
           "Capabilities", "Communicator", "Stats", "flat_float32", "pad4", "rounding_stream", "current_stream"]

_STREAM = threading.local()


@contextmanager
def rounding_stream(key):
    """Name what is being encoded (a bucket and its phase) for a stochastic codec, which then
    draws from a random stream of its own per name. Without it, results would depend on the
    order of the encodes, and the two-phase route re-encodes buckets in the order their first
    phases complete, which timing decides. Communicators set it; codecs read current_stream()."""
    previous = getattr(_STREAM, "key", None)
    _STREAM.key = key
    try:
        yield
    finally:
        _STREAM.key = previous


def current_stream():
    """The name rounding_stream set in this thread, or None outside one."""
    return getattr(_STREAM, "key", None)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class PacketCompressor(Compressor):
    """Codes that allreduce cannot sum (a sum of float8 codes is meaningless): every rank
    decodes every rank's codes and reduces in float32. All methods are classmethods.

    Must provide (blockcodec.BlockCodec provides all six for a codec of blocks of values):
      compress(tensor) -> (packet, ctx)      per tensor, Horovod's interface: a self-describing
                                             1-D uint8 packet; ctx restores shape and dtype
      decode_packet(packet, out=None)        -> the packet's values, flat float32
      packet_bytes(numel) -> int             a packet's size
      message_bytes(numel, block) -> int     per bucket (the optimizer's path): a message's
                                             size, a multiple of 4 bytes
      encode_message(flat, message, block)   contiguous float32 -> `message` (uint8), one pass
      decode_messages(messages, numel, out, block, divisor=1)
                                             rows = ranks' messages, in rank order: their sum
                                             in float32 / divisor, into `out` (overwritten);
                                             a message too short or corrupt raises ValueError
    block: values per scale (None: one scale for the whole message). Derived from these six
    (override for speed): decompress, decode_message, chunks_bytes, encode_chunks,
    decode_chunks (a bucket cut into chunks, one message each, back to back) and
    reduce_encode (the two-phase route's middle).
    """
    name = None          # the scheme's name (registry.SCHEMES)
    bits = None          # bits per value on the wire

    @classmethod
    def compress(cls, tensor):
        raise NotImplementedError

    @classmethod
    def decode_packet(cls, packet, out=None):
        raise NotImplementedError

    @classmethod
    def packet_bytes(cls, numel):
        raise NotImplementedError

    @classmethod
    def message_bytes(cls, numel, block):
        raise NotImplementedError

    @classmethod
    def encode_message(cls, flat, message, block):
        raise NotImplementedError

    @classmethod
    def decode_messages(cls, messages, numel, out, block, divisor=1):
        raise NotImplementedError

    # ---- derived --------------------------------------------------------------------------
    @classmethod
    def decompress(cls, packet, ctx):
        """Decode a packet back to a tensor of the original shape and dtype (ctx), checking
        that the packet holds as many values as the tensor."""
        shape, dtype = ctx
        values = cls.decode_packet(packet)
        if values.numel() != shape.numel():
            raise ValueError(f"corrupt packet: {values.numel()} values for a tensor of shape "
                             f"{tuple(shape)} ({shape.numel()} values)")
        return values.view(shape).to(dtype)

    @classmethod
    def decode_message(cls, message, numel, out, block):
        """Decode one message into float32 `out` (numel values)."""
        return cls.decode_messages(message.view(1, -1), numel, out, block)

    @classmethod
    def chunk_messages(cls, bounds, block):
        """(a, b, offset, size) of each chunk [a, b) of `bounds` and its message."""
        offset = 0
        for a, b in zip(bounds, bounds[1:]):
            size = cls.message_bytes(b - a, block or max(b - a, 1))
            yield a, b, offset, size
            offset += size

    @classmethod
    def chunks_bytes(cls, bounds, block):
        """Bytes of the messages of chunks [bounds[k], bounds[k+1]) (block None: one scale
        per chunk)."""
        return sum(size for *_, size in cls.chunk_messages(bounds, block))

    @classmethod
    def encode_chunks(cls, flat, message, bounds, block):
        """Encode chunk k = flat[bounds[k]:bounds[k+1]] into the k-th message of `message`."""
        for a, b, offset, size in cls.chunk_messages(bounds, block):
            cls.encode_message(flat[a:b], message[offset:offset + size], block or max(b - a, 1))
        return message

    @classmethod
    def decode_chunks(cls, message, bounds, out, block):
        """The inverse of encode_chunks: chunk k's values into out[bounds[k]:bounds[k+1]]."""
        for a, b, offset, size in cls.chunk_messages(bounds, block):
            cls.decode_message(message[offset:offset + size], b - a, out[a:b], block or max(b - a, 1))
        return out

    @classmethod
    def reduce_encode(cls, messages, numel, message, block, divisor=1):
        """n ranks' messages of one chunk (rows) decoded, summed in rank order, divided by
        `divisor` and encoded again into `message`: the two-phase route's middle."""
        block = block or max(numel, 1)
        total = torch.empty(numel, dtype=torch.float32, device=messages.device)
        cls.decode_messages(messages, numel, total, block, divisor)
        return cls.encode_message(total, message, block)


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in logical (row-major) order as contiguous float32, no copy if possible."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError("sparse tensors cannot be compressed to 8/16-bit codes; "
                        "densify them (sparse_as_dense) or exchange them uncompressed")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"8/16-bit gradient compression needs a floating-point tensor, "
                        f"got {tensor.dtype}")
    return tensor.detach().reshape(-1).to(torch.float32).contiguous()


def pad4(nbytes: int) -> int:
    return (nbytes + 3) & ~3


class Memory:
    """Error feedback's state (exchange/memory.py): what compression dropped, per bucket name
    while it runs, per parameter name in a checkpoint. A front says which parameters a bucket
    holds (bind), so that a residual follows its parameters when the buckets change."""

    def compensate(self, name, x, inplace=False):
        """x plus what the previous step dropped (x itself when there is nothing);
        inplace=True adds into x (a bucket's own float32 buffer)."""
        raise NotImplementedError

    def remember(self, name, compensated, kept):
        """Store compensated - kept: exactly what this step's codes dropped."""
        raise NotImplementedError

    def bind(self, name, names, numels, device=None):
        """Bucket `name` holds the parameters `names` (of `numels` values), in this order, from
        now on."""
        raise NotImplementedError

    def state_dict(self):
        """The residuals by parameter name (by name as given, where no bucket is bound)."""
        raise NotImplementedError

    def load_state_dict(self, state):
        raise NotImplementedError


class Stats:
    """What a communicator (and the optimizer driving it) spent since the last pop, each
    counter named for the one thing it measures:

      copy_s          gradients copied into their bucket's flat buffer, and reduced values
                      copied out to a .grad that is not a view of the bucket (the optimizer)
      compress_s      encoding: error feedback's compensate and remember, the codec's encode
      communicate_s   waiting for collectives (step() and the two-phase route's polls)
      decompress_s    decoding and summing the ranks' codes (the two-phase route's middle,
                      decode-sum-re-encode of a chunk in one native call, counts here)
      bytes_sent      bytes this rank sent
      overlap_s       per bucket, how long its collective was in flight before step() began
      in_backward_s   the part of the above done inside backward's gradient hooks
      exchange_s      each step's exchange, first launch to last reduced gradient
      launch_span_s   first launch to last launch (backward's pace)
    """
    FIELDS = ("copy_s", "compress_s", "communicate_s", "decompress_s", "bytes_sent", "overlap_s",
              "in_backward_s", "exchange_s", "launch_span_s")

    def __init__(self):
        self.reset()

    def reset(self):
        self._values = {f: 0.0 for f in self.FIELDS}
        self._values["bytes_sent"] = 0

    def add(self, field, amount):
        """Count `amount` (seconds, or bytes for bytes_sent) into `field`, one of FIELDS."""
        if field not in self._values:
            raise KeyError(f"Stats has no counter {field!r}; its counters: {', '.join(self.FIELDS)}")
        self._values[field] += amount

    @contextmanager
    def timing(self, field):
        """Add the time the block takes to `field`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(field, time.perf_counter() - start)

    def peek(self):
        """The counters so far, without resetting them."""
        return dict(self._values)

    def pop(self):
        """The counters since the last pop; they start again from zero."""
        out = dict(self._values)
        self.reset()
        return out


@dataclass(frozen=True)
class Capabilities:
    """What a communicator can do, declared by its class, so that a front (front/) decides from
    this record and never from the communicator's type or attributes:

      fuses          its buckets are flat float32 buffers holding several gradients (False:
                     one tensor per bucket, bound as it is)
      takes_memory   start(bucket, memory) takes the front's Memory (error feedback)
      own_memory     it keeps error feedback of its own (top-k, PowerSGD)
      per_tensor     it exchanges each gradient on its own: a front that is handed several
                     gradients at once (a DDP bucket) gives it one bucket per parameter
      one_phase      an exchange is one collective, then finish(): it may be finished in the
                     collective's completion callback (no collective is launched there)
      groups         start_group(buckets) starts several per-tensor buckets as one exchange
                     (PowerSGD: a DDP bucket in three allreduces)
      plans_buckets  it chooses a route per bucket (Compression.auto): a front that cuts its
                     own buckets tells it which (use_bucket, use_buckets), and its state (a
                     plan) is for those buckets
    """
    fuses: bool = False
    takes_memory: bool = False
    own_memory: bool = False
    per_tensor: bool = False
    one_phase: bool = False
    groups: bool = False
    plans_buckets: bool = False


class Communicator:
    """Carries buckets over one collective route (registry.Route) and counts what it does.

    Declared, for the fronts to read (never inferred from what attributes exist):
      route                  registry.Route (None: it chooses per bucket, Compression.auto)
      capabilities           what it can do (Capabilities)
      fusion_threshold_bytes, scale_block   its bucket size and values per scale
      stats                  its Stats; the front adds its own counters to it (copy_s,
                             in_backward_s, overlap_s, exchange_s, launch_span_s)
    Every method below that does not raise NotImplementedError has a default that a fixed
    route needs no more of, so a front calls it without asking; Compression.auto's
    communicator overrides them.
    """
    route = None
    capabilities = Capabilities()
    fusion_threshold_bytes = 0
    scale_block = None

    @property
    def stats(self) -> Stats:
        """This communicator's counters (made on first use)."""
        if "_stats" not in self.__dict__:
            self.__dict__["_stats"] = Stats()
        return self.__dict__["_stats"]

    @stats.setter
    def stats(self, value: Stats):
        self.__dict__["_stats"] = value          # Compression.auto shares one set

    def describe(self) -> str:
        """A short name of what carries the buckets, e.g. 'bit8/allgather' (collective names,
        the ranks' agreement check)."""
        return self.route.value if self.route is not None else type(self).__name__

    def plan(self, names, tensors, prefix=""):
        """[(member indices, fusion.Bucket)] for these tensors, in the order given."""
        raise NotImplementedError

    def start(self, bucket, memory=None):
        """Compress the bucket (with error feedback if `memory`) and launch its collective;
        return an exchange handle. Called from a gradient hook, so it must not block."""
        raise NotImplementedError

    def start_group(self, buckets, memory=None):
        """Several per-tensor buckets as one exchange (capabilities.groups)."""
        raise NotImplementedError

    def progress(self, exchange, wait=False):
        """Launch the exchange's next phase if its current one is done (wait=True: once it
        is, which an engine that pairs collectives by order needs); never blocks otherwise."""

    def advance(self, exchanges):
        """Before the finishes: launch each exchange's later phase the moment its earlier one
        completes, in completion order (multi-phase routes; one-phase ones have nothing to do)."""

    def finish(self, exchange):
        """Wait for the exchange and write the reduced values into its bucket."""
        raise NotImplementedError

    def drop(self, exchange):
        """Wait for an abandoned exchange; its result and its own error are dropped (the
        front raises the error that made it abandon the step)."""
        raise NotImplementedError

    def use_bucket(self, index, bucket):
        """A front that cuts its own buckets (a DDP bucket) puts bucket `index` in place before
        its first start() (capabilities.plans_buckets; nothing otherwise)."""

    def use_buckets(self, buckets):
        """The front's buckets, in launch order, after a step in which they changed
        (capabilities.plans_buckets: it plans again for them; nothing otherwise)."""

    def prioritise(self, buckets):
        """schedule="overlap": `buckets` in launch order; what the next forward needs first may
        be sent first (the packet routes cut a large late bucket into chunks). Nothing by
        default."""

    def record_apply(self, index, needed_at, took):
        """schedule="overlap": bucket `index` was applied when the next forward needed it
        (Compression.auto times the forward's pace from it). Nothing by default."""

    def close(self):
        """Release what runs beside the exchange (a sender's thread); nothing by default."""

    def pop_stats(self):
        """The Stats counters since the last call (a dict; Stats says what each measures),
        plus whatever else the communicator reports (codec_path, auto's plan columns)."""
        return self.stats.pop()

    def plan_report(self):
        """How the buckets' schemes were chosen (Compression.auto), JSON-able; None for a
        fixed scheme."""
        return None

    def pause_step_clock(self):
        """The job did other work since the last step (an evaluation, a checkpoint): leave the
        next step's time out of what is measured. Nothing for a fixed scheme."""

    def end_step(self, backward_start, backward_end):
        """After every step's exchange, on every rank at the same step count: a step boundary
        (Compression.auto measures and plans here). Times from time.perf_counter(): the step's
        first gradient hook (None if none fired) and the start of synchronize()."""

    def state_dict(self):
        """State a checkpoint must keep (this rank's), or None when there is none."""
        return None

    def load_state_dict(self, state):
        """Restore what state_dict() returned."""

    def reset_state(self):
        """Forget the state (elastic training, when the ranks change)."""
