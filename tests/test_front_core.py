"""The front core (hvd_compress/front/core.py) in one process: what both fronts share, checked
once here (the fronts' own life cycles run on real ranks: tests/workers/, tests/ddp_workers/).

- error feedback's residuals follow their parameters by name when a bucket is bound to other
  parameters, or to the same ones in another order (exchange/memory.py), and a checkpoint
  keeps them by parameter name;
- the communicators declare what they can do, and no module outside exchange/ asks a
  communicator's class;
- error feedback where it cannot be carried is refused, naming every packet scheme;
- Compression.auto(plan=...) reads a plan from a report, a file, a checkpoint's state;
- the DDP hook's old checkpoint names still work, and say they are deprecated."""
import ast
import json
from pathlib import Path

import pytest
import torch

import hvd_compress as hc
from hvd_compress import registry
from hvd_compress.auto.settings import pinned_plan
from hvd_compress.exchange.memory import ResidualMemory
from hvd_compress.front.core import FrontCore, named_params, resolve_compression
from hvd_compress.roles import Communicator

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hvd_compress"


def test_a_residual_follows_its_parameters_when_the_bucket_reorders_them():
    """DDP's rebuild: the same bucket name and size, the parameters in another order."""
    memory = ResidualMemory()
    memory.bind("ddp.0.5", ["a", "b"], [2, 3])
    x = torch.zeros(5)
    memory.remember("ddp.0.5", torch.tensor([1., 2., 3., 4., 5.]), x)   # a: 1 2, b: 3 4 5
    memory.bind("ddp.0.5", ["b", "a"], [3, 2])
    got = memory.compensate("ddp.0.5", torch.zeros(5))
    assert got.tolist() == [3., 4., 5., 1., 2.]
    assert {k: v.tolist() for k, v in memory.state_dict().items()} == {
        "a": [1., 2.], "b": [3., 4., 5.]}


def test_a_residual_follows_its_parameters_into_other_buckets():
    """Members moved between buckets; one that has no residual yet starts from zeros; one of
    another size (a changed parameter) is dropped, not misapplied."""
    memory = ResidualMemory()
    memory.bind("first", ["a", "b"], [1, 2])
    memory.bind("second", ["c"], [2])
    memory.remember("first", torch.tensor([1., 2., 3.]), torch.zeros(3))
    memory.remember("second", torch.tensor([4., 5.]), torch.zeros(2))
    memory.bind("merged", ["c", "a", "new"], [2, 1, 2])
    assert memory.compensate("merged", torch.zeros(5)).tolist() == [4., 5., 1., 0., 0.]
    memory.bind("alone", ["b"], [7])                  # b changed size: its residual is dropped
    assert memory.compensate("alone", torch.zeros(7)).tolist() == [0.] * 7
    assert "first" not in memory.residuals and "second" not in memory.residuals


def test_residuals_reach_a_checkpoints_other_buckets_by_name_and_old_checkpoints_load():
    saved = {"a": torch.tensor([1., 2.]), "b": torch.tensor([3.])}
    memory = ResidualMemory()
    memory.bind("bucket", ["b", "a"], [1, 2])
    memory.load_state_dict(saved)
    assert memory.residuals["bucket"].tolist() == [3., 1., 2.]
    # an optimizer's checkpoint from before: residuals by bucket name, of the bucket's size
    memory.load_state_dict({"bucket": torch.tensor([7., 8., 9.])})
    assert memory.residuals["bucket"].tolist() == [7., 8., 9.]
    # a per-tensor method's residuals (never bound) by the tensor's own name and shape
    own = ResidualMemory()
    own.load_state_dict({"w": torch.ones(2, 2)})
    assert own.compensate("w", torch.zeros(2, 2)).tolist() == [[1., 1.], [1., 1.]]
    assert set(own.state_dict()) == {"w"}


def test_every_communicator_declares_its_capabilities_and_none_is_asked_its_class():
    """No isinstance/issubclass of a concrete communicator class outside exchange/ (the
    fronts, auto and the methods read `capabilities`)."""
    import hvd_compress.auto.communicator  # noqa: F401  (their classes, to name them)
    import hvd_compress.methods.powersgd  # noqa: F401
    import hvd_compress.methods.topk  # noqa: F401

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)
    names = {c.__name__ for c in subclasses(Communicator)}
    assert {"AllgatherCommunicator", "AutoCommunicator", "TopKCommunicator"} <= names
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        if "exchange" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                    "isinstance", "issubclass") and len(node.args) == 2:
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if named & names:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, wrong


def test_the_fronts_ask_no_communicator_what_it_has():
    """The fronts and their core call what roles.Communicator declares (its defaults cover
    what a route has not): no getattr or hasattr on a communicator."""
    for name in ("optimizer.py", "ddp.py", "overlap.py", "front/core.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        probes = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and getattr(node.func, "id", None) in ("getattr", "hasattr")
                  and "comm" in ast.unparse(node.args[0])]
        assert not probes, f"{name}: {probes}"


def test_error_feedback_where_it_cannot_be_carried_names_every_packet_scheme():
    with pytest.raises(ValueError) as refused:
        FrontCore("a front", "fp16", error_feedback=True)
    packet = [s.name for s in registry.schemes().values() if s.packet]
    assert "bf16" in packet and all(name in str(refused.value) for name in packet)
    core = FrontCore("a front", "onebit")             # the method's default: on
    assert core.memory is not None and core.capabilities.takes_memory
    assert FrontCore("a front", "bit8").memory is None
    assert FrontCore("a front", "topk").memory is None         # its own, in its communicator


def test_names_and_values_resolve_alike():
    assert resolve_compression("bit8") is hc.Compression.bit8
    assert resolve_compression("topk").ratio == registry.scheme("topk").parameter
    assert resolve_compression("auto") == hc.Compression.auto
    model = torch.nn.Linear(2, 2)
    named = named_params(torch.optim.SGD(model.parameters(), lr=1).param_groups,
                         model.named_parameters())
    assert [n for n, _ in named] == ["weight", "bias"]
    with pytest.raises(ValueError, match="duplicates"):
        named_params([{"params": list(model.parameters())}],
                     [("w", model.weight), ("w", model.bias)])


def test_one_checkpoint_format_for_every_front():
    core = FrontCore("a front", "bit8", error_feedback=True)
    state = core.state_dict()
    assert state == {"format": 2, "scheme": "bit8/allgather", "steps": 0, "residuals": {}}
    with pytest.raises(ValueError, match="bit8/allgather"):
        FrontCore("a front", "bit16").load_state_dict(state)


def test_a_plan_is_pinned_from_a_report_a_file_or_a_checkpoint(tmp_path):
    report = {"plan": "bit8:allgather none:allreduce", "phase": "planned",
              "buckets": [{"name": "fc.bias", "bytes": 40, "label": "bit8:allgather"},
                          {"name": "conv.bias", "bytes": 8, "label": "none:allreduce"}]}
    want = (("fc.bias", 40, "bit8:allgather"), ("conv.bias", 8, "none:allreduce"))
    assert pinned_plan(report) == want
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan_report": report, "config": "np2-auto"}))   # a manifest
    assert pinned_plan(str(path)) == want and pinned_plan(path) == want
    state = {"format": 2, "communicator": {"auto_plan": {
        "buckets": [["fc.bias", 40], ["conv.bias", 8]],
        "decision": {"ok": True, "labels": ["bit8:allgather", "none:allreduce"]}}}}
    assert pinned_plan(state) == want
    assert hc.Compression.auto(plan=report).plan == want
    assert hc.Compression.auto(plan=report) != hc.Compression.auto     # the ranks compare it
    assert hc.Compression.auto(plan=report)(warmup_steps=3).plan == want
    for bad, match in (({"plan": "", "phase": "measuring", "buckets": []}, "no plan in force"),
                       ([("fc.bias", 40, "topk")], "not a codec of values"),
                       (str(tmp_path / "missing.json"), "cannot read"), ([], "names no bucket")):
        with pytest.raises(ValueError, match=match):
            pinned_plan(bad)
