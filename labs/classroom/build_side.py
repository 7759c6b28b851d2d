"""Step 3b's build, inside the kit's sandbox: the first task its fork server runs, as the
sandbox's user, with no network, before any other run of the kit.

    python build_side.py build JOB OUT        (forked by fork_server.py, from /grader)

JOB: {"route": "python" | "full", "patches": [the patches, in series order, as the grader
read and wrote them again: patchfile.text], "source": the pristine sdist (/horovod-src),
"package": the venv's horovod/ (stock Horovod, inside), "site": where the kit's Horovod goes
(first on the later runs' sys.path), "jobs": make's -j}. OUT/result.json says how it went:
{"ok": true} or {"ok": false, "error": [the last lines that say why]}.

route "python" (the course patch changes Horovod's Python files only, the given patches are
the project's): the files it names are copied from the sdist and patched, and the site is a
folder of links to the venv's Horovod (whose C++ is the given patches') with the patched files
in their places: a second. route "full" (anything else): the whole sdist patched and built
into a wheel with the project's flags (scripts/setup.sh's), installed into the site: minutes.
The student's code (Horovod's setup.py, CMake files, C++) runs here, in this sandbox only.

Standalone: the standard library and `patch`, `pip`, a C++ toolchain.
"""
import json
import os
import re
import shutil
import subprocess
import sys

WORK = "/tmp/hvd-build"


def _patched_paths(patch_path):
    """(path, "create" | "delete" | "modify") of each file a patchfile.text diff names."""
    found, old = [], None
    with open(patch_path, encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("--- "):
                old = line[4:].rstrip("\n")
            elif line.startswith("+++ ") and old is not None:
                new = line[4:].rstrip("\n")
                kind = "create" if old == "/dev/null" else "delete" if new == "/dev/null" else "modify"
                found.append(((new if kind != "delete" else old)[2:], kind))
                old = None
    return found


def _apply(src, patch_path):
    """`patch` on the grader's rewriting of the kit's patch; None, or the lines that say why not."""
    done = subprocess.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch",
                           "-d", src, "-i", patch_path], capture_output=True, text=True, timeout=120)
    print(done.stdout + done.stderr, flush=True)
    if done.returncode == 0:
        return None
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return [f"{os.path.basename(patch_path)}: {line}" for line in lines[-3:]] or ["patch failed"]


def python_route(job):
    src = os.path.join(WORK, "src")
    touched = {}
    for patch_path in job["patches"]:
        for path, kind in _patched_paths(patch_path):
            touched[path] = kind
            pristine = os.path.join(job["source"], path)
            if os.path.isfile(pristine) and not os.path.exists(os.path.join(src, path)):
                os.makedirs(os.path.dirname(os.path.join(src, path)), exist_ok=True)
                shutil.copyfile(pristine, os.path.join(src, path))
        error = _apply(src, patch_path)
        if error:
            return error
    tree = os.path.join(job["site"], "horovod")
    package = job["package"]
    for top, dirs, names in os.walk(package):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(top, package)
        os.makedirs(os.path.join(tree, rel), exist_ok=True)
        for name in names:
            os.symlink(os.path.join(top, name), os.path.join(tree, rel, name))
    for path in touched:
        if not path.startswith("horovod/"):
            continue
        dest = os.path.join(tree, os.path.relpath(path, "horovod"))
        if os.path.lexists(dest):
            os.unlink(dest)
        patched = os.path.join(src, path)
        if os.path.isfile(patched):
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(patched, dest)
    return None


# scripts/setup.sh's build of Horovod: PyTorch, MPI and Gloo, no TensorFlow or MXNet
BUILD_ENV = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITHOUT_TENSORFLOW": "1",
             "HOROVOD_WITHOUT_MXNET": "1", "HOROVOD_WITH_MPI": "1", "HOROVOD_WITH_GLOO": "1",
             "HOROVOD_CPU_OPERATIONS": "", "CCACHE_DISABLE": "1", "PIP_NO_CACHE_DIR": "1",
             "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


# pip's own lines around a failed build: the build's first errors say more
PIP_NOISE = ("subprocess-exited-with-error", "Failed building wheel", "Failed to build",
             "metadata-generation-failed", "legacy-install-failure", "╰─>", "× ", "note: ")


def full_route(job):
    src = os.path.join(WORK, os.path.basename(job["source"]))
    shutil.copytree(job["source"], src, symlinks=True)
    for patch_path in job["patches"]:
        error = _apply(src, patch_path)
        if error:
            return error
    env = {**os.environ, **BUILD_ENV, "MAKEFLAGS": f"-j{int(job.get('jobs', 2))}"}
    for argv, cwd in (([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "-w", os.path.join(WORK, "wheel"), "."], src),
                      ([sys.executable, "-m", "pip", "install", "--no-deps", "--target", job["site"],
                        "--find-links", os.path.join(WORK, "wheel"), "horovod"], WORK)):
        done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        print(done.stdout[-200000:], flush=True)
        if done.returncode != 0:
            lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
            first = [line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)
                     and not any(noise in line for noise in PIP_NOISE)]
            return first[:3] or lines[-3:] or [f"{argv[3]} failed"]
    return None


def main(argv):
    _, mode, job_path, out_dir = argv[:4]
    if mode != "build":
        sys.exit(f"unknown mode {mode}")
    with open(job_path) as handle:
        job = json.load(handle)
    shutil.rmtree(WORK, ignore_errors=True)
    shutil.rmtree(job["site"], ignore_errors=True)
    os.makedirs(WORK)
    try:
        error = (python_route if job["route"] == "python" else full_route)(job)
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        error = [f"{type(err).__name__}: {err}"]
    with open(os.path.join(out_dir, "result.json"), "w") as handle:
        json.dump({"ok": error is None, "error": error}, handle)
    if error:
        sys.exit(1)
    shutil.rmtree(WORK, ignore_errors=True)     # the sandbox's disk: the site alone is kept


if __name__ == "__main__":
    main(sys.argv)
