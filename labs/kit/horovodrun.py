"""horovodrun, with its build check answered once per Horovod build instead of once per launch.

    python -m labs.kit.horovodrun -np 2 --gloo python train.py     # same flags as horovodrun

Before it starts a rank, every `horovodrun` asks whether Horovod was built with the controller
asked for (gloo_built() / mpi_built()), and answers by forking a process that imports each
framework's extension in turn: tensorflow's (absent here), then horovod.torch, that is torch,
about 2 s of one core on the 2-core test machine, on the critical path of every launch and
paid again by each rank a moment later. The answer depends only on the build, so it is kept
in the venv beside the extension's identity (path, size, modification time) and asked again
when the build changes. Everything else is horovodrun's own code (run_commandline).
"""
import json
import os
import subprocess
import sys

CACHE = os.path.join(sys.prefix, "horovod-build-check.json")
ASK = ("import horovod.torch as hvd, json; "
       "print(json.dumps({'mpi': bool(hvd.mpi_built()), 'gloo': bool(hvd.gloo_built())}))")


def _build_identity():
    """The torch extension horovodrun's check would load: its path, size and mtime."""
    import importlib.util
    spec = importlib.util.find_spec("horovod.torch")
    folder = os.path.dirname(spec.origin)
    libs = sorted(f for f in os.listdir(folder) if f.startswith("mpi_lib") and f.endswith(".so"))
    if not libs:
        return None
    path = os.path.join(folder, libs[-1])
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def built_controllers():
    """{'mpi': bool, 'gloo': bool} for this build: from the cache, or asked of horovod.torch in
    a process of its own (as horovodrun does) and cached."""
    identity = _build_identity()
    try:
        with open(CACHE) as f:
            cached = json.load(f)
        if identity and cached.get("build") == identity:
            return cached["built"]
    except (OSError, ValueError, KeyError):
        pass
    done = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True)
    if done.returncode != 0:
        return None                      # horovodrun's own check will say what is wrong
    built = json.loads(done.stdout.strip().splitlines()[-1])
    if identity:
        tmp = f"{CACHE}.{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({"build": identity, "built": built}, f)
            os.replace(tmp, CACHE)
        except OSError:
            pass
    return built


def main():
    from horovod.runner import launch
    built = built_controllers()
    if built is not None:
        launch.gloo_built = lambda verbose=False: built["gloo"]
        launch.mpi_built = lambda verbose=False: built["mpi"]
    sys.argv[0] = "horovodrun"
    sys.exit(launch.run_commandline())


if __name__ == "__main__":
    main()
