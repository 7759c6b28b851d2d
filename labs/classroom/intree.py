"""Step 3b: the student's patched Horovod, then a plain Horovod script on 2 ranks through it
(the student side's `intree` part, inside the kit's 2-rank sandbox).

The route is checked, not only the result: the patch's Compression.bit8/.bit16 must resolve
to the kit's own compression.py (`import compression`), never to the project's hvd_compress;
the ranks report what hvd.Compression.bit8 resolved to.

Where the student's Horovod comes from: a course patch that changes only Horovod's Python
files (the course's hook points are all Python) is applied, with `patch`, to the pristine
files of the Horovod sdist over this virtualenv's build (whose C++ is the given patches'): a
folder of links put first on the sandbox's PYTHONPATH, made in a second. Any other patch is
built by the project's own setup (scripts/setup.sh --wheel-only: cached by the patches' hash,
about 5 minutes on 2 cores the first time).
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .checks import fail, ok
from .kit import COURSE_PATCH, GIVEN_PATCHES, ROOT

STEP = "intree"
HOOKS = ("horovod/torch/compression.py", "horovod/torch/mpi_ops.py", "horovod/torch/optimizer.py")
SDIST = Path.home() / ".cache" / "hvd-compress" / "sdist" / "horovod-0.28.1.tar.gz"
SITES = Path("/var/tmp/hvd-classroom-sites")     # readable by the sandboxes (their /tmp is private)
REFERENCE_WORDS = ("hvd_compress", "labs.classroom", "solution_files")


def _hunks(text):
    """{file: [added lines]} of a unified diff."""
    files, current = {}, None
    for line in text.splitlines():
        if line.startswith("+++ ") and len(line.split()) > 1:
            current = line.split()[1][2:]
            files.setdefault(current, [])
        elif current and line.startswith("+") and not line.startswith("+++"):
            files[current].append(line[1:])
    return files


def patch_check(kit):
    """The course's patch is a diff that touches the three hook points, and its
    Compression.bit8/.bit16 route to the kit's own compression.py."""
    path = Path(kit) / "patches" / COURSE_PATCH
    text = path.read_text(errors="replace")[:1 << 20] if path.is_file() else ""
    files = _hunks(text)
    missing = [hook for hook in HOOKS if hook not in files]
    if not files:
        return fail(STEP, "intree.patch", f"patches/{COURSE_PATCH} holds no diff yet: write the "
                    f"course's change (its text says where: {', '.join(HOOKS)}).",
                    f"patches/{COURSE_PATCH} 中还没有 diff：请写出课程的修改（见文件说明）。")
    elsewhere = sorted({w for lines in files.values() for line in lines for w in REFERENCE_WORDS
                        if w in line})
    routes_to_kit = any(("import compression" in line or "from compression import" in line)
                        for line in files.get(HOOKS[0], []))
    if elsewhere or not routes_to_kit:
        target = f"to {', '.join(elsewhere)}" if elsewhere else "elsewhere (no `import compression`)"
        return fail(STEP, "intree.patch", f"patches/{COURSE_PATCH} routes hvd.Compression.bit8/.bit16 "
                    f"{target}, not to your kit's compression.py: Compression.bit8/.bit16 must "
                    f"resolve to the Bit8Compressor/Bit16Compressor of `import compression` (your "
                    f"kit's file), and mpi_ops/optimizer must use your compression.allreduce.",
                    f"patches/{COURSE_PATCH} 把 hvd.Compression.bit8/.bit16 指向了"
                    f"{'、'.join(elsewhere) or '别处（没有 import compression）'}，而不是你的 "
                    f"compression.py：必须通过 import compression 使用你自己的实现。")
    if missing:
        return fail(STEP, "intree.patch", f"patches/{COURSE_PATCH} does not change "
                    f"{', '.join(missing)}: Compression.bit8/.bit16, allreduce and the optimizer "
                    f"all need the allgather route.",
                    f"patches/{COURSE_PATCH} 没有修改 {', '.join(missing)}。")
    return ok(STEP, "intree.patch")


def _python_only(kit):
    """The course patch changes Horovod's Python files only, and the given patches are the
    project's: this venv's build holds every compiled part of the student's Horovod."""
    patches = Path(kit) / "patches"
    for name in GIVEN_PATCHES:
        given = patches / name
        if not given.is_file() or given.read_bytes() != (ROOT / "patches" / name).read_bytes():
            return False
    files = _hunks((patches / COURSE_PATCH).read_text(errors="replace"))
    return bool(files) and all(f.startswith("horovod/") and f.endswith(".py") for f in files)


def _installed_horovod():
    import importlib.util
    return Path(importlib.util.find_spec("horovod").origin).parent


def python_site(kit):
    """(folder to put first on PYTHONPATH, None) or (None, the error): this venv's Horovod,
    linked file by file, with the patched Python files written over pristine ones."""
    patch = (Path(kit) / "patches" / COURSE_PATCH).read_bytes()
    # keyed by the installed Horovod too: the site links to its files, so another venv's (a
    # worktree's, an earlier clone's) must never be reused
    installed = _installed_horovod().resolve()
    stamp = f"{installed}:{(installed / '__init__.py').stat().st_mtime_ns}".encode()
    key = hashlib.sha256(patch + b"\0" + stamp).hexdigest()[:16]
    site = SITES / key
    if site.is_dir():
        return site, None
    if not SDIST.is_file():
        return None, [f"no Horovod sdist at {SDIST} (run scripts/setup.sh once)"]
    SITES.mkdir(parents=True, exist_ok=True)
    SITES.chmod(0o755)
    work = Path(tempfile.mkdtemp(dir=SITES, prefix=".build-"))
    try:
        src = work / "src"
        touched = sorted(set(HOOKS) | set(_hunks(patch.decode("utf-8", "replace"))))
        with tarfile.open(SDIST) as sdist:
            for name in touched:
                try:
                    member = sdist.getmember(f"horovod-0.28.1/{name}")
                except KeyError:
                    continue                    # a new file: the patch creates it
                target = src / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(sdist.extractfile(member).read())
        done = subprocess.run(["patch", "-p1", "--batch", "--no-backup-if-mismatch", "-d", str(src)],
                              input=patch, capture_output=True, timeout=60)
        if done.returncode != 0:
            lines = (done.stdout + done.stderr).decode("utf-8", "replace").strip().splitlines()
            return None, [line for line in lines if line.strip()][-3:] or ["patch failed"]
        tree = work / "site" / "horovod"
        for root, dirs, names in os.walk(installed):
            rel = Path(root).relative_to(installed)
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            (tree / rel).mkdir(parents=True, exist_ok=True)
            for name in names:
                os.symlink(Path(root) / name, tree / rel / name)
        for name in touched:
            patched = src / name
            dest = tree / Path(name).relative_to("horovod")
            if dest.is_symlink() or dest.exists():
                dest.unlink()
            if patched.is_file():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(patched, dest)
        for root, dirs, names in os.walk(work / "site"):
            os.chmod(root, 0o755)
        try:
            os.replace(work / "site", site)
        except OSError:
            pass                                # made meanwhile by another grader: the same
        return site, None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build(kit, timeout=3600):
    """(folder holding the student's Horovod wheel, None) or (None, the build's error)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--wheel-only",
                           str(Path(kit) / "patches")], capture_output=True, text=True,
                          timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    if proc.returncode != 0 or not lines:
        return None, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return Path(lines[-1]), None


def wheel_site(wheel_dir):
    """A folder to put on PYTHONPATH that imports the student's Horovod built as a wheel."""
    site = SITES / f"{wheel_dir.name}-site"
    if not site.is_dir():
        SITES.mkdir(parents=True, exist_ok=True)
        wheel = next(wheel_dir.glob("horovod-*.whl"))
        tmp = site.with_name(site.name + ".tmp")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(tmp), str(wheel)], check=True, capture_output=True)
        for root, dirs, names in os.walk(tmp):
            os.chmod(root, 0o755)
        os.replace(tmp, site)
    return site


@dataclass
class Prepared:
    """A kit's in-tree route up to the script: its checks so far, and where its Horovod is."""
    checks: list                # intree.patch and intree.build, or all four when one failed
    ready: bool = False         # patch and build passed: the script on 2 ranks is still to run
    site: Path = None           # PYTHONPATH entry (first) for the student's Horovod


def prepare(kit):
    """The patch check and the build (cached): what is left is the script on 2 ranks."""
    kit = Path(kit).resolve()
    names = ["intree.build", "intree.allreduce", "intree.optimizer"]
    first = patch_check(kit)
    if not first.passed:
        return Prepared([first] + [fail(STEP, n, "not checked: the patch does not pass.",
                                        "未检查：补丁未通过。") for n in names])
    if _python_only(kit):
        site, error = python_site(kit)
        how = "Horovod's Python files do not take your patch"
    else:
        wheel_dir, error = build(kit)
        site = wheel_site(wheel_dir) if wheel_dir else None
        how = "Horovod does not build with your patches"
    if site is None:
        return Prepared([first, fail(STEP, "intree.build", f"{how}: {' / '.join(error)}.",
                                     f"Horovod 无法用你的补丁构建：{' / '.join(error)}。")] +
                        [fail(STEP, n, "not checked: the build failed.", "未检查：构建失败。") for n in names[1:]])
    return Prepared([first, ok(STEP, "intree.build")], True, site)


def record_checks(prepared, records, how=""):
    """intree.allreduce and intree.optimizer from the ranks' judged records ({rank: {"bit8",
    "bit16": {ok, max_error, error, routed_to}, "optimizer": {ok, error}}}; fewer than 2: the
    script did not finish, `how` says why)."""
    names = ["intree.allreduce", "intree.optimizer"]
    results = list(prepared.checks)
    if len(records) < 2:
        return results + [fail(STEP, n, f"the plain Horovod script on 2 processes did not finish: "
                               f"{how}.", f"2 进程的 Horovod 脚本未完成：{how}。") for n in names]
    for key, name, what in (("bit8", "intree.allreduce", "hvd.allreduce(x, compression=hvd.Compression.%s)"),
                            ("optimizer", "intree.optimizer", "hvd.DistributedOptimizer(..., compression=hvd.Compression.bit8)")):
        keys = ("bit8", "bit16") if key == "bit8" else (key,)
        routed = [(r, k, records[r][k].get("routed_to")) for r in range(2) for k in keys
                  if key == "bit8" and records[r][k].get("routed_to")
                  and not str(records[r][k]["routed_to"]).startswith("compression.")]
        if routed:
            r, k, target = routed[0]
            results.append(fail(STEP, name, f"hvd.Compression.{k} resolves to {target}, not to your "
                                f"kit's compression.{'Bit8' if k == 'bit8' else 'Bit16'}Compressor: "
                                f"the patch must route to your compression.py.",
                                f"hvd.Compression.{k} 指向 {target}，而不是你的 compression.py。"))
            continue
        bad = [(r, k, records[r][k]) for r in range(2) for k in keys if not records[r][k]["ok"]]
        if not bad:
            results.append(ok(STEP, name))
            continue
        r, k, rec = bad[0]
        shown = what % k if "%s" in what else what
        problem = rec.get("error") or (f"differs from the average of every rank's packet decoded "
                                       f"by your compressor (largest difference "
                                       f"{rec.get('max_error', 0):.3g}), or the ranks disagree")
        results.append(fail(STEP, name, f"{shown} on rank {r}: {problem}.",
                            f"进程 {r} 上 {shown}：{problem}。"))
    return results
