"""The plugin's modules import each other in one direction only (docs/architecture.md): no
circle, lazy imports inside functions included; every arrow runs down the layers, stated by
package; the runtime never imports the cost model (the cost model reads the runtime's
bucketing, not the other way round)."""
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
    assert "hvd_compress.exchange.routes" in edges and edges["hvd_compress.methods.topk"], edges
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# The layers, bottom to top (docs/architecture.md). A module may import its own layer and the
# layers below it, never one above: an arrow that runs back up fails here. The pure layers
# (codecs, registry, costmodel, the bucketing it reads) need neither torch's runtime nor Horovod.
LAYERS = [
    ("codecs",),                       # pure functions of bits
    ("registry",),                     # one entry per scheme; no torch
    ("roles",),                        # the contract: compressor, memory, communicator
    ("compressors",),                  # one file per scheme, on the codecs
    ("engine",),                       # the collectives: Horovod's or torch.distributed's
    ("exchange",),                     # buckets, routes, error feedback
    ("costmodel",),                    # alpha-beta model; reads codecs.formats, exchange.bucketing
    ("methods",),                      # top-k, PowerSGD: communicators of their own
    ("auto",),                         # Compression.auto: measure, plan, exchange by the plan
    ("compression",),                  # the Compression namespace a user names
    ("front",),                        # the front core every front shares
    ("overlap",),                      # schedule="overlap": a bucket's update as it arrives
    ("optimizer", "ddp", "fsdp"),      # the fronts: DistributedOptimizer, DDP's comm hook, FSDP2's reduce-scatter
]


def within(module, names):
    """Is `module` one of `names` or inside one of them (a package)? By whole dotted names:
    'hvd_compress.auto.planner' is not inside 'hvd_compress.auto.plan'."""
    return any(module == name or module.startswith(name + ".") for name in names)


def test_within_matches_whole_names_only():
    assert within("hvd_compress.auto.planner", ["hvd_compress.auto"])
    assert within("hvd_compress.auto", ["hvd_compress.auto"])
    assert not within("hvd_compress.auto.planner_inputs", ["hvd_compress.auto.planner"])
    assert not within("hvd_compress.costmodelx", ["hvd_compress.costmodel"])


def layer_of(module):
    """The index in LAYERS of `hvd_compress.<package>...` (the package's own __init__ = top)."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and the "
                         "architecture page")


def test_every_arrow_runs_down_the_layers():
    edges = graph()
    assert layer_of("hvd_compress.auto.planner") > layer_of("hvd_compress.costmodel.model")
    wrong = [f"{a} -> {b}" for a, targets in sorted(edges.items()) for b in sorted(targets)
             if layer_of(b) > layer_of(a)]
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_the_checker_sees_an_arrow_that_runs_up():
    assert layer_of("hvd_compress.exchange.routes") > layer_of("hvd_compress.compressors.bit8")
    assert layer_of("hvd_compress.compressors.bit8") < layer_of("hvd_compress.optimizer")


def test_the_cost_model_reads_only_the_pure_layers():
    """The cost model reads the plugin's bucketing, the registry and the codecs' formats, never
    the runtime (torch, Horovod), so its CLI runs on a machine without them."""
    edges = graph()
    allowed = ("hvd_compress.costmodel", "hvd_compress.registry",
               "hvd_compress.exchange.bucketing", "hvd_compress.codecs.formats")
    for name in [m for m in edges if within(m, ["hvd_compress.costmodel"])]:
        wrong = {m for m in edges[name] if not within(m, allowed)}
        assert not wrong, f"{name} imports {sorted(wrong)}"


# The planner (its entry and the modules of its jobs), its inputs and records, the trial's
# decisions, the CLI.
PURE_AUTO = ("hvd_compress.auto.planner", "hvd_compress.auto.measurements",
             "hvd_compress.auto.candidates", "hvd_compress.auto.options",
             "hvd_compress.auto.timeline", "hvd_compress.auto.search", "hvd_compress.auto.replan",
             "hvd_compress.auto.inputs", "hvd_compress.auto.cli", "hvd_compress.auto.records",
             "hvd_compress.auto.trial", "hvd_compress.auto.convergence")


def test_the_planner_and_its_cli_stand_on_nothing_of_the_runtime():
    """The planner, its inputs, the trial's decisions and the CLI import only each other, the cost
    model and the pure layers, so `python -m hvd_compress.auto` runs without the runtime. Only
    the auto communicator and calibration touch torch and Horovod."""
    edges = graph()
    allowed = PURE_AUTO + ("hvd_compress.costmodel", "hvd_compress.registry",
                           "hvd_compress.exchange.bucketing", "hvd_compress.codecs.formats")
    for name in PURE_AUTO:
        assert name in edges, name
        # the package itself (its __init__, lazy) is allowed; its runtime modules are not
        wrong = {m for m in edges[name] if m != "hvd_compress.auto" and not within(m, allowed)}
        assert not wrong, f"{name} imports {sorted(wrong)}"


def test_autos_settings_reach_the_runtime_only_when_asked_for_a_communicator():
    """Compression.auto's settings (auto/settings.py, imported with the Compression namespace)
    import only pure modules at the top; the communicator they declare (torch, Horovod) is
    imported inside `Auto.communicator`, when the optimizer asks for it."""
    path = PACKAGE / "auto" / "settings.py"
    tree = ast.parse(path.read_text())
    top = {node.module or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
           for alias in node.names}
    assert top == {"registry", "planner", "convergence"}, top
    lazy = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node not in tree.body]
    assert {n.module for n in lazy} == {"communicator", "codecs"}


def test_only_the_planner_reaches_the_cost_model_from_the_runtime():
    """The runtime (communicators, optimizer, auto's communicator and calibration) predicts
    through the planner; none of them imports the cost model itself."""
    edges = graph()
    runtime = [m for m in edges if not within(m, ("hvd_compress.costmodel",) + PURE_AUTO)]
    assert "hvd_compress.exchange.fusion" in runtime and "hvd_compress.auto.calibration" in runtime
    assert "hvd_compress.auto.planner" in edges["hvd_compress.auto.calibration"]
    for name in runtime:
        wrong = {m for m in edges[name] if within(m, ["hvd_compress.costmodel"])}
        assert not wrong, f"{name} imports {sorted(wrong)}"


def test_tensorwise_builds_on_the_shared_exchange():
    """top-k and PowerSGD share Exchange and the communicator frame with the packet routes."""
    from hvd_compress.exchange import base
    from hvd_compress.methods import tensorwise
    assert issubclass(tensorwise.TensorwiseCommunicator, base.CommunicatorBase)
    source = (PACKAGE / "methods" / "tensorwise.py").read_text()
    assert "class Step" not in source and "def reduce(" not in source


def test_every_fit_lives_in_the_cost_model():
    """The planner fits nothing itself: its fits are the cost model's objects (costmodel/fit.py,
    costmodel/affine.py), and no module of the auto package defines a fit_* function."""
    from hvd_compress.auto import planner
    from hvd_compress.costmodel import affine, fit
    assert planner.fit_links is fit.fit_links and planner.BETA_FLOOR == fit.BETA_FLOOR
    assert planner.fit_affine is affine.fit_affine and planner.Affine is affine.Affine
    defined = [f"{path.name}: {node.name}" for path in sorted((PACKAGE / "auto").glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name.lstrip("_").startswith("fit")]
    assert not defined, defined
