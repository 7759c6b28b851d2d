"""The similarity report names copying (labs/classroom/similarity.py): the course's solution and
the project's own codec code, each hidden by the evasions a copier tries (tests/copying.py:
renaming, no-op statements, swapped operands, reordered statements, all at once), still score
high against their source; honest work (the untouched kit, a correct implementation written
another way, tests/honest_compression.py) scores low against both. Each
evasion is first shown to keep what the code does, so that it is one a student could hand in."""
import ast
import importlib.util
import inspect
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import copying
from labs.classroom import kit as classroom_kit
from labs.classroom.grade import find_kits
from labs.classroom.similarity import FLAG, compare, read_kit_file, report

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent
SOLUTION = classroom_kit.SOLUTION_FILES / "compression.py"
SOLUTION_TRAIN = classroom_kit.SOLUTION_FILES / "train.py"
HONEST = HERE / "honest_compression.py"
HIGH = 0.8     # an evaded copy scores at least this against its source (docs/instructor.md)
LOW = 0.25     # honest work scores at most this against the reference and the project
EVASIONS = {"renamed": copying.rename, "no_ops": copying.no_ops,
            "swapped": copying.swap_operands, "reordered": copying.reorder,
            "all_evasions": copying.all_evasions}


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rename_only(source, mapping):
    """Rename some module-level names (a paste that would otherwise clash)."""
    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            node.id = mapping.get(node.id, node.id)
            return node

        def visit_FunctionDef(self, node):
            node.name = mapping.get(node.name, node.name)
            self.generic_visit(node)
            return node
    return ast.unparse(Rename().visit(ast.parse(source)))


# the glue a student writes around the project's pasted codecs to fill the kit's interface
GLUE = '''
import torch

def encode_e4m3(x):
    return encode(np.asarray(x, dtype=np.float32), E4M3)

def decode_e4m3(codes):
    return decode(np.asarray(codes, dtype=np.uint8), E4M3)

def encode_fp16(x):
    return fp16_encode(np.asarray(x, dtype=np.float32))

def decode_fp16(codes):
    return fp16_decode(np.asarray(codes, dtype=np.uint16))

HEADER_BYTES = 8

class _Packets:
    fmt = None

    @classmethod
    def compress(cls, tensor):
        x = tensor.detach().reshape(-1).to(torch.float32).numpy()
        finite = np.isfinite(x)
        amax = float(np.abs(x[finite]).max()) if finite.any() else 0.0
        flag = int(bool(np.isinf(x).any()) and not cls.fmt.has_inf)
        s = pow2_scale(amax, cls.fmt.max_finite / 2 if flag else cls.fmt.max_finite)
        codes = cls.codes(x * np.float32(s))
        raw = struct.pack("<fI", s, flag) + codes.astype(codes.dtype.newbyteorder("<")).tobytes()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8), (tensor.shape, tensor.dtype)

    @classmethod
    def decompress(cls, packet, ctx):
        shape, dtype = ctx
        raw = packet.numpy().tobytes()
        s, flag = struct.unpack("<fI", raw[:8])
        codes = np.frombuffer(raw[8:], "<u1" if cls.fmt.code_bytes == 1 else "<u2")
        with np.errstate(over="ignore"):
            values = cls.values(codes) / np.float32(s)
        if flag:
            top = (codes & 0x7F) == 0x7E
            values = np.where(top, np.where(codes & 0x80, -np.inf, np.inf), values)
        return torch.from_numpy(values.astype(np.float32)).reshape(shape).to(dtype)

class Bit8Compressor(_Packets):
    fmt = E4M3
    codes = staticmethod(encode_e4m3)
    values = staticmethod(decode_e4m3)

class Bit16Compressor(_Packets):
    fmt = FP16
    codes = staticmethod(encode_fp16)
    values = staticmethod(decode_fp16)
'''


def pasted_plugin(glue=GLUE):
    """compression.py made of the project's NumPy codecs pasted whole (formats, the bit-level
    encoder, fp8_numpy, fp16_numpy with its names changed where they clash, the scale) and
    the glue above."""
    from hvd_compress.codecs import formats, fp16_numpy, fp8_numpy, numpy_common, reference, scaling
    parts = []
    for module in (formats, reference, numpy_common, fp8_numpy, scaling, fp16_numpy):
        text = inspect.getsource(module)
        lines = text.splitlines()
        for node in ast.parse(text).body:         # the package's own imports, its __all__
            if (isinstance(node, ast.ImportFrom) and node.level) or (
                    isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__"):
                lines[node.lineno - 1:node.end_lineno] = [""] * (node.end_lineno - node.lineno + 1)
        text = "\n".join(lines)
        if module is fp16_numpy:
            text = _rename_only(text, {"encode": "fp16_encode", "decode": "fp16_decode",
                                       "decode_bits": "fp16_decode_bits", "decode_table": "fp16_decode_table",
                                       "_encode_block": "_fp16_encode_block"})
        parts.append(text)
    return "\n\n".join(parts) + "\n" + glue


def _nan_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(((a == b) | (np.isnan(a) & np.isnan(b))).all())


def assert_behaves_like_the_solution(module, solution):
    """The same codes, values and packets as the solution on inputs of every kind."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(3000) * 10.0 ** rng.integers(-12, 7, 3000),
                        [0.0, -0.0, 448, 449, 464, 1e4, 65504, 65520, 2.0 ** -10, 3 * 2.0 ** -10,
                         np.inf, -np.inf, np.nan]]).astype(np.float32)
    assert np.array_equal(module.encode_e4m3(x.copy()), solution.encode_e4m3(x.copy()))
    assert np.array_equal(module.encode_fp16(x.copy()), solution.encode_fp16(x.copy()))
    codes8, codes16 = np.arange(256, dtype=np.uint8), np.arange(1 << 16, dtype=np.uint16)
    assert _nan_equal(module.decode_e4m3(codes8), solution.decode_e4m3(codes8))
    assert _nan_equal(module.decode_fp16(codes16), solution.decode_fp16(codes16))
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(300, generator=g) * 1e-3, torch.tensor([1.0, float("inf"), -3.0, float("nan")]),
               torch.randn(4, 5, generator=g).double(), torch.zeros(0), torch.tensor(2.5)]
    for name in ("Bit8Compressor", "Bit16Compressor"):
        ours, theirs = getattr(module, name), getattr(solution, name)
        for t in tensors:
            packet, ctx = ours.compress(t)
            assert torch.equal(packet, theirs.compress(t)[0]), (name, t)
            back, want = ours.decompress(packet, ctx), theirs.decompress(packet, ctx)
            assert back.dtype == want.dtype and _nan_equal(back.numpy(), want.numpy()), (name, t)


@pytest.fixture(scope="module")
def solution_module():
    return _load(SOLUTION, "similarity_solution")


@pytest.fixture(scope="module")
def klass(tmp_path_factory):
    """A class of kits: the solution under each evasion (compression.py and train.py), the
    project's codecs pasted, plain and under every evasion, the untouched kit, an honest kit."""
    root = tmp_path_factory.mktemp("similar") / "class"
    for name, evade in EVASIONS.items():
        kit = classroom_kit.install_solution(classroom_kit.init(root / name))
        for file in ("compression.py", "train.py"):
            (kit / file).write_text(evade((kit / file).read_text()))
    pasted = pasted_plugin()
    for name, text in (("plugin_pasted", pasted), ("plugin_pasted_evaded", copying.all_evasions(pasted))):
        (classroom_kit.init(root / name) / "compression.py").write_text(text)
    classroom_kit.init(root / "untouched")
    (classroom_kit.init(root / "honest") / "compression.py").write_text(HONEST.read_text())
    pairs, sizes = compare(find_kits([root]))
    return root, {(p.a, p.kind if p.kind != "kits" else p.b): p for p in pairs}, sizes


@pytest.mark.parametrize("name", [*EVASIONS, "plugin_pasted", "plugin_pasted_evaded", "honest"])
def test_each_kit_of_the_class_works(klass, solution_module, name):
    """The evasions keep what the code does: each kit is one a student could hand in."""
    root, _, _ = klass
    module = _load(root / name / "compression.py", f"similarity_{name}")
    assert_behaves_like_the_solution(module, solution_module)
    if name in EVASIONS:
        ast.parse((root / name / "train.py").read_text())
        assert (root / name / "compression.py").read_text() != SOLUTION.read_text()


@pytest.mark.parametrize("name", list(EVASIONS))
def test_the_solution_under_each_evasion_is_named(klass, name):
    _, pairs, _ = klass
    pair = pairs[(name, "reference")]
    assert pair.per_file["compression.py"][0] >= HIGH, pair.per_file
    assert pair.per_file["train.py"][0] >= HIGH, pair.per_file
    assert pair.score >= HIGH


@pytest.mark.parametrize("name", ["plugin_pasted", "plugin_pasted_evaded"])
def test_the_projects_codecs_pasted_are_named(klass, name):
    """The glue is the student's own (a quarter of the kit): the share is over FLAG, and the
    tiles hold at least HIGH of the pasted code."""
    from labs.classroom import similarity
    _, pairs, _ = klass
    pair = pairs[(name, "project")]
    given = similarity.Doc().add([("c", (classroom_kit.KIT_FILES / "compression.py").read_text(), False)])
    pasted = similarity.Doc().add([("c", pasted_plugin(glue=""), False)]).take_out(given).own
    assert pair.per_file["compression.py"][0] >= FLAG and pair.score >= FLAG, pair.per_file
    assert pair.per_file["compression.py"][1] >= HIGH * pasted, (pair.per_file, pasted)


def test_honest_work_scores_low(klass):
    _, pairs, sizes = klass
    assert sizes["untouched"] == 0
    assert pairs[("untouched", "reference")].score == 0 and pairs[("untouched", "project")].score == 0
    assert sizes["honest"] > 500
    for source in ("reference", "project"):
        pair = pairs[("honest", source)]
        assert pair.score <= LOW and pair.per_file["compression.py"][0] <= LOW, (source, pair.per_file)
    # and the honest kit is far from every copy in the class
    for name in [*EVASIONS, "plugin_pasted", "plugin_pasted_evaded"]:
        key = ("honest", name) if "honest" < name else (name, "honest")
        assert pairs[key].score <= LOW, (key, pairs[key].score)


def test_copies_of_one_source_find_each_other(klass):
    _, pairs, _ = klass
    assert pairs[("all_evasions", "renamed")].score >= HIGH
    assert pairs[("plugin_pasted", "plugin_pasted_evaded")].score >= HIGH


def test_the_report_shows_the_matching_regions_side_by_side(klass, tmp_path):
    from labs.classroom.__main__ import main
    root, pairs, _ = klass
    assert main(["similar", str(root), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "similarity.md").read_text()
    assert "Never a grade" in text and "仅供教师参考" in text
    assert re.search(r"\| all_evasions \| reference solution \| ⚠ \d+%", text)
    # the regions of the combined evasion: line ranges in the kit and in the solution
    section = text.split("### all_evasions — reference solution")[1].split("###")[0]
    rows = re.findall(r"\| compression\.py (\d+)-(\d+) \| labs/classroom/solution_files/compression\.py (\d+)-(\d+) \| (\d+) \|",
                      section)
    assert rows, section
    kit_lines = len((root / "all_evasions" / "compression.py").read_text().splitlines())
    for a0, a1, b0, b1, _ in rows:
        assert 1 <= int(a0) <= int(a1) <= kit_lines and 1 <= int(b0) <= int(b1) <= len(SOLUTION.read_text().splitlines())
    assert "hvd_compress/codecs/reference.py" in text.split("### plugin_pasted — project's code")[1]
    assert pairs[("renamed", "reference")].score >= FLAG


def test_a_kits_name_cannot_forge_a_row_and_links_are_not_followed(tmp_path):
    """A kit folder named with a newline and a pipe stays in its own cell; a compression.py
    that is a link to the solution is no work of the kit's."""
    root = tmp_path / "class"
    forged = classroom_kit.init(root / "evil\n| solution | reference solution | ⚠ 100% |")
    (forged / "compression.py").unlink()
    (forged / "compression.py").symlink_to(SOLUTION)
    assert read_kit_file(forged, "compression.py") == ""
    elsewhere = tmp_path / "elsewhere"                 # a folder of the kit that is a link
    elsewhere.mkdir()
    (elsewhere / classroom_kit.COURSE_PATCH).write_text((classroom_kit.SOLUTION_FILES / classroom_kit.COURSE_PATCH).read_text())
    shutil.rmtree(forged / "patches")
    (forged / "patches").symlink_to(elsewhere)
    assert read_kit_file(forged, f"patches/{classroom_kit.COURSE_PATCH}") == ""
    classroom_kit.init(root / "plain")
    text = report(find_kits([root]))
    rows = [l for l in text.splitlines() if l.startswith("| evil")]
    cells = [len(re.split(r"(?<!\\)\|", row)) - 2 for row in rows]
    assert cells == [7, 7, 5], rows              # against the two sources, the one pair
    assert not any(l.startswith("| solution") for l in text.splitlines())


def test_hostile_files_change_no_other_row(tmp_path):
    """Kits whose files are huge and repetitive, nested past the parser's depth, random bytes,
    or a FIFO: compared in part or not at all, and the solution's rows are those it has
    alone."""
    import os
    alone, hostile = tmp_path / "alone", tmp_path / "class"
    for root in (alone, hostile):
        classroom_kit.install_solution(classroom_kit.init(root / "solution"))
    for name in ("big1", "big2"):
        (classroom_kit.init(hostile / name) / "compression.py").write_text("x = x + 1\n" * 20000)
    deep = classroom_kit.init(hostile / "deep")
    (deep / "compression.py").write_text("y = " + "(" * 3000 + "1" + ")" * 3000 + "\ndef f():\n"
                                         + "".join("    " * i + "if a:\n" for i in range(1, 90))
                                         + "    " * 90 + "pass\n")
    (classroom_kit.init(hostile / "garbage") / "compression.py").write_bytes(os.urandom(100000))
    fifo = classroom_kit.init(hostile / "fifo") / "patches" / classroom_kit.COURSE_PATCH
    fifo.unlink()
    os.mkfifo(fifo)                          # a read would wait for a writer forever
    kits = find_kits([hostile])
    assert len(kits) == 6 and read_kit_file(hostile / "fifo", f"patches/{classroom_kit.COURSE_PATCH}") == ""
    text = report(kits)
    assert "Compared in part" in text and "big1 (compression.py)" in text
    rows = [l for l in text.splitlines() if l.startswith("| solution |")]
    assert rows == [l for l in report(find_kits([alone])).splitlines() if l.startswith("| solution |")]
