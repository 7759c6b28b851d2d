"""The lab room's modules import in one direction, as the plugin's do (tests/test_import_graph.py,
docs/architecture.md): no circle, lazy imports inside functions included, and every arrow runs
down its layers, stated here by package. Beneath every layer of labs/ sits the plugin, which
imports nothing of labs/. No trainer or kit module edits sys.path: they import by package."""
import ast
import functools
from pathlib import Path

import pytest

from test_import_graph import find_cycle, imports_of, module_name, within

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"

# The layers of labs/, bottom to top. A module imports its own layer and those below it (and
# the plugin); never one above. Within a layer, the most specific name decides: the
# collectives benchmark still lives in the emulator's folder, but is a benchmark (it reads the
# kit's run records), and so is its plot.
LAB_LAYERS = [
    ("labs.netem",),                                   # network emulator: namespaces, links,
                                                       # the bridge, launchers, link faults
    ("labs.kit",),                                     # lab kit: data, run records, watchdog,
                                                       # run matrix, report, plots
    ("labs.mnist", "labs.ddp_mnist", "labs.fsdp_mnist",
     "labs.elastic"),                                  # trainers: Horovod, DDP, FSDP2, elastic
    ("labs.bench", "labs.netem.bench", "labs.netem.plots"),  # benchmarks
    ("labs.classroom",),                               # the student's kit and the grader
]


@functools.lru_cache(maxsize=None)
def lab_modules():
    return {module_name(p): p for p in LABS.rglob("*.py")}


@functools.lru_cache(maxsize=None)
def lab_graph():
    """{labs module: the labs and hvd_compress modules it imports} (parsed once: the tests only
    read it)."""
    known = dict(lab_modules())
    plugin = {module_name(p): p for p in (ROOT / "hvd_compress").rglob("*.py")}
    everything = {**known, **plugin}
    return {name: imports_of(name, path, everything) for name, path in known.items()}


def lab_layer_of(module):
    """The index in LAB_LAYERS of the most specific name `module` is within; -1 for the plugin
    (below every layer); len(LAB_LAYERS) for the labs package itself."""
    if within(module, ["hvd_compress"]):
        return -1
    if module == "labs":
        return len(LAB_LAYERS)
    matches = [(len(name), i) for i, names in enumerate(LAB_LAYERS) for name in names
               if within(module, [name])]
    if not matches:
        raise AssertionError(f"{module} is in no layer of labs/: add it to LAB_LAYERS")
    return max(matches)[1]


def test_the_layers_are_read_by_the_most_specific_name():
    assert lab_layer_of("labs.netem.cluster") == 0
    assert lab_layer_of("labs.netem.bench") == lab_layer_of("labs.bench.tta") == 3
    assert lab_layer_of("labs.kit.runlog") == 1 and lab_layer_of("labs.mnist") == 2
    assert lab_layer_of("hvd_compress.costmodel.units") == -1
    assert not within("labs.mnistx", ["labs.mnist"])


def test_no_import_circle_among_the_labs_modules():
    edges = lab_graph()
    assert "labs.kit.runlog" in edges["labs.kit.recorder"], edges["labs.kit.recorder"]
    cycle = find_cycle({a: {b for b in targets if b.startswith("labs")}
                        for a, targets in edges.items()})
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_arrow_in_labs_runs_down_the_layers():
    edges = lab_graph()
    wrong = [f"{a} -> {b}" for a, targets in sorted(edges.items()) for b in sorted(targets)
             if lab_layer_of(b) > lab_layer_of(a)]
    assert not wrong, "imports that run up the layers of labs/:\n" + "\n".join(wrong)


def test_the_checker_sees_an_arrow_that_runs_up():
    """The emulator reading the kit's run records is the arrow that ran back up once (kit ->
    netem -> kit.runlog): the layers refuse it, in the emulator proper."""
    assert lab_layer_of("labs.kit.runlog") > lab_layer_of("labs.netem.launch")
    assert lab_layer_of("labs.kit.matrix") > lab_layer_of("labs.netem")
    assert lab_layer_of("labs.classroom.grade") > lab_layer_of("labs.mnist")


def test_the_emulator_imports_nothing_of_the_lab_kit():
    edges = lab_graph()
    emulator = [m for m in edges if lab_layer_of(m) == 0]
    assert "labs.netem.cluster" in emulator and "labs.netem.bench" not in emulator
    wrong = {m: sorted(t for t in edges[m] if t.startswith("labs") and lab_layer_of(t) != 0)
             for m in emulator}
    assert not any(wrong.values()), wrong


def test_the_plugin_imports_nothing_of_labs():
    plugin = {module_name(p): p for p in (ROOT / "hvd_compress").rglob("*.py")}
    known = {**plugin, **lab_modules()}
    wrong = {name: sorted(m for m in imports_of(name, path, known) if m.startswith("labs"))
             for name, path in plugin.items()}
    assert not any(wrong.values()), {k: v for k, v in wrong.items() if v}


def edits_sys_path(tree):
    """Lines of `tree` that change sys.path (a call on it, or an assignment to it or a slice)."""
    lines = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
        if (isinstance(target, ast.Attribute) and target.attr == "path"
                and isinstance(target.value, ast.Name) and target.value.id == "sys"):
            lines.append(node.lineno)
    return lines


def test_the_checker_sees_a_sys_path_edit():
    source = ("import sys\nsys.path.insert(0, 'x')\nsys.path[1:1] = ['y']\n"
              "sys.path += ['z']\nprint(sys.path)\n")
    assert sorted(edits_sys_path(ast.parse(source))) == [2, 3, 4]


def test_no_trainer_kit_emulator_or_benchmark_edits_sys_path():
    """They import by package: a checkout's set-up puts its root on the venv's path
    (scripts/setup.sh), and a launcher runs them from it. The classroom's sandbox side sets a
    student's kit's path on purpose (its own layer, its own rules)."""
    wrong = {}
    for name, path in lab_modules().items():
        if within(name, ["labs.classroom"]):
            continue
        lines = edits_sys_path(ast.parse(path.read_text()))
        if lines:
            wrong[name] = lines
    assert not wrong, f"modules that edit sys.path (module: lines): {wrong}"
