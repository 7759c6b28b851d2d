"""One vocabulary: the routes gradients travel by and the compression schemes, by name.

A scheme registers here, in one place (its compression, name, bits, routes, the lab's flag,
the bytes of its codes), and the optimizer, the communicators, the cost model, the lab's flags
and table and the report all read it (docs/extending.md adds one). The plugin, the benchmarks,
the cost model, the lab and the report all spell a configuration with these names, so a row
of a benchmark CSV, a run folder and a line of the report can be matched by string. No torch or Horovod here: the cost model and the report import it too.

    route      how a scheme's codes travel           bytes sent per rank (g: fp32 bytes)
    allreduce  Horovod's ring allreduce              2(n-1)/n * g * bits/32
    allgather  every rank's codes to every rank      (n-1) * g * bits/32
    alltoall   two-phase: alltoall of chunks,        2(n-1)/n * g * bits/32
               reduce in float32, allgather

`op` (hvd.Average / hvd.Sum) is the reduction; a route is only how the bytes move.
"""
import importlib
import math
import os
from dataclasses import dataclass
from enum import Enum
from typing import Callable

__all__ = ["Route", "Scheme", "SCHEMES", "COURSE_SCHEMES", "HEADER_BYTES", "register",
           "load_plugins", "schemes", "other_schemes", "scheme", "resolve_route", "label", "parse_label",
           "run_name"]

# A per-tensor packet (Bit8Compressor / Bit16Compressor, the course route) starts with 8 bytes:
# float32 power-of-two scale, uint32 flags. Defined here, torch-free, for the cost model too.
HEADER_BYTES = 8


class Route(str, Enum):
    """How compressed gradients travel. A str, so `Route.ALLGATHER == "allgather"`."""
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"          # the two-phase route: alltoall, reduce, allgather

    def __str__(self):
        return self.value

    @classmethod
    def parse(cls, value):
        """A Route from a Route or its name; a clear error for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"route must be one of {[r.value for r in cls]}, got {value!r}") from None


def _one_byte(numel):
    return numel


def _two_bytes(numel):
    return 2 * numel


def _sign_bits(numel):
    return -(-numel // 8)


def topk_count(numel, ratio) -> int:
    """Values top-k sends of a tensor of `numel`: ceil(ratio numel), at least 1, at most all."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


def powersgd_values(shape, rank) -> int:
    """Values PowerSGD allreduces for one gradient: (rows + cols) r for a matrix (first
    dimension x the rest, r = min(rank, rows, cols)), every value of a vector."""
    count = math.prod(shape)
    if len(shape) < 2:
        return count
    rows = shape[0]
    cols = count // rows if rows else 0
    return (rows + cols) * min(rank, rows, cols)


def topk_step_bytes(shapes, n, ratio) -> int:
    """Bytes one rank sends per step by top-k: (n-1) x 8k per tensor (int32 index + float32
    value, allgathered)."""
    return sum((n - 1) * 8 * topk_count(math.prod(s), ratio) for s in shapes) if n > 1 else 0


def powersgd_step_bytes(shapes, n, rank) -> int:
    """Bytes one rank sends per step by PowerSGD: 2(n-1)/n of each allreduced float32 value."""
    return sum(2 * (n - 1) * 4 * powersgd_values(s, rank) // n for s in shapes) if n > 1 else 0


@dataclass(frozen=True)
class Scheme:
    """A compression scheme, everything the plugin, the cost model and the lab need of it.

    name         its one name: Compression.<name>, run names, CSV rows, the report
    bits         bits per value on the wire (before block scales)
    routes       the routes it can take, its default first
    summary      one line for tables and --help
    compressor   the compression: an object, or 'module:attribute' (imported when asked)
    flag         the lab's flag that picks it (labs/mnist.py), None for none
    code_bytes   packet schemes: bytes of the codes of numel values (message_bytes adds the
                 block scales and padding); None: a scheme of its own collective
    block_scales a float32 scale per block in front of the codes (packet schemes)
    parameter    the method's default parameter (top-k's ratio, PowerSGD's rank), else None
    step_bytes   methods with a collective of their own: (shapes, n, parameter) -> bytes one
                 rank sends per step (the cost model's; the communicator's count must equal it)
    course       in the course's table of runs (none, fp16, bit16, bit8)
    carries_values  a codec of a bucket of values that every rank decodes to float32 (or
                 Horovod's allreduce of them): Compression.auto may choose it per bucket,
                 where its measured error is under auto's bound
    """
    name: str
    bits: int
    routes: tuple
    summary: str
    compressor: object = None
    flag: str = None
    code_bytes: Callable = None
    block_scales: bool = True
    parameter: object = None
    step_bytes: Callable = None
    course: bool = False
    carries_values: bool = False

    @property
    def default_route(self) -> Route:
        return self.routes[0]

    @property
    def packet(self) -> bool:
        """Codes that allreduce cannot sum, decoded by every rank (the packet routes)."""
        return self.code_bytes is not None

    def message_bytes(self, numel: int, block: int) -> int:
        """Bytes of one bucket message of `numel` values: float32 scale per `block` values,
        codes, padded to a multiple of 4 (compressors/blockcodec.py's layout)."""
        scales = 4 * -(-numel // block) if self.block_scales else 0
        return scales + (self.code_bytes(numel) + 3) // 4 * 4

    def load(self):
        """The compression object (a class, or a factory of methods with a parameter)."""
        if isinstance(self.compressor, str):
            module, _, attr = self.compressor.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.compressor


SCHEMES = {}


def register(entry: Scheme) -> Scheme:
    """Add a scheme (a compressor's own file calls this once); a name is registered once."""
    known = SCHEMES.get(entry.name)
    if known is not None and known != entry:
        raise ValueError(f"compression scheme {entry.name!r} is already registered")
    if not entry.routes or any(not isinstance(r, Route) for r in entry.routes):
        raise ValueError(f"scheme {entry.name!r}: routes must be registry.Route values")
    if entry.packet and Route.ALLREDUCE in entry.routes:
        raise ValueError(f"scheme {entry.name!r}: packet schemes (code_bytes) travel by "
                         "allgather or alltoall, not allreduce")
    SCHEMES[entry.name] = entry
    return entry


for _entry in (
    Scheme("none", 32, (Route.ALLREDUCE,), "float32, Horovod's allreduce",
           "hvd_compress.roles:NoneCompressor", course=True,
           carries_values=True),
    Scheme("fp16", 16, (Route.ALLREDUCE,), "Horovod's float16 cast, summed in float16",
           "hvd_compress.roles:FP16Compressor", "--fp16-allreduce", course=True,
           carries_values=True),
    # bit16's default is two-phase: a rank sends 2(n-1)/n of its codes where allgather sends
    # n-1 copies, and decodes one chunk of each rank's where allgather decodes every rank's
    # whole bucket; half of fp32's bytes at every n (the README's step table compares them).
    Scheme("bit16", 16, (Route.ALLTOALL, Route.ALLGATHER), "scaled float16, reduced in float32",
           "hvd_compress.compressors:Bit16Compressor", "--bit16-allreduce", _two_bytes,
           course=True, carries_values=True),
    # bit8's default is the course's design (allgather); the two-phase route scales with n.
    Scheme("bit8", 8, (Route.ALLGATHER, Route.ALLTOALL), "scaled OCP E4M3, reduced in float32",
           "hvd_compress.compressors:Bit8Compressor", "--bit8-allreduce", _one_byte,
           course=True, carries_values=True),
    # The other methods the course names; bits: what one value costs on the wire,
    # before block scales (int8, onebit) or per kept value (topk: int32 index + float32 value).
    Scheme("int8", 8, (Route.ALLGATHER, Route.ALLTOALL),
           "int8, amax/127 scale per block, stochastic rounding, reduced in float32",
           "hvd_compress.compressors:Int8Compressor", "--int8-allreduce", _one_byte,
           carries_values=True),
    Scheme("onebit", 1, (Route.ALLGATHER,),
           "sign bits, mean |x| per block, error feedback on by default",
           "hvd_compress.compressors:OneBitCompressor", "--onebit-allreduce", _sign_bits),
    # Horovod's allreduce has no bfloat16 (horovod#4047): decoded and summed in float32.
    Scheme("bf16", 16, (Route.ALLTOALL, Route.ALLGATHER),
           "bfloat16 codes (round to nearest even), no scales, reduced in float32",
           "hvd_compress.compressors:BF16Compressor", "--bf16-allreduce", _two_bytes,
           block_scales=False, carries_values=True),
    Scheme("topk", 64, (Route.ALLGATHER,),
           "the ratio x numel largest |g| as index + value pairs, error feedback",
           "hvd_compress.methods.topk:TopK", "--topk-allreduce", parameter=0.01,
           step_bytes=topk_step_bytes),
    Scheme("powersgd", 32, (Route.ALLREDUCE,),
           "rank-r factors P, Q of each matrix by float32 allreduce, error feedback",
           "hvd_compress.methods.powersgd:PowerSGD", "--powersgd-allreduce", parameter=2,
           step_bytes=powersgd_step_bytes),
):
    register(_entry)

# The course's table (none, Horovod's fp16, the lab's bit16 and bit8); other_schemes() the rest.
COURSE_SCHEMES = tuple(s.name for s in SCHEMES.values() if s.course)
# Modules that register more schemes (a compressor in a file of its own), imported on first
# look-up of a name not yet known: comma-separated module names, e.g. "my_bf16" on PYTHONPATH.
PLUGINS_ENV = "HVD_COMPRESS_SCHEMES"


def load_plugins(environ=os.environ):
    """Import the modules named in $HVD_COMPRESS_SCHEMES (each registers its schemes); the
    lab, the cost model and make_communicator call this, so a new compressor is one file."""
    for module in filter(None, (m.strip() for m in environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(module)
    return SCHEMES


def schemes():
    """Every registered scheme, the plugins' included, by name."""
    return load_plugins()


def other_schemes():
    """The names of every registered scheme outside the course's table, plugins included, in
    registration order: the lab's --methods rows and the report's section of them."""
    return tuple(name for name, s in schemes().items() if not s.course)


def scheme(name: str) -> Scheme:
    if name not in SCHEMES:
        load_plugins()
    try:
        return SCHEMES[name]
    except KeyError:
        plugins = os.environ.get(PLUGINS_ENV, "")
        raise ValueError(
            f"unknown compression scheme {name!r}; known: {', '.join(SCHEMES)}. A scheme in a "
            f"file of its own is registered by naming its module in ${PLUGINS_ENV} "
            f"(comma-separated, on the Python path; now {plugins!r}) or by calling "
            "hvd_compress.registry.register (docs/extending.md)") from None


def resolve_route(scheme_name: str, route=None) -> Route:
    """The route `scheme_name` takes: `route` if given (checked), else the scheme's default."""
    s = scheme(scheme_name)
    if route is None:
        return s.default_route
    route = Route.parse(route)
    if route not in s.routes:
        raise ValueError(f"{scheme_name} cannot travel by {route.value}: its routes are "
                         f"{', '.join(r.value for r in s.routes)}")
    return route


def label(scheme_name: str, route=None) -> str:
    """'bit8:allgather', 'none:allreduce': the scheme and the route it takes, one string."""
    return f"{scheme_name}:{resolve_route(scheme_name, route).value}"


def parse_label(text: str):
    """(scheme, Route) from 'bit8:alltoall' or 'bit8' (its default route)."""
    name, _, route = text.partition(":")
    return name, resolve_route(name, route or None)


def run_name(world_size: int, scheme_name: str, route=None, *, error_feedback=False,
             variant=None) -> str:
    """A run's name, as in the course's table: 'serial', 'np2-bit8', 'np4-bit8-alltoall-ef'.

    The route is named only when it is not the scheme's default; `variant` ('horovod' for the
    in-tree route, 'adasum') goes before it. A serial run of a scheme other than none is
    'serial-<scheme>'.
    """
    parts = ["serial" if world_size == 1 else f"np{world_size}"]
    if world_size > 1 or scheme_name != "none" or variant or route or error_feedback:
        parts.append(scheme_name)
    if variant:
        parts.append(variant)
    if route is not None and resolve_route(scheme_name, route) != scheme(scheme_name).default_route:
        parts.append(Route.parse(route).value)
    if error_feedback:
        parts.append("ef")
    return "-".join(parts)
