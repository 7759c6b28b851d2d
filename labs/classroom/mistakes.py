"""Mistakes students make, seeded into the solution: each must fail its own check with its
reason (the grader graded: tests/test_classroom_*.py; docs/instructor.md lists them).

Each mistake edits a solution kit: code appended to compression.py (the last definition of a
name wins), or a line of train.py replaced.
"""
from dataclasses import dataclass

from .kit import install_solution


@dataclass(frozen=True)
class Mistake:
    name: str
    step: str           # the grader's step that must fail
    check: str          # the check that must fail
    words: str          # words its reason must hold
    append: str = ""    # code appended to compression.py
    replace: tuple = ()  # (file, old, new) replacements


MISTAKES = [
    Mistake("truncation", "codecs", "encode_e4m3", "ties to even", append='''
_encode_e4m3 = encode_e4m3
def encode_e4m3(x):
    """Mistake: drops the low 20 mantissa bits (truncation) instead of rounding."""
    return _encode_e4m3((x.view(np.uint32) & np.uint32(0xFFF00000)).view(np.float32))
'''),
    Mistake("no_saturation", "codecs", "encode_e4m3", "saturate", append='''
def encode_e4m3(x):
    """Mistake: finite overflow becomes NaN (ml_dtypes' cast) instead of +-448."""
    return _e4m3(x, saturate=False)
'''),
    Mistake("flush_subnormals", "codecs", "encode_e4m3", "subnormal grid", append='''
_encode_e4m3_normal = encode_e4m3
def encode_e4m3(x):
    """Mistake: results below E4M3's smallest normal (2**-6) flushed to zero."""
    codes = _encode_e4m3_normal(x)
    return np.where((codes & 0x78) == 0, codes & 0x80, codes).astype(np.uint8)
'''),
    Mistake("nan_inf_lost", "codecs", "Bit8Compressor.nan_inf", "NaN came back", append='''
class Bit8Compressor(Bit8Compressor):
    """Mistake: NaN and Inf replaced by numbers before encoding."""
    @classmethod
    def compress(cls, tensor):
        return super().compress(torch.nan_to_num(tensor))
'''),
    Mistake("no_scale", "codecs", "Bit8Compressor.tiny_gradients", "came back as 0", append='''
class Bit8Compressor(Bit8Compressor):
    """Mistake: no scale (s = 1): gradients below 2**-10 flush to zero."""
    @classmethod
    def compress(cls, tensor):
        codes = encode_e4m3(tensor.detach().reshape(-1).float().numpy())
        header = np.array([1.0], "<f4").tobytes() + bytes(4)
        packet = torch.frombuffer(bytearray(header + codes.tobytes()), dtype=torch.uint8)
        return packet, (tensor.shape, tensor.dtype)
'''),
    Mistake("big_endian_fp16", "codecs", "Bit16Compressor.packet", "big-endian", append='''
def _swap_codes(packet):
    swapped = packet.clone()
    swapped[HEADER_BYTES:] = packet[HEADER_BYTES:].view(-1, 2).flip(1).reshape(-1)
    return swapped

class Bit16Compressor(Bit16Compressor):
    """Mistake: float16 codes written high byte first (and read back the same way)."""
    @classmethod
    def compress(cls, tensor):
        packet, ctx = super().compress(tensor)
        return _swap_codes(packet), ctx

    @classmethod
    def decompress(cls, packet, ctx):
        return super().decompress(_swap_codes(packet), ctx)
'''),
    Mistake("averaged_codes", "exchange", "exchange.Bit8Compressor", "average the decoded values", append='''
def allreduce(tensor, compression, name=None):
    """Mistake: averages the packets' bytes (codes) across ranks, then decodes once."""
    import horovod.torch as hvd
    packet, ctx = compression.compress(tensor)
    rows = hvd.allgather(packet.reshape(1, -1), name=name)
    return compression.decompress(rows.float().mean(0).round().to(torch.uint8), ctx)
'''),
    Mistake("no_sampler", "trainer", "trainer.np2.shard", "DistributedSampler", replace=(
        ("train.py", "sampler=sampler)", "shuffle=True)"),
        ("train.py", "    sampler.set_epoch(epoch)\n", ""))),
    Mistake("no_broadcast", "trainer", "trainer.np2.broadcast", "broadcast_parameters", replace=(
        ("train.py", "    hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n", ""),)),
]
BY_NAME = {m.name: m for m in MISTAKES}


def seed(folder, mistake):
    """Install the solution into the kit at `folder`, then the mistake."""
    folder = install_solution(folder)
    if mistake.append:
        path = folder / "compression.py"
        path.write_text(path.read_text() + "\n" + mistake.append)
    for name, old, new in mistake.replace:
        path = folder / name
        text = path.read_text()
        if old not in text:
            raise ValueError(f"mistake {mistake.name}: {old!r} is not in {name}")
        path.write_text(text.replace(old, new))
    return folder
