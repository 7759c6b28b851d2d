"""What a test's kind allows it to start, checked while it runs (tests/kinds.py declares the
kinds): subprocess launches read from their command line, and Horovod's init.  Plain Python,
no pytest: tests/kinds_site/sitecustomize.py runs the same checks in the processes a test starts.
"""
import importlib.abc
import os
import re
import shlex
import shutil
import subprocess
import sys

RANK_LAUNCHERS = {"horovodrun", "mpirun", "mpiexec", "orterun", "prterun", "gloorun"}
INFO_FLAGS = {"--version", "-V", "--help", "-h"}      # `mpirun --version` starts no rank
WRAPPERS = {"env", "nice", "nohup", "setsid", "timeout", "stdbuf", "sudo", "exec"}
# labs.netem asked only for help builds nothing; every command probes with a namespace first
# (even `commands`, which prints the ip/tc lines a cluster would run).
NETEM_READ_ONLY = {"-h", "--help"}
# What builds: a compiler or a build tool (torch's cpp_extension starts ninja for the kernel),
# pip and venv (a wheel, a virtualenv), a set-up script (the project's or a classroom kit's).
BUILDERS = {"pip", "pip3", "virtualenv", "ninja", "cmake", "make", "c++", "g++", "gcc", "cc",
            "clang", "clang++"}
BUILD_MODULES = ("pip", "venv", "virtualenv", "build", "hvd_compress.codecs.native")
# A Python interpreter of its own: it imports again what pytest has loaded (torch alone takes
# seconds), which is what a one-process test does not pay. Sandboxes run one after `--`.
PYTHON = re.compile(r"python[0-9.]*$")
SANDBOXES = {"bwrap", "setpriv"}


class KindError(RuntimeError):
    """A test did what its kind marker rules out."""


# ---- what a command does, read from its argv ------------------------------------------------

def _argv(args):
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args)
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()
    return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


def _netem_subcommand(argv):
    """The labs.netem subcommand `argv` runs (`python -m labs.netem X`, labs/netem/cli.py X),
    or None when it runs no labs.netem."""
    for i, word in enumerate(argv):
        if word == "-m" and i + 1 < len(argv) and argv[i + 1] in ("labs.netem", "labs.netem.cli"):
            rest = argv[i + 2:]
            return rest[0] if rest else ""
        if word.endswith(("labs/netem/__main__.py", "labs/netem/cli.py")):
            rest = argv[i + 1:]
            return rest[0] if rest else ""
    return None


def _script_kind(script):
    """launch_kind of the first command of a shell line that has one."""
    for part in re.split(r"&&|\|\||[;|&\n]", script):
        found = launch_kind(part.strip())
        if found:
            return found
    return None


def _runs_python(argv):
    """Whether argv starts a Python interpreter: python itself, a script whose first line
    names python (a console script, an executable .py), or either inside a sandbox."""
    program = os.path.basename(argv[0])
    if program in SANDBOXES and "--" in argv[:-1]:
        rest = argv[len(argv) - argv[::-1].index("--"):]
        return bool(rest) and _runs_python(rest)
    if PYTHON.match(program) or os.path.realpath(argv[0]) == os.path.realpath(sys.executable):
        return True
    path = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
    try:
        with open(path, "rb") as script:
            first = script.readline(200)
    except (OSError, TypeError):
        return False
    return first.startswith(b"#!") and b"python" in first


def launch_kind(args, shell=False):
    """'multiprocess' if the command starts Horovod ranks, 'netns' if it builds or enters
    network namespaces, 'build' if it compiles, runs pip or venv or a set-up script,
    'interpreter' if it starts any other Python interpreter, None otherwise.  `shell`: args is
    a shell line (Popen's shell=True)."""
    if shell:
        return _script_kind(os.fsdecode(args) if not isinstance(args, (list, tuple))
                            else " ".join(map(str, args)))
    argv = _argv(args)
    while argv and (os.path.basename(argv[0]) in WRAPPERS or "=" in argv[0]
                    or argv[0].startswith("-") or argv[0].replace(".", "").isdigit()):
        argv = argv[1:]                     # env A=1 ..., timeout 60 ..., nice -n 5 ...
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program in ("ip",) and ("netns" in argv or "-n" in argv or "-netns" in argv):
        return "netns"
    if program in ("nsenter", "unshare") or (program == "tc" and "-n" in argv):
        return "netns"
    netem = _netem_subcommand(argv)
    if netem is not None and netem not in NETEM_READ_ONLY:
        return "netns"
    if program in RANK_LAUNCHERS and not set(argv[1:]) <= INFO_FLAGS:
        return "multiprocess"
    if any(a == "-m" and b.startswith(("horovod.runner", "labs.kit.horovodrun"))
           for a, b in zip(argv, argv[1:])):
        return "multiprocess"
    if program in ("sh", "bash", "dash") and "-c" in argv[:-1]:
        return _script_kind(argv[argv.index("-c") + 1])
    if set(argv[1:]) <= INFO_FLAGS and len(argv) > 1:
        return None                         # `ninja --version`, `pip --help`: nothing built
    if program in BUILDERS or program.removesuffix(".exe") in BUILDERS:
        return "build"
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and argv[i + 1] in BUILD_MODULES:
            return None if argv[i + 2:] and set(argv[i + 2:]) <= INFO_FLAGS else "build"
    if program in ("sh", "bash", "dash") and any(os.path.basename(a) == "setup.sh" for a in argv[1:]):
        return "build"
    if _runs_python(argv):
        return "interpreter"
    return None


# Each kind allows its own launches and those of the kinds below it: unit < interpreter <
# build < multiprocess < netns (a multi-rank test may build the kernel its ranks load).
ALLOWED = {"unit": set(), "interpreter": {"interpreter"},
           "build": {"interpreter", "build"},
           "multiprocess": {"interpreter", "build", "multiprocess"},
           "netns": {"interpreter", "build", "multiprocess", "netns"}}
# The test now running (tests/kinds.py sets it around each test; in a child process,
# start_in_child from the environment); `report`: the file a child writes its refusal to.
_running = {"kind": None, "test": None, "report": None}


def _refuse(what, needs):
    kind, test = _running["kind"], _running["test"]
    where = "" if _running["report"] is None else f" (in child process {os.getpid()})"
    message = (f"{test} is marked `{kind}` but{where} {what}: mark it `@pytest.mark.{needs}` "
               f"(tests/kinds.py)")
    if _running["report"] is not None:
        with open(_running["report"], "a") as report:
            report.write(message + "\n")
    raise KindError(message)


def _guarded_popen_init(original):
    def __init__(self, args, *rest, **kwargs):
        kind = _running["kind"]
        if kind is not None:
            needs = launch_kind(args, shell=kwargs.get("shell", False))
            if needs and needs not in ALLOWED[kind]:
                line = args if isinstance(args, str) else shlex.join(_argv(args))
                _refuse(f"starts {line[:200]!r}", needs)
        original(self, args, *rest, **kwargs)
    __init__.__wrapped__ = original
    return __init__


def _guarded_hvd_init(original):
    def init(self, *args, **kwargs):
        if _running["kind"] in ("unit", "interpreter", "build"):
            _refuse("calls hvd.init()" + ("" if _running["report"] else " in the pytest process"),
                    "multiprocess")
        return original(self, *args, **kwargs)
    init.__wrapped__ = original
    return init


def install_guards():
    """Wrap subprocess.Popen and Horovod's init once, before any test module imports
    horovod.torch (which binds `hvd.init` to HorovodBasics.init when it is first imported).
    The wrappers do nothing while no test runs."""
    if not hasattr(subprocess.Popen.__init__, "__wrapped__"):
        subprocess.Popen.__init__ = _guarded_popen_init(subprocess.Popen.__init__)
    if BASICS in sys.modules:
        _guard_basics(sys.modules[BASICS])
    elif not any(isinstance(f, _GuardOnImport) for f in sys.meta_path):
        # Wrapped when first imported, not imported here: a process that never touches
        # Horovod (a test of what a module imports, say) must not find it loaded.
        sys.meta_path.insert(0, _GuardOnImport())


BASICS = "horovod.common.basics"


def _guard_basics(module):
    if not hasattr(module.HorovodBasics.init, "__wrapped__"):
        module.HorovodBasics.init = _guarded_hvd_init(module.HorovodBasics.init)


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Finds horovod.common.basics through the other finders and wraps its HorovodBasics.init
    once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != BASICS:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _guard_basics(module)
                spec.loader.exec_module = exec_module
                return spec
        return None


# ---- the same checks in the Python processes a test starts ----------------------------------

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kinds_site")
ENV = ("HVD_COMPRESS_TEST_KIND", "HVD_COMPRESS_TEST_ID", "HVD_COMPRESS_KIND_REPORT")


def child_environ(kind, test, report):
    """os.environ changes that make every Python process the test starts run the same checks
    (tests/kinds_site/sitecustomize.py), writing a refusal to `report` too: its KindError may
    end inside a launcher the test expects to fail.  None for netns (nothing to check)."""
    if kind not in ("unit", "interpreter", "build", "multiprocess"):
        return {}
    here = os.path.dirname(SITE)
    path = os.environ.get("PYTHONPATH")
    return {"HVD_COMPRESS_TEST_KIND": kind, "HVD_COMPRESS_TEST_ID": test,
            "HVD_COMPRESS_KIND_REPORT": str(report),
            "PYTHONPATH": os.pathsep.join([SITE, here] + ([path] if path else []))}


def start_in_child():
    """In a process a test started (sitecustomize): the test's kind from the environment. A
    `unit` test's child is itself what the kind rules out, however it was started (a shell
    line, multiprocessing's spawn): it says so in the report, which fails the test, and runs
    on (an exception here would only be printed)."""
    if os.environ.get("HVD_COMPRESS_TEST_KIND") in ALLOWED:
        _running.update(kind=os.environ["HVD_COMPRESS_TEST_KIND"],
                        test=os.environ.get("HVD_COMPRESS_TEST_ID", "a test"),
                        report=os.environ.get("HVD_COMPRESS_KIND_REPORT"))
        install_guards()
        if _running["kind"] == "unit":
            try:
                _refuse(f"runs {shlex.join([sys.executable] + sys.argv)[:200]!r}, a Python "
                        f"interpreter of the test's own", "interpreter")
            except KindError:
                pass
