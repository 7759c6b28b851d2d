"""One vocabulary: the routes gradients travel by and the compression schemes, by name.

The plugin, the benchmarks, the cost model, the lab and the report all spell a configuration
with these names, so a row of a benchmark CSV, a run folder and a line of the report can be
matched by string. No torch or Horovod here: the cost model and the report import it too.

    route      how a scheme's codes travel           bytes sent per rank (g: fp32 bytes)
    allreduce  Horovod's ring allreduce              2(n-1)/n * g * bits/32
    allgather  every rank's codes to every rank      (n-1) * g * bits/32
    alltoall   two-phase: alltoall of chunks,        2(n-1)/n * g * bits/32
               reduce in float32, allgather

`op` (hvd.Average / hvd.Sum) is the reduction; a route is only how the bytes move.
"""
from dataclasses import dataclass
from enum import Enum

__all__ = ["Route", "Scheme", "SCHEMES", "COURSE_SCHEMES", "METHODS", "HEADER_BYTES", "scheme", "resolve_route", "label",
           "parse_label", "run_name"]

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


@dataclass(frozen=True)
class Scheme:
    """A compression scheme: its name, bits per value on the wire, the routes it can take."""
    name: str
    bits: int
    routes: tuple
    summary: str

    @property
    def default_route(self) -> Route:
        return self.routes[0]


SCHEMES = {s.name: s for s in (
    Scheme("none", 32, (Route.ALLREDUCE,), "float32, Horovod's allreduce"),
    Scheme("fp16", 16, (Route.ALLREDUCE,), "Horovod's float16 cast, summed in float16"),
    # bit16's default is two-phase: measured faster than its allgather and than Horovod's fp16
    # allreduce at n = 2 and 4 (README), and half of fp32's bytes at every n.
    Scheme("bit16", 16, (Route.ALLTOALL, Route.ALLGATHER), "scaled float16, reduced in float32"),
    # bit8's default is the course's design (allgather); the two-phase route scales with n.
    Scheme("bit8", 8, (Route.ALLGATHER, Route.ALLTOALL), "scaled OCP E4M3, reduced in float32"),
    # The other methods the course names (issue 13); bits: what one value costs on the wire,
    # before block scales (int8, onebit) or per kept value (topk: int32 index + float32 value).
    Scheme("int8", 8, (Route.ALLGATHER, Route.ALLTOALL),
           "int8, amax/127 scale per block, stochastic rounding, reduced in float32"),
    Scheme("onebit", 1, (Route.ALLGATHER,),
           "sign bits, mean |x| per block, error feedback on by default"),
    Scheme("topk", 64, (Route.ALLGATHER,),
           "the ratio x numel largest |g| as index + value pairs, error feedback"),
    Scheme("powersgd", 32, (Route.ALLREDUCE,),
           "rank-r factors P, Q of each matrix by float32 allreduce, error feedback"),
)}

# The course's table (none, Horovod's fp16, the lab's bit16 and bit8) and the other methods.
COURSE_SCHEMES = ("none", "fp16", "bit16", "bit8")
METHODS = ("int8", "onebit", "topk", "powersgd")


def scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown compression scheme {name!r}; known: {', '.join(SCHEMES)}") from None


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
