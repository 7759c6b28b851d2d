"""Records of a training run: per-step and per-epoch CSV, manifest.json, checkpoints.

Why this module exists: a run on several processes can be interrupted at any moment (Ctrl-C,
a timeout, a crashed rank).  Everything here is written so that what is on disk is always
whole and readable by pandas:

* JSON, checkpoints and rewritten CSV go through ``atomic_write_*`` (write a temporary file
  in the same folder, fsync, then ``os.replace``), so a reader sees the old or the new file,
  never half of one.
* ``CsvLog`` appends one flushed line per row; ``truncate_csv`` drops rows past a checkpoint
  (and a torn last line) when a run is resumed.
* ``StepTimer`` keeps the timing of each phase of a step to one line in the training loop.
* ``environment`` describes the machine and software for the manifest and the report.

Paths are the caller's: a run folder, a file, the folder whose git commit to record.  Nothing
here assumes a checkout.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable, Optional

# The columns of the records, shared by the trainer, the run matrix, the report and the plots.
STEP_COLUMNS = [
    "rank", "epoch", "step", "batch", "samples", "loss",
    "step_s",               # wall time of the whole step on this rank
    "forward_backward_s",   # batch fetch + zero_grad + forward + backward
    "copy_s",               # gradients into their bucket, reduced values out (pop_stats())
    "compress_s", "communicate_s", "decompress_s",   # the codec and the wait (pop_stats())
    "update_s",             # optimizer.step() wall time minus the four above
    "bytes_sent",           # gradient bytes this rank sent in this step
    "exchange_s",           # first bucket launched -> last gradient reduced (may overlap backward)
    "launch_span_s",        # first bucket launched -> last bucket launched (backward's pace)
    "wall_time",            # unix time at the end of the step
]
# After STEP_COLUMNS in a run whose optimizer plans per bucket (--auto-allreduce: its
# pop_stats() reports them): what each step ran under.
PLAN_COLUMNS = [
    "plan",                 # per-bucket scheme:route in launch order, space-separated ("" before
                            # the first plan)
    "plan_predicted_ms",    # the plan's predicted step (nan before it)
    "plan_measured_ms",     # median measured step since the plan was applied (nan before)
    "plan_event",           # "", "calibrating", "trial: what", "planned", "replanned: why",
                            # "fallback: why"
]
EPOCH_COLUMNS = [
    "epoch", "steps", "train_samples", "train_loss", "epoch_s", "train_samples_per_s",
    "test_samples", "test_loss", "test_accuracy", "eval_s", "bytes_sent",
    "wire_tx_bytes",        # all ranks' NIC tx counters over the epoch (netem only, else NaN)
    "wall_time",
]
# One row per evaluation on the held-out split (--holdout K --eval-every N), written by rank 0
# between two training steps: the steps to a target accuracy are read from these.
EVAL_COLUMNS = [
    "epoch", "step",        # the training steps done so far (over all epochs), and in which epoch
    "samples",              # training images seen so far, all ranks together
    "holdout_samples", "holdout_loss", "holdout_accuracy",
    "eval_s",               # the evaluation's wall time (the ranks' sums added included)
    "wall_time",            # unix time at the end of the evaluation
]
STATUSES = ("running", "complete", "interrupted", "failed")


# ---------------------------------------------------------------------------------------------
# Atomic files
# ---------------------------------------------------------------------------------------------

def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step: readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# CSV
# ---------------------------------------------------------------------------------------------

def _format(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


class CsvLog:
    """An append-only CSV file with a fixed header, one flushed line per row.

    Opening an existing file appends to it (after checking its header), which is how a
    resumed run continues its records instead of overwriting them.
    """

    def __init__(self, path: Path, columns: list[str]):
        self.path = Path(path)
        self.columns = list(columns)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        exists = self.path.is_file() and self.path.stat().st_size > 0
        if exists:
            with open(self.path, newline="", encoding="utf-8") as stream:
                header = next(csv.reader(stream), [])
            if header != self.columns:
                raise ValueError(f"{self.path}: header {header} differs from {self.columns}; "
                                 f"it was written by another version or another table")
            _ensure_trailing_newline(self.path)
        self._stream = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._stream)
        if not exists:
            self._writer.writerow(self.columns)
            self._stream.flush()

    def write(self, row: dict) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"{self.path}: unknown columns {sorted(unknown)}")
        self._writer.writerow([_format(row.get(c)) for c in self.columns])
        self._stream.flush()

    def close(self) -> None:
        if not self._stream.closed:
            self._stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ensure_trailing_newline(path: Path) -> None:
    """A crash can leave a torn last line; make sure new rows start on a line of their own."""
    with open(path, "rb+") as stream:
        stream.seek(0, os.SEEK_END)
        if stream.tell() == 0:
            return
        stream.seek(-1, os.SEEK_END)
        if stream.read(1) != b"\n":
            stream.write(b"\n")


def read_csv_rows(path: Path) -> tuple[list[str], list[dict]]:
    """Header and complete rows of a CSV file (a torn row with missing fields is dropped)."""
    with open(path, newline="", encoding="utf-8") as stream:
        reader = csv.DictReader(stream)
        header = list(reader.fieldnames or [])
        rows = [row for row in reader
                if None not in row.values() and None not in row and len(row) == len(header)]
    return header, rows


def write_csv_rows(path: Path, header: list[str], rows: Iterable[dict]) -> None:
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    atomic_write_text(path, buffer.getvalue())


def truncate_csv(path: Path, keep: Callable[[dict], bool]) -> int:
    """Rewrite ``path`` atomically with only the rows for which ``keep(row)`` is true.

    Returns the number of rows removed (torn rows included).  Used by ``--resume`` to drop
    the rows of an epoch that was interrupted after its last checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, newline="", encoding="utf-8") as stream:
        total = max(sum(1 for _ in csv.reader(stream)) - 1, 0)
    header, rows = read_csv_rows(path)
    kept = [row for row in rows if keep(row)]
    write_csv_rows(path, header, kept)
    return total - len(kept)


def merge_csvs(paths: Iterable[Path], out: Path) -> int:
    """Concatenate CSV files with identical headers into ``out`` (atomically); returns rows."""
    header, merged = None, []
    for path in paths:
        this_header, rows = read_csv_rows(path)
        if header is None:
            header = this_header
        elif this_header != header:
            raise ValueError(f"{path}: header {this_header} differs from {header}")
        merged.extend(rows)
    if header is None:
        raise FileNotFoundError("no CSV files to merge")
    write_csv_rows(out, header, merged)
    return len(merged)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def process_start_unix(pid: str = "self") -> float:
    """When this process was started (unix time), from the kernel's record of it: a run's
    time to accuracy counts its start-up (imports, the launcher's rendezvous, loading the
    data) from there. Linux's /proc; elsewhere, now."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22: after boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, IndexError, ValueError, AttributeError):
        return time.time()


class StepTimer:
    """Wall time per phase, one line in the loop: ``with timer("forward_backward"): ...``.

    ``pop()`` returns the accumulated seconds per phase and starts again from zero.
    """

    def __init__(self):
        self._seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] = self._seconds.get(phase, 0.0) + time.perf_counter() - start

    def pop(self) -> dict:
        seconds, self._seconds = self._seconds, {}
        return seconds


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save ``state`` atomically (an interrupted save leaves the previous checkpoint)."""
    import torch
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` (tensors and plain containers only)."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint to resume from")
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------------------------------
# Manifest and environment
# ---------------------------------------------------------------------------------------------

def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _run(command: list[str], timeout: float = 10.0) -> Optional[str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def mpi_version() -> str:
    """First line of ``mpirun --version`` (e.g. "mpirun (Open MPI) 4.1.4"), "none" if absent."""
    out = _run(["mpirun", "--version"])
    return out.splitlines()[0].strip() if out else "none"


def git_commit(repo: Path) -> str:
    """HEAD of the git checkout holding ``repo`` (any folder inside it), "-dirty" when tracked
    files changed; "none" outside a checkout or without git."""
    commit = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    if not commit:
        return "none"
    dirty = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return commit + ("-dirty" if dirty else "")


def cpu_model() -> str:
    info = _read("/proc/cpuinfo") or ""
    for line in info.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def memory_gib() -> Optional[float]:
    info = _read("/proc/meminfo") or ""
    for line in info.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def os_name() -> str:
    release = _read("/etc/os-release") or ""
    for line in release.splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return platform.platform()


def network_interfaces() -> list[dict]:
    """Interfaces under /sys/class/net (loopback included: single-host ranks talk over it)."""
    nics = []
    root = Path("/sys/class/net")
    if not root.is_dir():
        return nics
    for iface in sorted(root.iterdir()):
        speed = _read(str(iface / "speed"))
        driver = iface / "device" / "driver"
        nics.append({
            "name": iface.name,
            "state": _read(str(iface / "operstate")) or "unknown",
            "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit()
            and int(speed) > 0 else None,
            "driver": os.path.basename(os.readlink(driver)) if driver.is_symlink() else None,
            "mtu": _read(str(iface / "mtu")),
        })
    return nics


def gpus() -> list[dict]:
    """NVIDIA GPUs from nvidia-smi (model, driver, PCI bus); empty list when there are none."""
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,pci.bus_id,memory.total",
                "--format=csv,noheader"])
    if not out:
        return []
    found = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            found.append({"name": parts[0], "driver": parts[1], "pci_bus": parts[2],
                          "memory": parts[3]})
    return found


def cuda_toolkit() -> str:
    """The CUDA toolkit's release from ``nvcc --version`` ("none" without nvcc)."""
    out = _run(["nvcc", "--version"])
    for line in reversed((out or "").splitlines()):
        if "release" in line:
            return line.split("release", 1)[1].split(",")[0].strip()
    return "none"


def environment(code_dir: Path = Path(".")) -> dict:
    """What the machine and the software are, for the manifest and the report's table;
    ``git_commit`` is that of the checkout holding ``code_dir`` (default: the current folder)."""
    try:
        import torch
        torch_version, cuda = torch.__version__, torch.version.cuda or "none"
    except ImportError:
        torch_version, cuda = "none", "none"
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "memory_gib": memory_gib(),
        "os": os_name(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "cuda": cuda,                    # what torch was built with
        "cuda_toolkit": cuda_toolkit(),  # what is installed (may be unused)
        "horovod": package_version("horovod"),
        "mpi": mpi_version(),
        "numpy": package_version("numpy"),
        "pandas": package_version("pandas"),
        "matplotlib": package_version("matplotlib"),
        "ml_dtypes": package_version("ml_dtypes"),
        "hvd_compress": package_version("hvd_compress"),
        "nics": network_interfaces(),
        "gpus": gpus(),
        "git_commit": git_commit(code_dir),
        "argv": sys.argv,
    }


def write_manifest(run_dir: Path, manifest: dict) -> None:
    if manifest.get("status") not in STATUSES:
        raise ValueError(f"manifest status must be one of {STATUSES}, "
                         f"got {manifest.get('status')!r}")
    atomic_write_json(Path(run_dir) / "manifest.json", manifest)


def read_manifest(run_dir: Path) -> Optional[dict]:
    return read_json(Path(run_dir) / "manifest.json")


def update_manifest(run_dir: Path, **fields) -> dict:
    """Read, update and atomically rewrite a run's manifest; returns the new manifest."""
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise FileNotFoundError(f"{run_dir}: no manifest.json")
    manifest.update(fields)
    write_manifest(run_dir, manifest)
    return manifest
