"""The plugin's modules import each other in one direction only (docs/extending.md, DESIGN):
no circle, lazy imports inside functions included, and the runtime never imports the cost
model (the cost model reads the runtime's bucketing, not the other way round)."""
import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "hvd_compress"


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules():
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name, path, known):
    """hvd_compress.* modules that `name` imports anywhere in its source (ast.walk: functions'
    bodies too), resolved to modules: `from . import x` is module x when x is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(edges):
    """A list of modules forming a circle, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_among_the_plugins_modules():
    edges = graph()
    assert "hvd_compress.communicators" in edges and edges["hvd_compress.topk"], edges
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


PLANNING = ("hvd_compress.costmodel", "hvd_compress.planner", "hvd_compress.plan_cli")


def test_the_runtime_reaches_the_cost_model_only_through_the_planner():
    edges = graph()
    # The planner predicts steps on the cost model's timeline (docs/planner.md): it stands on the
    # cost model, and the runtime (Compression.auto's communicator) stands on the planner, as
    # DESIGN layers them (optimizer, planner, communicators, ...). No runtime module imports
    # the cost model itself (optimizer, communicators, fusion, codecs, autocomm, calibration).
    runtime = [m for m in edges if not m.startswith(PLANNING)]
    assert "hvd_compress.fusion" in runtime and "hvd_compress.communicators" in runtime
    assert "hvd_compress.planner" in edges["hvd_compress.calibration"]
    for name in runtime:
        wrong = {m for m in edges[name] if m.startswith("hvd_compress.costmodel")}
        assert not wrong, f"{name} imports {sorted(wrong)}"


def test_the_planner_and_the_cost_model_stand_on_nothing_of_the_runtime():
    """Pure (no torch, no Horovod): they import only each other, the registry, the bucketing and
    the codecs' formats, so plan_cli and the cost model's CLI run without the runtime."""
    edges = graph()
    allowed = ("hvd_compress.costmodel", "hvd_compress.planner", "hvd_compress.registry",
               "hvd_compress.bucketing", "hvd_compress.codecs.formats")
    for name in [m for m in edges if m.startswith(PLANNING[:2])]:
        wrong = {m for m in edges[name] if not m.startswith(allowed)}
        assert not wrong, f"{name} imports {sorted(wrong)}"


def test_tensorwise_builds_on_the_shared_exchange():
    """top-k and PowerSGD share Exchange and the communicator frame with the packet routes."""
    from hvd_compress import exchange, tensorwise
    assert tensorwise.Step is exchange.Exchange
    assert issubclass(tensorwise.TensorwiseCommunicator, exchange.CommunicatorBase)
    source = (PACKAGE / "tensorwise.py").read_text()
    assert "class Step" not in source and "def reduce(" not in source
