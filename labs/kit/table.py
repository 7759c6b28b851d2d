"""The course's table of runs, written once: the run matrix runs it, the report lists it.

A run is a number of processes and a compression scheme (and, in the extra rows, a route or
error feedback).  Its name comes from hvd_compress.registry.run_name, the plugin's vocabulary,
and so does the name the trainer gives its own configuration (config_name): a run folder, a
row of summary.csv and a line of the report are matched by that string.
"""
from dataclasses import dataclass
from typing import Optional

from hvd_compress.costmodel.methods import METHOD_DEFAULTS
from hvd_compress.registry import COURSE_SCHEMES, SCHEMES, other_schemes, run_name

from .flags import AUTO, AUTO_FLAG, DEFAULTS


def scheme_flags(name):
    """The trainer's flags that pick scheme `name` (its registry entry's flag, with the
    method's default parameter where it takes one; auto's own switch)."""
    if name == AUTO and AUTO not in SCHEMES:
        return [AUTO_FLAG]
    entry = SCHEMES[name]
    if not entry.flag:
        return []
    return [entry.flag] if entry.parameter is None else [entry.flag, f"{entry.parameter:g}"]


# The trainer's flags for each scheme, in the order the matrix runs them.
SCHEME_FLAGS = {name: scheme_flags(name) for name in COURSE_SCHEMES}
# Every other registered scheme with a flag (plugins of $HVD_COMPRESS_SCHEMES included), a
# method at its default parameter: the matrix's --methods rows.
METHOD_FLAGS = {name: scheme_flags(name) for name in other_schemes() if SCHEMES[name].flag}
# The per-bucket plan: the matrix's --auto rows, at 2 and 4 processes.
AUTO_FLAGS = {AUTO: scheme_flags(AUTO)}
RANKS = (2, 4)
# A run of the network that is not the default is named so: np2-bit8-small (Horovod's small
# example network; "-horovod" already names Horovod's own optimizer, --optimizer horovod).
MODEL_SUFFIX = {"horovod": "small", "basic": "basic"}
# The report's results table groups a scheme's rows: float32 first, then float8, float16 and
# Horovod's fp16 cast, as the course's lab report lists them.
REPORT_SCHEMES = ("none", "bit8", "bit16", "fp16")


@dataclass(frozen=True)
class Run:
    """One row of the table: its name and the trainer flags that make it."""
    ranks: int
    scheme: str = "none"
    route: Optional[str] = None
    error_feedback: bool = False

    @property
    def name(self):
        return run_name(self.ranks, self.scheme, self.route, error_feedback=self.error_feedback)

    @property
    def flags(self):
        flags = list({**SCHEME_FLAGS, **METHOD_FLAGS, **AUTO_FLAGS}[self.scheme])
        if self.route:
            flags += ["--route", self.route]
        if self.error_feedback:
            flags.append("--error-feedback")
        return flags


def course_runs(extras=False, methods=False, auto=False):
    """The course's table in the order the matrix runs it: serial, then 2 and 4 processes x
    every scheme; `extras` adds bit8 by the two-phase route and bit8 with error feedback,
    `methods` every other registered scheme (METHOD_FLAGS) at 2 and 4 processes, `auto`
    the per-bucket plan (np2-auto, np4-auto)."""
    runs = [Run(1)] + [Run(ranks, scheme) for ranks in RANKS for scheme in SCHEME_FLAGS]
    if extras:
        for ranks in RANKS:
            runs += [Run(ranks, "bit8", route="alltoall"), Run(ranks, "bit8", error_feedback=True)]
    if methods:
        runs += [Run(ranks, method) for ranks in RANKS for method in METHOD_FLAGS]
    if auto:
        runs += [Run(ranks, AUTO) for ranks in RANKS]
    return runs


def _report_key(run):
    return run.ranks > 1, REPORT_SCHEMES.index(run.scheme), run.ranks


# The report's row order: serial, then each scheme at 2 and 4 processes (other runs follow).
ROW_ORDER = [run.name for run in sorted(course_runs(), key=_report_key)]


def config_name(args, world_size):
    """The name of the trainer's configuration (its parsed flags), e.g. 'np4-bit8-alltoall-ef':
    the table's name for the same run; Adasum and Horovod's own optimizer add a variant."""
    variant = "adasum" if args.use_adasum else "horovod" if args.optimizer == "horovod" else None
    # A method's parameter is named where it is not the matrix's default (top-k 0.01, rank 2).
    if args.compression == "topk" and args.topk_allreduce != METHOD_DEFAULTS["topk"]:
        variant = f"ratio{args.topk_allreduce:g}"
    if args.compression == "powersgd" and args.powersgd_allreduce != METHOD_DEFAULTS["powersgd"]:
        variant = f"rank{args.powersgd_allreduce}"
    name = run_name(world_size, args.compression, args.route,
                    error_feedback=bool(args.error_feedback), variant=variant)
    model = getattr(args, "model", DEFAULTS["model"])
    return name if model == DEFAULTS["model"] else f"{name}-{MODEL_SUFFIX[model]}"
