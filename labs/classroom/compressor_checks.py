"""Step 2 graded in one process: Bit8Compressor / Bit16Compressor against the reference packet.

The reference is hvd_compress.compressors (the packet the kit's spec describes: scale, flags,
codes, little-endian). Checks: round trips of shapes and dtypes, NaN and Inf kept, tiny
gradients kept (the scale), the packet bit for bit, the error bound on real gradients.
"""
import functools
import threading

import numpy as np
import torch

from hvd_compress.codecs.scaling import pow2_scale
from hvd_compress.compressors import Bit8Compressor, Bit16Compressor

from .checks import fail, ok, raised

STEP = "codecs"
HEADER = 8
# name -> (reference, code bytes, relative error bound, largest finite, half the smallest subnormal)
SPECS = {
    "Bit8Compressor": (Bit8Compressor, 1, 2.0 ** -4, 448.0, 2.0 ** -10),
    "Bit16Compressor": (Bit16Compressor, 2, 2.0 ** -11, 65504.0, 2.0 ** -25),
}
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _round_trip(compressor, x):
    packet, ctx = compressor.compress(x)
    return packet, compressor.decompress(packet, ctx)


def _same(a, b):
    """Equal values, NaN matching NaN, after float32 widening (bit for bit otherwise)."""
    a, b = a.detach().float().reshape(-1), b.detach().float().reshape(-1)
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def not_a_packet(name, x, packet, what):
    """None when `packet` is laid out as the spec's packet for `x` (a 1-D torch.uint8 tensor of
    the 8-byte header and `code bytes` per value), else a failure saying what it is: the checks
    of what compression keeps (NaN and Inf, tiny gradients, the error bound) mean nothing of a
    compressor that sends something else, the tensor itself above all."""
    code_bytes = SPECS[name][1]
    size = HEADER + code_bytes * x.numel()
    if (isinstance(packet, torch.Tensor) and packet.dtype == torch.uint8 and packet.dim() == 1
            and packet.numel() == size):
        return None
    if isinstance(packet, torch.Tensor):
        sent = packet.numel() * packet.element_size()
        got = f"{packet.dtype} {tuple(packet.shape)}, {sent} bytes"
        if x.numel() and sent >= x.numel() * 4:
            got += f" (float32 itself is {4 * x.numel()}: nothing was compressed)"
    else:
        got = type(packet).__name__
    return fail(STEP, f"{name}.{what}", f"{name}: compress must return the spec's packet, a 1-D "
                f"torch.uint8 tensor of {size} bytes for {x.numel()} values (8-byte header + "
                f"{code_bytes} per value); got {got}.",
                f"{name}：compress 必须返回规范的数据包，即 {x.numel()} 个值对应 {size} 字节的一维 "
                f"torch.uint8 张量（8 字节头 + 每值 {code_bytes} 字节）；实际为 {got}。")


def round_trip_check(name, student):
    reference, code_bytes = SPECS[name][:2]
    check = f"{name}.round_trip"
    g = torch.Generator().manual_seed(2)
    for dtype in DTYPES:
        for shape in SHAPES:
            x = (torch.randn(shape, generator=g) * 1e-3).to(dtype)
            try:
                packet, y = _round_trip(student, x)
            except Exception as err:
                return raised(STEP, check, f"{name} on a {dtype} tensor of shape {tuple(shape)}", err)
            what = f"{name}, {str(dtype)[6:]} tensor of shape {tuple(shape)}"
            size = HEADER + code_bytes * x.numel()
            if not (isinstance(packet, torch.Tensor) and packet.dtype == torch.uint8
                    and packet.dim() == 1 and packet.numel() == size):
                got = (f"{packet.dtype} {tuple(packet.shape)}" if isinstance(packet, torch.Tensor)
                       else type(packet).__name__)
                return fail(STEP, check, f"{what}: the packet must be a 1-D torch.uint8 tensor of "
                            f"{size} bytes (8-byte header + {code_bytes} per value); got {got}.",
                            f"{what}：数据包应为 {size} 字节的一维 torch.uint8 张量（8 字节头 + 每值 "
                            f"{code_bytes} 字节）；实际为 {got}。")
            if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
                got = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
                return fail(STEP, check, f"{what}: decompress must give back the shape and dtype "
                            f"({dtype} {tuple(shape)}); got {got}. Keep them in ctx.",
                            f"{what}：decompress 应恢复原形状和类型（{dtype} {tuple(shape)}）；"
                            f"实际为 {got}。请把它们放在 ctx 中。")
            want = reference.decompress(*reference.compress(x))
            bad = (~_same(y, want)).nonzero()
            if len(bad):
                i = int(bad[0])
                return fail(STEP, check, f"{what}: value {float(x.reshape(-1)[i])!r} came back as "
                            f"{float(y.reshape(-1)[i])!r}, the spec's round trip gives "
                            f"{float(want.reshape(-1)[i])!r} ({len(bad)} values differ).",
                            f"{what}：值 {float(x.reshape(-1)[i])!r} 还原为 {float(y.reshape(-1)[i])!r}，"
                            f"规范应为 {float(want.reshape(-1)[i])!r}（{len(bad)} 个值不同）。")
    return ok(STEP, check)


def nan_inf_check(name, student):
    """NaN stays NaN, +-Inf stays +-Inf, zeros stay zero: a diverging run must stay visible."""
    check = f"{name}.nan_inf"
    x = torch.tensor([1e-3, float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -2e-3])
    try:
        packet, y = _round_trip(student, x)
        y = y.float()
    except Exception as err:
        return raised(STEP, check, f"{name} on NaN and Inf", err)
    if (bad := not_a_packet(name, x, packet, "nan_inf")) is not None:
        return bad
    for i, label in ((1, "NaN"), (2, "+Inf"), (3, "-Inf"), (4, "0")):
        same = bool(_same(y[i:i + 1], x[i:i + 1]))
        if not same:
            return fail(STEP, check,
                        f"{name}: {label} came back as {float(y[i])!r} ({x.tolist()} -> {y.tolist()}). "
                        f"NaN and +-Inf must survive compression: a diverging run must stay "
                        f"visible (E4M3: scale to 224 and set flag 1 so code +-448 means +-Inf).",
                        f"{name}：{label} 还原为 {float(y[i])!r}。NaN 和 ±Inf 必须保留，发散的训练"
                        f"才能被发现（E4M3：按 224 缩放并置标志位 1，使 ±448 表示 ±Inf）。")
    return ok(STEP, check)


def tiny_gradients_check(name, student):
    """Gradients of 1e-7: kept to the format's precision, thanks to the scale."""
    check = f"{name}.tiny_gradients"
    rel = SPECS[name][2]
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(512, generator=g) + 1) * 1e-7 * torch.where(torch.rand(512, generator=g) < 0.5, -1, 1)
    try:
        packet, y = _round_trip(student, x)
        y = y.float()
    except Exception as err:
        return raised(STEP, check, f"{name} on gradients of 1e-7", err)
    if (bad := not_a_packet(name, x, packet, "tiny_gradients")) is not None:
        return bad
    err = (y - x).abs() / x.abs()
    zeros = int((y == 0).sum())
    if not zeros and not bool((err <= rel).all()):
        return fail(STEP, check,
                    f"{name}: of 512 gradients of size 1e-7 to 2e-7 none came back as 0 (the "
                    f"scale is there), but the worst relative error is {float(err.max()):.3g}, "
                    f"beyond the format's {rel:g}: the codes are not rounded to nearest (ties to "
                    f"even); check the encoder (encode_e4m3 / encode_fp16).",
                    f"{name}：512 个 1e-7 到 2e-7 的梯度没有变成 0（缩放因子已生效），但最大相对误差 "
                    f"{float(err.max()):.3g} 超过格式的上界 {rel:g}：编码没有就近取偶舍入，请检查编码函数。")
    if zeros:
        return fail(STEP, check,
                    f"{name}: of 512 gradients of size 1e-7 to 2e-7, {zeros} came back as 0 and "
                    f"the worst relative error is {float(err.max()):.3g} (bound {rel:g}). Multiply "
                    f"by the power-of-two scale (amax * s <= the largest finite value) before "
                    f"encoding, and divide after decoding.",
                    f"{name}：512 个 1e-7 到 2e-7 的梯度中 {zeros} 个变成 0，最大相对误差 "
                    f"{float(err.max()):.3g}（上界 {rel:g}）。编码前乘以 2 的幂缩放因子"
                    f"（amax * s <= 最大有限值），解码后再除回。")
    return ok(STEP, check)


def packet_check(name, student):
    """The packet, byte for byte, against the reference's: any rank must read any rank's."""
    reference, code_bytes = SPECS[name][:2]
    check = f"{name}.packet"
    g = torch.Generator().manual_seed(4)
    for label, x in (("gradients", torch.randn(257, generator=g) * 1e-3),
                     ("a tensor holding Inf", torch.tensor([1.0, float("inf"), -3.0, 5e-3]))):
        try:
            packet, _ = student.compress(x)
            got = bytes(packet.cpu().numpy().tobytes())
        except Exception as err:
            return raised(STEP, check, f"{name}.compress", err)
        want = bytes(reference.compress(x)[0].numpy().tobytes())
        if got == want:
            continue
        if len(got) != len(want):
            return fail(STEP, check, f"{name}, {label}: the packet has {len(got)} bytes, the spec's "
                        f"{len(want)} (8-byte header + {code_bytes} per value).",
                        f"{name}，{label}：数据包有 {len(got)} 字节，规范为 {len(want)} 字节。")
        scale_got = np.frombuffer(got[:4], "<f4")[0]
        scale_want = np.frombuffer(want[:4], "<f4")[0]
        if scale_got != scale_want:
            return fail(STEP, check, f"{name}, {label}: header scale {float(scale_got)!r}, the spec's "
                        f"{float(scale_want)!r}: s is the largest power of two with amax * s <= "
                        f"{SPECS[name][3]:g} (half that when the tensor holds Inf), as float32 "
                        f"little-endian in bytes 0..3.",
                        f"{name}，{label}：头部缩放因子为 {float(scale_got)!r}，规范为 {float(scale_want)!r}：s 是"
                        f"满足 amax * s <= {SPECS[name][3]:g} 的最大 2 的幂（含 Inf 时取一半）。")
        if got[4:8] != want[4:8]:
            return fail(STEP, check, f"{name}, {label}: header flags {got[4:8].hex()}, the spec's "
                        f"{want[4:8].hex()} (uint32 little-endian; 1 = code 448 means Inf, Bit8 only).",
                        f"{name}，{label}：头部标志为 {got[4:8].hex()}，规范为 {want[4:8].hex()}。")
        codes_got, codes_want = got[HEADER:], want[HEADER:]
        if code_bytes == 2 and _swapped(codes_got) == codes_want:
            return fail(STEP, check, f"{name}: the float16 codes are stored big-endian (high byte "
                        f"first); the packet's codes are little-endian, low byte first, so that a "
                        f"rank reading with the spec's layout gets your values.",
                        f"{name}：float16 编码按大端序（高字节在前）存放；数据包规定小端序（低字节在"
                        f"前），其他进程才能按规范读出你的值。")
        i = next(k for k in range(len(codes_got)) if codes_got[k] != codes_want[k]) // code_bytes
        return fail(STEP, check, f"{name}, {label}: code of value {i} ({float(x[i])!r}) is "
                    f"{codes_got[i * code_bytes:(i + 1) * code_bytes].hex()}, the spec's "
                    f"{codes_want[i * code_bytes:(i + 1) * code_bytes].hex()}.",
                    f"{name}，{label}：第 {i} 个值（{float(x[i])!r}）的编码为 "
                    f"{codes_got[i * code_bytes:(i + 1) * code_bytes].hex()}，规范为 "
                    f"{codes_want[i * code_bytes:(i + 1) * code_bytes].hex()}。")
    return ok(STEP, check)


def _swapped(codes):
    return b"".join(codes[k + 1:k + 2] + codes[k:k + 1] for k in range(0, len(codes), 2))


# torch's global RNG makes the network (and its dropout): two first calls at once (two graders'
# threads) draw from one stream, and the cache would keep one's gradients beside a plan of the
# other's (replay.plan), so the gradients are made one thread at a time
_ONE_NETWORK_AT_A_TIME = threading.Lock()


def real_gradients():
    """One step's gradients of Horovod's example network (labs.mnist.Net, 21,840 parameters:
    every kind of layer of the course's, at a 55th of the cost) on 64 Fashion-MNIST images,
    made once."""
    with _ONE_NETWORK_AT_A_TIME:
        return _real_gradients()


@functools.lru_cache(maxsize=1)
def _real_gradients():
    from labs.kit.data import load_dataset
    from labs.mnist import Net
    data = load_dataset("fashion-mnist", split_test=64, download=False)
    torch.manual_seed(0)
    model = Net()
    torch.nn.functional.nll_loss(model(data.train_x), data.train_y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def error_bound_check(name, student):
    """|decoded - g| <= rel |g| + half the smallest subnormal / s, on every real gradient."""
    _, _, rel, largest, half_sub = SPECS[name]
    check = f"{name}.error_bound"
    for tensor, grad in real_gradients().items():
        try:
            packet, y = _round_trip(student, grad)
            y = y.float()
        except Exception as err:
            return raised(STEP, check, f"{name} on the gradient of {tensor}", err)
        if (bad := not_a_packet(name, grad, packet, "error_bound")) is not None:
            return bad
        s = pow2_scale(float(grad.abs().max()), largest)
        err = (y - grad).abs()
        bound = rel * grad.abs() + half_sub / s
        if not bool((err <= bound).all()):
            i = int((err - bound).argmax())
            return fail(STEP, check, f"{name}, gradient of {tensor}: {float(grad.reshape(-1)[i])!r} came "
                        f"back as {float(y.reshape(-1)[i])!r}, beyond the bound rel*|g| + "
                        f"subnormal/2s (rel {rel:g}, s {s:g}).",
                        f"{name}，{tensor} 的梯度：{float(grad.reshape(-1)[i])!r} 还原为 "
                        f"{float(y.reshape(-1)[i])!r}，超出误差上界（相对 {rel:g}，s {s:g}）。")
    return ok(STEP, check)


def compressor_checks(module):
    results = []
    for name in SPECS:
        student = getattr(module, name, None)
        for check in (round_trip_check, nan_inf_check, tiny_gradients_check, packet_check, error_bound_check):
            if student is None:
                results.append(fail(STEP, f"{name}.{check.__name__[:-6]}",
                                    f"compression.py has no class {name}.",
                                    f"compression.py 中没有 {name} 类。"))
            else:
                results.append(check(name, student))
    return results
