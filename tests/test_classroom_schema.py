"""What comes back from a kit's sandbox, held to a schema (labs/classroom/schema.py), and the
judging that rests on it, in one process: the sheet's escaping, the grader's copy of the
course's network, the held-out test labels, the packet the compressor checks ask for, the
report's figures against the runs they quote."""
import gzip
import hashlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from labs.classroom import course_net, schema
from labs.classroom import kit as classroom_kit
from labs.classroom.checks import fail, ok
from labs.classroom.compressor_checks import compressor_checks
from labs.classroom.grade import held_out_labels
from labs.classroom.report_checks import report_checks
from labs.classroom.sheet import csv_text, escape, markdown
from labs.classroom.student_side import pack

pytestmark = pytest.mark.unit

KIT_FILES = Path(classroom_kit.KIT_FILES)


# --- the schema's parts ---------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, 1.5, "3", None, -1, 1 << 40])
def test_a_whole_number_is_a_whole_number_in_range(value):
    with pytest.raises(schema.Malformed, match="whole number"):
        schema.Int(0, 1 << 31)(value, "f")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "0.1", True, 1e31])
def test_a_number_is_finite_and_in_range(value):
    with pytest.raises(schema.Malformed, match="finite number"):
        schema.Num()(value, "f")


def test_an_object_keeps_only_the_keys_it_names_and_says_which_is_missing():
    shape = schema.Obj({"a": schema.Int()}, {"b": schema.Text(3)})
    assert shape({"a": 1, "b": "xy", "evil": object()}, "r") == {"a": 1, "b": "xy"}
    with pytest.raises(schema.Malformed, match=r"r: no 'a'"):
        shape({"b": "x"}, "r")
    with pytest.raises(schema.Malformed, match=r"r.b: a text of at most 3"):
        shape({"a": 1, "b": "long"}, "r")
    with pytest.raises(schema.Malformed, match="a list of at most 2"):
        schema.List(schema.Int(), 2)([1, 2, 3], "l")


def test_json_nested_too_deep_or_not_json_is_malformed_never_an_error():
    with pytest.raises(schema.Malformed, match="nested too deep"):
        schema.parse_json(b"[" * 100_000 + b"]" * 100_000, "x.json")
    for raw in (b"{not json", b"\xff\xfe", b"1" * 5000):
        with pytest.raises(schema.Malformed, match="not JSON"):
            schema.parse_json(raw, "x.json")


def test_a_file_is_read_with_a_bound_and_never_through_a_link(tmp_path):
    (tmp_path / "big").write_bytes(b"x" * 100)
    with pytest.raises(schema.Malformed, match="more than the 10 allowed"):
        schema.read_bounded(tmp_path / "big", 10)
    (tmp_path / "link").symlink_to(tmp_path / "big")
    with pytest.raises(schema.Malformed, match="not a regular file"):
        schema.read_bounded(tmp_path / "link", 1000)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(schema.Malformed, match="not a regular file"):
        schema.read_bounded(tmp_path / "fifo", 1000)
    assert schema.read_bounded(tmp_path / "absent", 10) is None


def test_an_npz_is_read_without_pickles_and_with_its_members_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(schema, "NPZ_MEMBERS", 50)
    np.savez(tmp_path / "ok.npz", a=np.arange(3))
    assert list(schema.read_arrays(tmp_path / "ok.npz", 1 << 20)["a"]) == [0, 1, 2]
    np.savez(tmp_path / "pickled.npz", a=np.array([{"x": 1}], dtype=object))
    with pytest.raises(schema.Malformed, match="unreadable"):
        schema.read_arrays(tmp_path / "pickled.npz", 1 << 20)
    np.savez(tmp_path / "many.npz", **{f"a{i}": np.zeros(1) for i in range(schema.NPZ_MEMBERS + 1)})
    with pytest.raises(schema.Malformed, match="arrays, more than"):
        schema.read_arrays(tmp_path / "many.npz", 1 << 30)
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(schema.Malformed, match="unreadable"):
        schema.read_arrays(tmp_path / "junk.npz", 1 << 20)


def _rank_record(**sections):
    arrays = {}
    x = torch.ones(1000)
    entry = {"got": pack(x, arrays, "exchange.bit8.got"), "decoded": pack(x, arrays, "exchange.bit8.decoded")}
    entry16 = {"got": pack(x, arrays, "exchange.bit16.got"), "decoded": pack(x, arrays, "exchange.bit16.decoded")}
    index = {"size": 2, "rank": 0, "exchange": {"Bit8Compressor": entry, "Bit16Compressor": entry16}}
    index.update(sections)
    return index, arrays


def test_a_rank_record_is_checked_against_what_the_job_asked_and_its_values_unpacked():
    index, arrays = _rank_record()
    record = schema.rank_record(index, arrays, {"exchange": True}, 0, 2)
    assert torch.equal(record["exchange"]["Bit8Compressor"]["got"], torch.ones(1000))
    with pytest.raises(schema.Malformed, match="no 'trainer' record"):
        schema.rank_record(index, arrays, {"exchange": True, "trainer": ["--epochs", "1"]}, 0, 2)
    with pytest.raises(schema.Malformed, match=r"rank1.json.rank: a whole number in 1..1"):
        schema.rank_record(index, arrays, {}, 1, 2)
    for broken in ({"exchange": []}, {"exchange": {"Bit8Compressor": {}}},
                   {"trainer": {"error": None, "train_samples": 1, "train_steps": 1, "start": None,
                                "seconds": "n/a"}}):
        with pytest.raises(schema.Malformed):
            schema.rank_record({**index, **broken}, arrays, {"exchange": True}, 0, 2)
    index["exchange"]["Bit8Compressor"]["got"]["shape"] = [10 ** 12]
    with pytest.raises(schema.Malformed, match="Bit8Compressor.got"):
        schema.rank_record(index, arrays, {"exchange": True}, 0, 2)


def test_step_2s_record_answers_every_call_planned():
    arrays = {}
    results = {"names": ["encode_e4m3"], "calls": {"a": {"out": pack(np.zeros(3, np.uint8), arrays, "a.out")},
                                                   "b": {"error": "ValueError: no", "type": "ValueError"}}}
    checked = schema.calls_results(results, arrays, {"a": "call", "b": "roundtrip"})
    assert list(checked["calls"]["a"]["out"]) == [0, 0, 0]
    with pytest.raises(schema.Malformed, match="no result"):
        schema.calls_results(results, arrays, {"a": "call", "c": "call"})
    with pytest.raises(schema.Malformed, match="no 'packet'"):
        schema.calls_results({"names": [], "calls": {"a": {"y": pack(np.zeros(1), arrays, "x")}}},
                             arrays, {"a": "roundtrip"})
    with pytest.raises(schema.Malformed):
        schema.calls_results({"names": [], "calls": sorted(results["calls"])}, arrays, {})


def test_kitlog_csv_is_typed_row_by_row(tmp_path):
    path = tmp_path / "steps-rank0.csv"
    path.write_text("epoch,step,seconds,loss,size\n1,0,0.050000,2.300000,2\n1,1,0.040000,2.100000,2\n")
    assert schema.read_log(path, "steps")[1] == {"epoch": 1, "step": 1, "seconds": 0.04, "loss": 2.1, "size": 2}
    for text, words in (("epoch,step,seconds,loss,size\n1,0,n/a,2.3,2\n", "line 2, seconds"),
                        ("epoch,step,seconds,loss,size\n1,0,nan,2.3,2\n", "line 2, seconds"),
                        ("epoch,step,loss,size\n1,0,2.3,2\n", "no column 'seconds'"),
                        ("epoch,step,seconds,loss,size\n1,0,0.1\n", "3 fields"),
                        ("epoch,step,seconds,loss,size\n1,0,0.1,2.3,\x002\n", "size"),
                        ("epoch,step,seconds,loss,size\n1,0,0.1,2.3,1e400\n", "size")):
        path.write_text(text)
        with pytest.raises(schema.Malformed, match=words):
            schema.read_log(path, "steps")


# --- the sheet ------------------------------------------------------------------------------

def test_no_kit_name_or_reason_can_forge_a_row_of_the_sheet(tmp_path):
    forged = "mallory\n| alice | ✅ 1∕1 | 1∕1 |\nalice,codecs,encode_e4m3,1,,\r\u2028x\u202e"
    alice, mallory = tmp_path / "alice", tmp_path / forged
    results = {alice: [ok("codecs", "encode_e4m3")],
               mallory: [fail("codecs", "encode_e4m3", "raised X\n| alice | ✅ 1/1 |", "中\n| alice |")]}
    for lang in ("en", "zh"):
        lines = markdown(results, lang).splitlines()
        assert [line for line in lines if line.startswith("| alice ")] == ["| alice | ✅ 1/1 | 1/1 |"]
        # mallory's row, and its section: a heading and one line for its one reason
        assert len(lines) == len(markdown({alice: results[alice]}, lang).splitlines()) + 5
    text = csv_text(results)
    assert [line for line in text.splitlines() if line.startswith("alice,")] == ["alice,codecs,encode_e4m3,1,,"]
    assert len(text.splitlines()) == 3 and "\r" not in text.replace("\r\n", "")
    assert escape("a\\nb") != escape("a\nb")              # no escape can be typed by hand
    assert escape("x|y", markdown=True) == "x\\|y" and escape("x|y") == "x|y"


# --- the grader's network and its held-out labels ----------------------------------------------

def _kit_train_module():
    spec = importlib.util.spec_from_file_location("kit_train", KIT_FILES / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(KIT_FILES))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(KIT_FILES))
    return module


def test_the_graders_network_is_the_kits_and_loads_only_its_weights():
    kit_net = _kit_train_module().Net()
    assert [(n, tuple(t.shape)) for n, t in kit_net.state_dict().items()] == course_net.SHAPES
    weights = list(kit_net.state_dict().items())
    net = course_net.load(weights)
    x = torch.randn(20, 1, 28, 28)
    kit_net.eval()
    assert torch.equal(net(x), kit_net(x))
    y = kit_net(x).argmax(dim=1)
    assert course_net.accuracy(net, x, y) == 1.0
    with pytest.raises(ValueError, match="its layers are unused 1"):
        course_net.load([("unused", torch.zeros(1))])
    with pytest.raises(ValueError, match="not floating point"):
        course_net.load([(n, t.to(torch.int32)) for n, t in weights])
    nan = [(n, torch.full_like(t, float("nan"))) for n, t in weights]
    assert course_net.accuracy(course_net.load(nan), x, y) == 0.0


def test_the_sandbox_sees_placeholder_test_labels_that_the_kits_data_reads(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    source = Path("/usr/share/datasets/fashion-mnist")
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (data / f"{name}.gz").symlink_to(source / f"{name}.gz")
    (data / "t10k-labels-copy").write_bytes(b"x")
    work = tmp_path / "work"
    work.mkdir()
    hide = held_out_labels(work, data)
    real = (source / "t10k-labels-idx1-ubyte.gz").resolve()
    assert hide[real].name == "t10k-labels.gz" and hide[(data / "t10k-labels-copy").resolve()] is None
    assert not any("train" in p.name or "t10k-images" in p.name for p in hide)
    placeholder = gzip.decompress(hide[real].read_bytes())
    sys.path.insert(0, str(KIT_FILES))
    try:
        kit_data = importlib.import_module("data")
        assert hashlib.md5(placeholder).hexdigest() == kit_data.HELD_OUT_LABELS_MD5
        (data / "t10k-labels-idx1-ubyte.gz").unlink()
        (data / "t10k-labels-idx1-ubyte.gz").write_bytes(hide[real].read_bytes())
        _, test = kit_data.load("fashion-mnist", str(data), 64, 200)
        assert len(test) == 200 and int(test.tensors[1].abs().sum()) == 0
        (data / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(placeholder[:-1] + b"\x01"))
        with pytest.raises(kit_data.DataError, match="md5"):
            kit_data.load("fashion-mnist", str(data), 64, 200)
    finally:
        sys.path.remove(str(KIT_FILES))
        sys.modules.pop("data", None)


# --- step 2: what compression keeps means nothing of a compressor that does not compress -------

def _solution_module(extra=""):
    module = types.ModuleType("compression")
    exec((classroom_kit.SOLUTION_FILES / "compression.py").read_text() + extra, module.__dict__)
    return module


IDENTITY = '''
class Bit8Compressor:
    @staticmethod
    def compress(tensor):
        return tensor.detach().float().reshape(-1).view(torch.uint8), (tensor.shape, tensor.dtype)
    @staticmethod
    def decompress(packet, ctx):
        return packet.view(torch.float32).reshape(ctx[0]).to(ctx[1])
Bit16Compressor = Bit8Compressor
'''


def test_an_identity_compressor_fails_every_compressor_check_and_the_solution_none():
    assert [c.name for c in compressor_checks(_solution_module()) if not c.passed] == []
    checks = compressor_checks(_solution_module(IDENTITY))
    assert len(checks) == 10 and not any(c.passed for c in checks)
    nan_inf = next(c for c in checks if c.name == "Bit8Compressor.nan_inf")
    assert "nothing was compressed" in nan_inf.en and "15 bytes for 7 values" in nan_inf.en


# --- step 5: the report's figures against the runs -------------------------------------------

def _write_run(kit, name, size, accuracy, loss=0.5, epochs=1, steps=2, seconds=0.05):
    run = kit / "runs" / name
    run.mkdir(parents=True)
    (run / "epochs-rank0.csv").write_text("epoch,test_loss,test_accuracy,size\n" + "".join(
        f"{e},{loss},{accuracy},{size}\n" for e in range(1, epochs + 1)))
    for r in range(size):
        (run / f"steps-rank{r}.csv").write_text("epoch,step,seconds,loss,size\n" + "".join(
            f"{e},{s},{seconds},2.3,{size}\n" for e in range(1, epochs + 1) for s in range(steps)))


def _report(kit):
    import subprocess
    subprocess.run([sys.executable, "report.py"], cwd=kit, check=True, capture_output=True)
    return report_checks(kit)


@pytest.mark.interpreter
def test_the_reports_figures_are_its_runs_figures(tmp_path):
    kit = classroom_kit.init(tmp_path / "kit")
    _write_run(kit, "np2-none", 2, 0.8123)
    _write_run(kit, "np4-bit8", 4, 0.7999)
    assert all(c.passed for c in _report(kit))
    report = kit / "report.md"
    text = report.read_text()
    for old, new, words in (("81.23%", "91.23%", "91.23% (accuracy), its logs 81.23%"),
                            ("| 50.0 |", "| 40.0 |", "(mean step)"),
                            ("| `np2-none` | 2 | 1 |", "| `np2-none` | 2 | 2 |", "(epochs)"),
                            ("| `np2-none` | 2", "| `np2-none` | 4", "no steps-rank2.csv"),
                            ("`np2-none`", "`../np2-none`", "not of the form")):
        report.write_text(text.replace(old, new, 1))
        check = report_checks(kit)[1]
        assert not check.passed and words in check.en, (new, check.en)
        assert check.zh
    report.write_text(text)
    (kit / "runs" / "np4-bit8" / "steps-rank3.csv").unlink()
    assert "no steps-rank3.csv" in report_checks(kit)[1].en
    (kit / "runs" / "np4-bit8" / "steps-rank3.csv").symlink_to(kit / "runs" / "np4-bit8" / "steps-rank2.csv")
    assert "not kitlog's" in report_checks(kit)[1].en


@pytest.mark.interpreter
def test_a_report_whose_accuracy_no_run_of_this_network_gives_fails(tmp_path):
    kit = classroom_kit.init(tmp_path / "kit")
    _write_run(kit, "np2-none", 2, 0.90, loss=0.01)          # 10% wrong costs >= 0.069 of loss
    _write_run(kit, "np4-bit8", 4, 0.97, loss=0.2)           # beyond Fashion-MNIST's ceiling
    check = _report(kit)[1]
    assert not check.passed and "ln 2" in check.en
    (kit / "runs" / "np2-none" / "epochs-rank0.csv").write_text(
        "epoch,test_loss,test_accuracy,size\n1,0.3,0.90,2\n")
    assert "more than the course's network reaches" in _report(kit)[1].en
    (kit / "runs" / "np4-bit8" / "epochs-rank0.csv").write_text(
        "epoch,test_loss,test_accuracy,size\n1,0.3,0.90,4\n")
    assert _report(kit)[1].passed
    # as short a run as the grader's own (4 steps on 4 processes), 50 points above its score
    check = report_checks(kit, "fashion-mnist", {"np4": 0.40, "np4.steps": 4})[1]
    assert not check.passed and "the grader's own run of your train.py (4 steps)" in check.en
    assert report_checks(kit, "fashion-mnist", {"np4": 0.80, "np4.steps": 4})[1].passed
    assert report_checks(kit, "fashion-mnist", {"np4": 0.40, "np4.steps": 1})[1].passed
