"""Step 3b: the student's patched Horovod, built by the project's own setup (scripts/setup.sh
--wheel-only: the same build, cached by the patches' hash, so a patch identical to the
project's costs nothing and a new one about 5 minutes on 2 cores), then a plain Horovod script
on 2 ranks through it (intree_job): in a launch of its own with the student's wheel on
PYTHONPATH, or, when that wheel is the one this virtualenv runs (the project's own patches),
inside the grader's 2-rank job, which imports that very Horovod (two processes fewer)."""
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import launch
from .checks import fail, ok
from .kit import COURSE_PATCH, ROOT

STEP = "intree"
HOOKS = ("horovod/torch/compression.py", "horovod/torch/mpi_ops.py", "horovod/torch/optimizer.py")


def patch_check(kit):
    """The course's patch is a diff that touches the three hook points."""
    path = Path(kit) / "patches" / COURSE_PATCH
    text = path.read_text(errors="replace") if path.is_file() else ""
    touched = {line.split()[1][2:] for line in text.splitlines()
               if line.startswith("+++ ") and len(line.split()) > 1}
    missing = [hook for hook in HOOKS if hook not in touched]
    if not touched:
        return fail(STEP, "intree.patch", f"patches/{COURSE_PATCH} holds no diff yet: write the "
                    f"course's change (its text says where: {', '.join(HOOKS)}).",
                    f"patches/{COURSE_PATCH} 中还没有 diff：请写出课程的修改（见文件说明）。")
    if missing:
        return fail(STEP, "intree.patch", f"patches/{COURSE_PATCH} does not change "
                    f"{', '.join(missing)}: Compression.bit8/.bit16, allreduce and the optimizer "
                    f"all need the allgather route.",
                    f"patches/{COURSE_PATCH} 没有修改 {', '.join(missing)}。")
    return ok(STEP, "intree.patch")


def build(kit, timeout=3600):
    """(folder holding the student's Horovod wheel, None) or (None, the build's error)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--wheel-only",
                           str(Path(kit) / "patches")], capture_output=True, text=True,
                          timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    if proc.returncode != 0 or not lines:
        return None, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return Path(lines[-1]), None


def site_for(wheel_dir):
    """A folder to put on PYTHONPATH that imports the student's Horovod; None when the wheel
    is the one this virtualenv already runs (the same key: the project's own patches)."""
    installed = Path(sys.prefix, ".horovod-key")
    if installed.is_file() and installed.read_text().strip() == wheel_dir.name:
        return None
    site = wheel_dir.parent / f"{wheel_dir.name}-site"
    if not site.is_dir():
        wheel = next(wheel_dir.glob("horovod-*.whl"))
        tmp = site.with_name(site.name + ".tmp")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(tmp), str(wheel)], check=True, capture_output=True)
        os.replace(tmp, site)
    return site


@dataclass
class Prepared:
    """A kit's in-tree route up to the script: its checks so far, and where its Horovod is."""
    checks: list                # intree.patch and intree.build, or all four when one failed
    ready: bool = False         # patch and build passed: the script on 2 ranks is still to run
    site: Path = None           # PYTHONPATH entry for the student's Horovod; None: this venv's

    @property
    def in_grader_job(self):
        """The script can run inside the grader's own 2-rank job (labs.classroom.rank_job):
        the student's Horovod is the one the grader's ranks import already."""
        return self.ready and self.site is None


def prepare(kit):
    """The patch check and the build (cached): what is left is the script on 2 ranks."""
    kit = Path(kit).resolve()
    names = ["intree.build", "intree.allreduce", "intree.optimizer"]
    first = patch_check(kit)
    if not first.passed:
        return Prepared([first] + [fail(STEP, n, "not checked: no patch to build.", "未检查：没有可构建的补丁。")
                                   for n in names])
    wheel_dir, error = build(kit)
    if wheel_dir is None:
        return Prepared([first, fail(STEP, "intree.build", f"Horovod does not build with your patches: "
                                     f"{' / '.join(error)}.", f"Horovod 无法用你的补丁构建：{' / '.join(error)}。")] +
                        [fail(STEP, n, "not checked: the build failed.", "未检查：构建失败。") for n in names[1:]])
    return Prepared([first, ok(STEP, "intree.build", wheel=wheel_dir.name)], True, site_for(wheel_dir))


def record_checks(prepared, records, status=None, tail=""):
    """intree.allreduce and intree.optimizer from the script's records ({rank: record} of
    labs.classroom.intree_job.run_checks; fewer than 2: the script did not finish)."""
    names = ["intree.allreduce", "intree.optimizer"]
    results = list(prepared.checks)
    if len(records) < 2:
        last = " / ".join([l for l in tail.splitlines() if l.strip()][-3:])
        return results + [fail(STEP, n, f"the plain Horovod script on 2 processes did not finish "
                               f"(status {status}): {last}.", f"2 进程的 Horovod 脚本未完成：{last}。")
                          for n in names]
    for key, name, what in (("bit8", "intree.allreduce", "hvd.allreduce(x, compression=hvd.Compression.%s)"),
                            ("optimizer", "intree.optimizer", "hvd.DistributedOptimizer(..., compression=hvd.Compression.bit8)")):
        keys = ("bit8", "bit16") if key == "bit8" else (key,)
        bad = [(r, k, records[r][k]) for r in range(2) for k in keys if not records[r][k]["ok"]]
        if not bad:
            results.append(ok(STEP, name))
            continue
        r, k, rec = bad[0]
        shown = what % k if "%s" in what else what
        problem = rec["error"] or (f"differs from the average of every rank's packet decoded by "
                                   f"your compressor (largest difference {rec.get('max_error', 0):.3g}), "
                                   f"or the ranks disagree")
        results.append(fail(STEP, name, f"{shown} on rank {r}: {problem}.",
                            f"进程 {r} 上 {shown}：{problem}。"))
    return results


def run_apart(kit, prepared, timeout=300):
    """The script in a launch of its own, with the student's Horovod on PYTHONPATH."""
    kit = Path(kit).resolve()
    out = kit / ".grade" / "intree"
    for old in out.glob("rank*.json"):
        old.unlink()
    status, tail = launch.run(2, "labs.classroom.intree_job", [out], timeout,
                              pythonpath=[p for p in (prepared.site, kit) if p])
    return record_checks(prepared, launch.read_ranks(out, 2), status, tail)
