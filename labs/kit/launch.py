"""The one place that knows how to start N Horovod ranks on this kind of machine.

Tests, the run matrix and the benchmarks all launch through `horovodrun_command`, so the
flags that a 2-core machine run as root needs are written once:
- Open MPI refuses root without --allow-run-as-root (or the OMPI_ALLOW_RUN_AS_ROOT env pair),
  and more ranks than cores without --oversubscribe;
- oversubscribed MPI ranks busy-poll and starve each other (a 4-rank test took 4 minutes);
  mpi_yield_when_idle makes them yield the core (the same test: 50 s).
"""
import os
import shutil
import sys

__all__ = ["horovodrun_command", "launch_env", "CONTROLLERS"]

CONTROLLERS = ("gloo", "mpi")
MPI_ARGS = "--oversubscribe --mca mpi_yield_when_idle 1 --bind-to none"


def _horovodrun():
    here = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return here if os.path.exists(here) else (shutil.which("horovodrun") or "horovodrun")


def horovodrun_command(np, command, controller="gloo", extra_args=(), cached_build_check=False):
    """argv that runs `command` (a list) on `np` local ranks under `controller`.
    cached_build_check: horovodrun through labs/kit/horovodrun.py, which answers horovodrun's
    "was Horovod built with this controller?" once per build instead of importing torch in a
    process of its own at every launch (about 2 s of a core before any rank starts)."""
    if controller not in CONTROLLERS:
        raise ValueError(f"controller must be one of {CONTROLLERS}, got {controller!r}")
    if int(np) < 1:
        raise ValueError(f"need at least one rank, got {np}")
    launcher = [sys.executable, "-m", "labs.kit.horovodrun"] if cached_build_check else [_horovodrun()]
    argv = launcher + ["-np", str(int(np)), f"--{controller}"]
    if controller == "mpi":
        argv += ["--mpi-args", MPI_ARGS]
    return argv + list(extra_args) + list(command)


def launch_env(base=None):
    """Environment for the ranks: the venv's bin first on PATH, Open MPI allowed as root."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env
