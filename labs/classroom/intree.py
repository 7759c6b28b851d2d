"""Step 3b: the student's patched Horovod, then a plain Horovod script on 2 ranks through it
(the student side's `intree` part, inside the kit's 2-rank sandbox).

The route is checked, not only the result: the patch's Compression.bit8/.bit16 must resolve
to the kit's own compression.py (`import compression`), never to the project's hvd_compress;
the ranks report what hvd.Compression.bit8 resolved to.

The grader reads the kit's patches itself (patchfile.py: bounded, no link, a parser of its
own) and refuses, with a reason for the student, a patch that names anything but a file of
Horovod 0.28.1's tree, a link, a special file, or a binary patch. What it understood is
written again as a plain diff and sent into the kit's sandbox, where the build side
(build_side.py, the sandbox's first task, as the sandbox's user, no network) applies it to
the sdist's pristine files and makes the student's Horovod: nothing of a kit's patch is
applied, built or run on the grader's side, and no Horovod of one kit is kept for another.

Two routes. A course patch that changes only Horovod's Python files (the course's hook points
are all Python), with the given patches the project's: its files patched over the venv's
Horovod (whose C++ is the given patches'), a folder of links first on the later runs'
sys.path, made in a second. Any other patch series: the whole sdist patched and built with the
project's flags inside the sandbox (minutes; build_timeout).
"""
import functools
import json
import os
import re
import tarfile
from dataclasses import dataclass, field

from . import nofollow, patchfile, pristine
from .checks import fail, ok
from .kit import COURSE_PATCH, GIVEN_PATCHES, ROOT
from .kit_runs import Task, build_side

STEP = "intree"
HOOKS = ("horovod/torch/compression.py", "horovod/torch/mpi_ops.py", "horovod/torch/optimizer.py")
REFERENCE_WORDS = ("hvd_compress", "labs.classroom", "solution_files")
SITE = "/tmp/hvd-site"                  # inside the kit's sandbox: its own Horovod, built there
SERIES_LIMIT = 1 << 16
SERIES_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
PYTHON_ROUTE_S = 120                    # the Python-only route's build: a copy and `patch`
COMPILER_BYTES = 5 << 29                # a compiler's peak on Horovod's torch sources (2.3 GB), and some


@functools.lru_cache(maxsize=None)
def _sdist_tree(path, mtime):
    """patchfile.Tree of the sdist's member list (no unpacking)."""
    files, folders = set(), set()
    top = pristine.TOP + "/"
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            if not member.name.startswith(top):
                continue
            name = member.name[len(top):].rstrip("/")
            if member.isfile():
                files.add(name)
            elif member.isdir() and name:
                folders.add(name)
    return patchfile.Tree.of(files, folders)


def sdist_tree():
    archive = pristine.sdist()
    if not archive.is_file():
        raise pristine.PristineError(f"no Horovod sdist at {archive} (scripts/setup.sh downloads it)")
    return _sdist_tree(str(archive), archive.stat().st_mtime_ns)


def read_patch(kit, name, tree):
    """[FileDiff] of the kit's patches/NAME, read by the grader (nofollow: bounded, no link, no
    FIFO or device) and parsed (patchfile: paths inside Horovod's tree only); [] when it is
    missing. Raises patchfile.PatchError with the student's reason."""
    shown = f"patches/{name}"
    data, why = nofollow.read(kit, shown, patchfile.MAX_BYTES)
    if data is None:
        if why.endswith("is missing"):
            return []
        limit = f" (at most {patchfile.MAX_BYTES >> 10} KiB)" if "larger than" in why else ""
        raise patchfile.PatchError(f"the grader does not read {why}{limit}: hand in the patch "
                                   f"itself, a regular file of text.",
                                   f"评分器不读取 {why}：请提交补丁本身（普通文本文件）。")
    diffs = patchfile.parse(patchfile.decode(data, shown), shown)
    patchfile.check_tree(diffs, tree, shown)
    return diffs


def _route_failure(files):
    """The route check of the course patch's added lines (None: it routes to the kit)."""
    missing = [hook for hook in HOOKS if hook not in files]
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
    return None


def _course_diffs(kit):
    """(diffs, None) of the course patch, or (None, the failing intree.patch check)."""
    try:
        diffs = read_patch(kit, COURSE_PATCH, sdist_tree())
    except patchfile.PatchError as err:
        return None, fail(STEP, "intree.patch", err.en, err.zh)
    if not diffs:
        return None, fail(STEP, "intree.patch", f"patches/{COURSE_PATCH} holds no diff yet: write the "
                          f"course's change (its text says where: {', '.join(HOOKS)}).",
                          f"patches/{COURSE_PATCH} 中还没有 diff：请写出课程的修改（见文件说明）。")
    files = {}
    for diff in diffs:
        files.setdefault(diff.path, []).extend(diff.added())
    return diffs, _route_failure(files)


def patch_check(kit):
    """The course's patch is a diff of Horovod's files that touches the three hook points, and
    its Compression.bit8/.bit16 route to the kit's own compression.py."""
    _, failure = _course_diffs(kit)
    return failure or ok(STEP, "intree.patch")


def _given_are_the_projects(kit):
    """The kit's series and given patches are byte for byte the project's."""
    for name in GIVEN_PATCHES:
        data, _ = nofollow.read(kit, f"patches/{name}", patchfile.MAX_BYTES)
        if data is None or data != (ROOT / "patches" / name).read_bytes():
            return False
    return True


def _series(kit, course):
    """[(name, patchfile.text)] of the kit's patches/series, in its order, each read and checked
    against Horovod's tree as the patches before it leave it. Raises PatchError."""
    data, why = nofollow.read(kit, "patches/series", SERIES_LIMIT)
    if data is None:
        raise patchfile.PatchError(f"patches/series is not read: {why}.", f"patches/series 无法读取：{why}。")
    names = [line.strip() for line in patchfile.decode(data, "patches/series").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    tree, found = sdist_tree(), []
    for name in names:
        if not SERIES_NAME.fullmatch(name) or name.startswith("."):
            raise patchfile.PatchError(f"patches/series names {name[:80]!r}: a series names patch "
                                       f"files in patches/ (plain names, no folders).",
                                       f"patches/series 中的 {name[:80]!r} 不是 patches/ 中的文件名。")
        diffs = course if name == COURSE_PATCH else read_patch(kit, name, tree)
        tree = tree.after(diffs)
        if diffs:
            found.append((name, patchfile.text(diffs)))
    return found


@dataclass
class Prepared:
    """A kit's in-tree route up to the script: its checks so far, and how its Horovod is made."""
    checks: list                # intree.patch (and intree.build once built), or all four when one failed
    ready: bool = False         # the patch passed (and, after built(), the build): the script is to run
    site: str = None            # PYTHONPATH entry (first), inside the sandbox, for the student's Horovod
    route: str = ""             # "python" or "full"
    patches: list = field(default_factory=list)     # [(name, patchfile.text)] in series order


NAMES = ["intree.build", "intree.allreduce", "intree.optimizer"]


def _not_built(first, en, zh):
    return Prepared([first, fail(STEP, "intree.build", en, zh)] +
                    [fail(STEP, n, "not checked: the build failed.", "未检查：构建失败。") for n in NAMES[1:]])


def prepare(kit):
    """The patch check, and what the kit's sandbox must build (build_task): nothing of the
    kit's patches runs here."""
    diffs, failure = _course_diffs(kit)
    if failure is not None:
        return Prepared([failure] + [fail(STEP, n, "not checked: the patch does not pass.",
                                          "未检查：补丁未通过。") for n in NAMES])
    first = ok(STEP, "intree.patch")
    if _given_are_the_projects(kit) and all(d.path.startswith("horovod/") and d.path.endswith(".py")
                                            for d in diffs):
        return Prepared([first], True, SITE, "python", [(COURSE_PATCH, patchfile.text(diffs))])
    try:
        series = _series(kit, diffs)
    except patchfile.PatchError as err:
        return _not_built(first, f"Horovod is not built with your patches: {err.en}",
                          f"Horovod 未用你的补丁构建：{err.zh}")
    return Prepared([first], True, SITE, "full", series)


def build_task(prepared, seconds, memory=4 << 30):
    """The kit's sandbox's first task: its Horovod made from `prepared`'s patches (build_side).
    As many compilers at once as the sandbox's memory holds (one, in 4 GiB: its files and the
    fork server take the rest)."""
    files = {f"patch{i}-{name}": text for i, (name, text) in enumerate(prepared.patches)}
    jobs = max(1, min(os.cpu_count() or 1, (memory - (1 << 30)) // COMPILER_BYTES))
    job = {"route": prepared.route, "patches": [f"/grader/{name}" for name in files],
           "source": pristine.SOURCE_INSIDE, "package": str(pristine.installed()),
           "site": prepared.site, "jobs": jobs}
    files["build.json"] = json.dumps(job)
    limit = min(seconds, PYTHON_ROUTE_S) if prepared.route == "python" else seconds
    return Task("build", "build", build_side("build", "/grader/build.json", "/out/build")[1:],
                limit, files=files)


def built(prepared, run, read_limit=1 << 16):
    """`prepared` once its sandbox's build task has run (`run`): intree.build passed, or failed
    with the build's own last lines."""
    first = prepared.checks[0]
    how = ("Horovod's Python files do not take your patch" if prepared.route == "python" else
           "Horovod does not build with your patches")
    if run is None:
        return _not_built(first, f"{how}: the kit could not be copied into its sandbox.",
                          "Horovod 无法构建：实验包无法复制进沙箱。")
    from .sandbox import read_bytes
    raw = read_bytes(run.out / "result.json", read_limit, root=run.root or run.out)
    try:
        result = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, ValueError):
        result = {}
    left = run.outcome.left_behind
    if run.outcome.status == 0 and not run.outcome.killed_by and result.get("ok") is True:
        return Prepared([first, ok(STEP, "intree.build", left_behind=left)], True, prepared.site,
                        prepared.route, prepared.patches)
    error = result.get("error") if isinstance(result, dict) else None
    lines = [str(line)[:300] for line in error[:3]] if isinstance(error, list) and error else []
    if run.outcome.killed_by or not lines:
        lines = [f"the build {run.outcome.how()}"] + lines
    text = " / ".join(lines)
    en, zh = f"{how}: {text}.", f"Horovod 无法用你的补丁构建：{text}。"
    if left:                            # fork_server.stop_the_detached
        en += (f" ({left} process{'es' if left > 1 else ''} the build left running on "
               f"{'their' if left > 1 else 'its'} own {'were' if left > 1 else 'was'} stopped when "
               f"found: a build waits for what it starts.)")
        zh += f"（构建留下的 {left} 个独自运行的进程被发现后已终止：构建应等待它启动的进程结束。）"
    return _not_built(first, en, zh)


def build(kit, work, seconds=1800):
    """intree's first two checks of one kit, its Horovod built in a sandbox of its own
    (`python -m labs.classroom build KIT`)."""
    from .kit_runs import release, run_tasks
    prepared = prepare(kit)
    if not prepared.ready:
        return prepared.checks
    try:
        runs = run_tasks(kit, work, [build_task(prepared, seconds)])
        return built(prepared, runs["build"] if runs else None).checks[:2]
    finally:
        release(work)


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
