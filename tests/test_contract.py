"""The plugin's contract (roles.py) on one process: every block codec on the one base, one
registry read by everyone, a compressor added from one file (docs/extending.md), and a hot
path that fails clearly (short messages, a missing kernel, unsupported devices)."""
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import hvd_compress as hc
from hvd_compress.exchange import bucketing
from hvd_compress import registry
from hvd_compress.compressors.blockcodec import BlockCodec
from hvd_compress.codecs import E4M3, blocks, native
from hvd_compress.exchange.routes import make_communicator
from hvd_compress.costmodel import methods, model
from hvd_compress.exchange.fusion import Bucket
from hvd_compress.roles import Capabilities, PacketCompressor
from labs.kit import flags, table

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
BLOCK_CODECS = ["bit8", "bit16", "int8", "onebit", "bf16"]
DERIVED = ("encode_message", "decode_messages", "message_bytes", "chunks_bytes",
           "decode_message", "reduce_encode")


def example_source():
    """The compressor file docs/extending.md shows (docs/examples/e5m2_example.py)."""
    return "e5m2_example.py", (ROOT / "docs" / "examples" / "e5m2_example.py").read_text()


# ---- one base for every block codec ---------------------------------------------------------
@pytest.mark.parametrize("name", BLOCK_CODECS)
def test_block_codecs_share_one_base(name):
    """The message, chunk and two-phase logic is BlockCodec's alone: no block codec writes its
    own (bit8/bit16 add only the native kernel's entry and their packet header)."""
    comp = registry.scheme(name).load()
    assert issubclass(comp, BlockCodec) and issubclass(comp, PacketCompressor)
    for klass in comp.__mro__[:comp.__mro__.index(BlockCodec)]:
        assert not set(DERIVED) & set(vars(klass)), f"{klass.__name__} re-implements {set(DERIVED) & set(vars(klass))}"
    assert comp.message_bytes(1000) == registry.scheme(name).message_bytes(1000, 256)


@pytest.mark.parametrize("name", BLOCK_CODECS)
@pytest.mark.parametrize("numel", [1, 464, 1000])
def test_a_message_shorter_than_its_values_need_is_refused(name, numel):
    """int8 used to decode 184 of 472 bytes and leave the last values at zero (issue 24)."""
    comp = registry.scheme(name).load()
    size = comp.message_bytes(numel)
    messages = torch.zeros(2, size, dtype=torch.uint8)
    for r in range(2):
        comp.encode_message(torch.randn(numel), messages[r])
    out = torch.empty(numel)
    comp.decode_messages(messages, numel, out)                 # whole: fine
    for cut in sorted({4, size // 2, size - 4}):
        if 0 < cut < size:
            with pytest.raises(ValueError, match="corrupt bucket message"):
                comp.decode_messages(messages[:, :cut].contiguous(), numel, out)


# ---- one registry ---------------------------------------------------------------------------
def test_every_scheme_is_read_from_the_registry():
    """The lab's flags and table, the cost model and the communicators all take a scheme from
    its one entry."""
    parser_flags = flags.compression_flags()
    for name, entry in registry.SCHEMES.items():
        compression = entry.load()
        if entry.flag:
            assert parser_flags[name] == entry.flag.lstrip("-").replace("-", "_")
        methods.bytes_per_step(name, methods.MODEL_SHAPES["basic"], 2)        # known to it
        if entry.parameter is None:
            comm = make_communicator(compression)
            assert comm.route == entry.default_route
            assert comm.capabilities.takes_memory == entry.packet
    assert table.SCHEME_FLAGS == {"none": [], "fp16": ["--fp16-allreduce"],
                                  "bit16": ["--bit16-allreduce"], "bit8": ["--bit8-allreduce"]}
    assert table.METHOD_FLAGS["topk"] == ["--topk-allreduce", "0.01"]
    assert table.METHOD_FLAGS["powersgd"] == ["--powersgd-allreduce", "2"]


def test_one_schemes_table():
    """registry.SCHEMES is the one SCHEMES; the cost model's table of collectives is EXCHANGES."""
    assert "bit8" in hc.SCHEMES and "allreduce_ring" in model.EXCHANGES
    assert not hasattr(model, "SCHEMES")


def test_the_cost_model_reads_the_runtimes_buckets_and_chunks():
    assert methods.FUSION_BYTES == bucketing.DEFAULT_FUSION_BYTES
    assert methods.chunk_bounds is bucketing.chunk_bounds
    assert methods.groups_by_size is bucketing.groups_by_size


def test_communicators_declare_what_they_can_do():
    packet = make_communicator(hc.Compression.bit8)
    allreduce = make_communicator(hc.Compression.fp16)
    topk = make_communicator(hc.Compression.topk(0.1))
    can = {name: comm.capabilities for name, comm in (("packet", packet), ("allreduce", allreduce),
                                                      ("topk", topk))}
    assert all(isinstance(c, Capabilities) for c in can.values())
    assert (can["packet"].fuses, can["packet"].takes_memory, can["packet"].own_memory) == \
        (True, True, False)
    assert (can["allreduce"].fuses, can["allreduce"].takes_memory, can["allreduce"].own_memory) \
        == (False, False, False)
    assert (can["topk"].fuses, can["topk"].takes_memory, can["topk"].own_memory) == \
        (False, False, True)
    # what a front decides from: one phase (decoded in its collective's callback), per tensor
    assert can["packet"].one_phase and can["allreduce"].one_phase and can["topk"].one_phase
    assert can["topk"].per_tensor and not can["packet"].per_tensor
    powersgd = make_communicator(hc.Compression.powersgd(1)).capabilities
    assert powersgd.groups and powersgd.per_tensor and not powersgd.one_phase
    two_phase = make_communicator(hc.Compression.bit8, route="alltoall").capabilities
    assert two_phase.fuses and not two_phase.one_phase
    assert make_communicator(hc.Compression.auto).capabilities.plans_buckets
    assert packet.state_dict() is None and topk.state_dict() == {"residuals": {}}
    with pytest.raises(ValueError, match="travels by allgather"):
        make_communicator(hc.Compression.topk(0.1), route="alltoall")


# ---- a compressor from one file --------------------------------------------------------------
@pytest.mark.interpreter
def test_a_compressor_from_one_file_reaches_the_cost_model_and_the_lab(tmp_path):
    """The file of docs/extending.md, and nothing else: the cost model counts its bytes as its
    messages are, the lab's parser takes its flag and names its run."""
    filename, source = example_source()
    (tmp_path / filename).write_text(source)
    script = textwrap.dedent(f"""
        import sys, torch
        from hvd_compress import registry
        from hvd_compress.costmodel import methods
        from labs.kit import flags, table
        from labs import mnist
        comp = registry.scheme("e5m2").load()
        shapes = methods.MODEL_SHAPES["basic"]
        counts = [methods.numel(s) for s in shapes]
        expected = sum(comp.message_bytes(b) for b in methods.buckets(counts))
        assert methods.bytes_per_step("e5m2", shapes, 3, route="allgather") == 2 * expected
        x = torch.randn(5000)
        m = torch.zeros(2, comp.message_bytes(5000), dtype=torch.uint8)
        comp.encode_message(x, m[0]); comp.encode_message(x, m[1])
        out = torch.empty(5000); comp.decode_messages(m, 5000, out, divisor=2)
        assert ((out - x).abs() <= x.abs() * 2.0 ** -3 + 1e-30).all()
        sys.argv = ["mnist.py", "--e5m2-allreduce"]
        args = mnist.parse_args()
        assert args.compression == "e5m2" and flags.compression_of(args) is comp
        assert table.config_name(args, 2) == "np2-e5m2"
        print("one file OK")
    """)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
               HVD_COMPRESS_SCHEMES=Path(filename).stem)
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "one file OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_an_unregistered_block_codec_says_how_to_register():
    class Nameless(BlockCodec):
        name = "nameless"
    with pytest.raises(ValueError, match="registry.register"):
        Nameless.message_bytes(10)


# ---- a missing kernel warns once and is recorded --------------------------------------------
def test_a_missing_native_kernel_warns_once_and_is_recorded(monkeypatch):
    comm = make_communicator(hc.Compression.bit8)
    built = native.module() is not None
    assert comm.pop_stats()["codec_path"] == ("native" if built else "torch")
    monkeypatch.setattr(native, "module", lambda: None)         # not built for this torch
    monkeypatch.setattr(blocks, "_missing_warned", [])
    monkeypatch.delenv("HVD_COMPRESS_NATIVE", raising=False)
    message = torch.zeros(hc.Compression.bit8.message_bytes(1000), dtype=torch.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            hc.Compression.bit8.encode_message(torch.randn(1000), message)
            hc.Compression.bit16.encode_message(torch.randn(100), message)
    missing = [w for w in caught if "native" in str(w.message)]
    assert len(missing) == 1 and issubclass(missing[0].category, RuntimeWarning), caught
    assert "python -m hvd_compress.codecs.native" in str(missing[0].message)
    assert comm.pop_stats()["codec_path"] == "torch"
    assert blocks.codec_path(E4M3) == "torch"


# ---- top-k and PowerSGD on the gradient's device ---------------------------------------------
@pytest.mark.parametrize("method", [hc.Compression.topk(0.5), hc.Compression.powersgd(1)])
def test_methods_refuse_a_device_they_do_not_run_on(method):
    comm = make_communicator(method)
    grad = torch.empty(4, 3, device="meta")
    (_, bucket), = Bucket.plan(["w"], [grad], 0, flat=False)
    bucket.put(0, grad)
    with pytest.raises(ValueError, match="runs on cpu or cuda gradients, got one on meta"):
        comm.start(bucket)


def test_topk_keeps_its_work_on_the_values_device():
    from hvd_compress.methods.topk import scatter_sum, select
    from hvd_compress.methods.powersgd import initial_q
    x = torch.randn(100)
    assert select(x, 0).device == x.device and select(x, 5).device == x.device
    assert scatter_sum(torch.tensor([[1, 2]]), torch.tensor([[1.0, 2.0]]), 4).tolist() == [0, 1, 2, 0]
    assert torch.equal(initial_q("w", 3, 2, 0), initial_q("w", 3, 2, 0, "cpu"))
