"""The course's solution of steps 2 and 3, standing alone as a student's would (NumPy, torch,
Horovod: nothing of the project), so that the grader holds it to the same sandbox.

Never handed out (labs.classroom.kit.install_solution puts it into a kit to grade the grader).
The grader judges it bit for bit against hvd_compress's codecs and compressors.
"""
import numpy as np
import torch

HEADER_BYTES = 8
E4M3_MAX = 448.0
FP16_MAX = 65504.0
FLAG_INF_AT_MAX = 1


def _e4m3(x, saturate=True):
    """float32 -> E4M3 codes: round to nearest even on the format's grid (2^-9 quanta below
    2^-6), finite overflow and Inf to +-448 (saturate) or NaN, NaN to 0x7F with its sign."""
    with np.errstate(all="ignore"):
        return _e4m3_quiet(np.asarray(x, dtype=np.float32), saturate)


def _e4m3_quiet(x, saturate):
    a = np.abs(x.astype(np.float64))
    sign = np.signbit(x).astype(np.uint8) << 7
    finite = np.isfinite(a)
    safe = np.where(finite, a, 0.0)
    _, e = np.frexp(safe)                                   # safe = m * 2^e, m in [0.5, 1)
    quantum = np.exp2(np.maximum(e - 1, -6) - 3.0)
    r = np.rint(safe / quantum) * quantum                   # ties to even, exact in float64
    over = (r > E4M3_MAX) | np.isinf(a)
    r = np.where(over, E4M3_MAX, r)
    m2, e2 = np.frexp(r)
    exponent = e2 - 1
    normal = (r > 0) & (exponent >= -6)
    biased = np.where(normal, exponent + 7, 0)
    mantissa = np.where(normal, (m2 * 2.0 - 1.0) * 8.0, r / 2.0 ** -9)
    codes = (biased.astype(np.uint8) << 3) | np.rint(mantissa).astype(np.uint8)
    if not saturate:
        codes = np.where(over, 0x7F, codes).astype(np.uint8)
    codes = np.where(np.isnan(a), 0x7F, codes).astype(np.uint8)
    return (codes | sign).astype(np.uint8)


def encode_e4m3(x):
    return _e4m3(x, saturate=True)


def _e4m3_table():
    c = np.arange(256)
    e, m = (c >> 3) & 15, c & 7
    values = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * np.exp2(e - 7.0))
    values = np.where((e == 15) & (m == 7), np.nan, values)
    return np.where(c & 0x80, -values, values).astype(np.float32)


E4M3_TABLE = _e4m3_table()


def decode_e4m3(codes):
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def encode_fp16(x):
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def decode_fp16(codes):
    return np.asarray(codes, dtype=np.uint16).view(np.float16).astype(np.float32)


def pow2_scale(amax, largest):
    """The largest power of two s with amax * s <= largest (1 when amax is 0), kept within
    float32's normal range so that it survives the header exactly."""
    if not amax > 0:
        return 1.0
    ma, ea = np.frexp(amax)
    mt, et = np.frexp(largest)
    k = et - ea - (1 if ma > mt else 0)
    return float(np.ldexp(1.0, int(min(127, max(-126, k)))))


class _Scaled:
    largest, code_bytes, has_inf = None, None, None

    @classmethod
    def encode(cls, x):
        raise NotImplementedError

    @classmethod
    def decode(cls, codes):
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor):
        x = tensor.detach().reshape(-1).to(torch.float32).cpu().numpy()
        finite = np.isfinite(x)
        has_inf = bool(np.isinf(x).any())
        amax = float(np.abs(x[finite]).max()) if finite.any() else 0.0
        flag = has_inf and not cls.has_inf
        s = pow2_scale(amax, cls.largest / 2 if flag else cls.largest)
        codes = cls.encode(x * np.float32(s))
        header = np.array([s], "<f4").tobytes() + np.array([FLAG_INF_AT_MAX if flag else 0], "<u4").tobytes()
        packet = torch.frombuffer(bytearray(header + codes.astype(codes.dtype.newbyteorder("<")).tobytes()),
                                  dtype=torch.uint8)
        return packet, (tensor.shape, tensor.dtype)

    @classmethod
    def decompress(cls, packet, ctx):
        shape, dtype = ctx
        raw = packet.cpu().numpy().tobytes()
        s = float(np.frombuffer(raw[:4], "<f4")[0])
        flags = int(np.frombuffer(raw[4:8], "<u4")[0])
        codes = np.frombuffer(raw[HEADER_BYTES:], "<u1" if cls.code_bytes == 1 else "<u2")
        with np.errstate(over="ignore"):
            values = cls.decode(codes) * np.float32(1.0 / s)
        if flags & FLAG_INF_AT_MAX:
            at_max = (codes & 0x7F) == 0x7E
            values = np.where(at_max, np.where(codes & 0x80, -np.inf, np.inf), values).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(dtype)


class Bit8Compressor(_Scaled):
    largest, code_bytes, has_inf = E4M3_MAX, 1, False

    @classmethod
    def encode(cls, x):
        return encode_e4m3(x)

    @classmethod
    def decode(cls, codes):
        return decode_e4m3(codes)


class Bit16Compressor(_Scaled):
    largest, code_bytes, has_inf = FP16_MAX, 2, True

    @classmethod
    def encode(cls, x):
        return encode_fp16(x)

    @classmethod
    def decode(cls, codes):
        return decode_fp16(codes)


def allreduce(tensor, compression, name=None):
    """Every rank's packet by allgather, each decoded, summed in float32 in rank order, / n."""
    import horovod.torch as hvd
    packet, ctx = compression.compress(tensor)
    rows = hvd.allgather(packet.reshape(1, -1), name=name)
    total = torch.zeros(tensor.numel(), dtype=torch.float32)
    for row in rows:
        total += compression.decompress(row, (total.shape, torch.float32)).reshape(-1)
    return (total / hvd.size()).reshape(tensor.shape).to(tensor.dtype)
