"""Run under horovodrun (tests/workers/suite.py, or alone): odd gradients through
hc.DistributedOptimizer on every route.

NaN/Inf on one rank must reach every rank as NaN/Inf (a diverging run stays visible); empty,
0-d, non-contiguous and channels-last gradients, float16/bfloat16/float64 parameters, and
parameters without a gradient on some rank must all come out right and identical everywhere;
a sparse gradient is refused with a clear error.
"""
import torch
import horovod.torch as hvd

import checks
from checks import check

import hvd_compress as hc
from hvd_compress.compressors import compressor_name

ROUTES = [(hc.Compression.none, None), (hc.Compression.fp16, None),
          (hc.Compression.bit8, "allgather"), (hc.Compression.bit8, "alltoall"),
          (hc.Compression.bit16, "allgather"), (hc.Compression.bit16, "alltoall")]


def name_of(comp, reduction):
    return f"{compressor_name(comp)}.{reduction}"


def exchange(params, comp, reduction, lr=0.0):
    opt = hc.DistributedOptimizer(torch.optim.SGD(params.values(), lr=lr),
                                  named_parameters=list(params.items()),
                                  compression=comp, route=reduction)
    opt.synchronize()
    return {k: (None if p.grad is None else p.grad.clone()) for k, p in params.items()}


def same_everywhere(t, tag):
    bits = t.detach().reshape(1, -1).contiguous()
    if bits.dtype in (torch.float16, torch.bfloat16):
        bits = bits.view(torch.int16)
    elif bits.dtype == torch.float64:
        bits = bits.view(torch.int64)
    elif bits.dtype == torch.float32:
        bits = bits.view(torch.int32)
    everyone = hvd.allgather(bits, name=tag)
    return all(torch.equal(everyone[0], everyone[r]) for r in range(hvd.size()))


def run(hvd):
    N, RANK = hvd.size(), hvd.rank()
    for comp, reduction in ROUTES:
        tag = name_of(comp, reduction)

        # NaN and Inf from rank 0 only
        w = torch.nn.Parameter(torch.zeros(6))
        w.grad = torch.full((6,), 1e-3)
        if RANK == 0:
            w.grad[1], w.grad[2], w.grad[3] = float("nan"), float("inf"), float("-inf")
        g = exchange({"w": w}, comp, reduction)["w"]
        check(f"{tag}.nan_stays_nan", bool(torch.isnan(g[1])))
        check(f"{tag}.inf_stays_inf", bool(g[2] == float("inf")) and bool(g[3] == float("-inf")),
              f"{g.tolist()}")
        check(f"{tag}.finite_stay_finite", bool(torch.isfinite(g[[0, 4, 5]]).all()))

        # odd shapes and layouts; a parameter whose gradient only rank 0 computed
        base = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(RANK)) * 1e-3
        params = {
            "empty": torch.nn.Parameter(torch.zeros(0, 4)),
            "scalar": torch.nn.Parameter(torch.zeros(())),
            "transposed": torch.nn.Parameter(torch.zeros(5, 4, 3, 2)),
            "channels_last": torch.nn.Parameter(torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)),
            "only_rank0": torch.nn.Parameter(torch.zeros(7)),
        }
        params["empty"].grad = torch.zeros(0, 4)
        params["scalar"].grad = torch.tensor(1e-3 * (RANK + 1))
        params["transposed"].grad = base.permute(3, 2, 1, 0)            # non-contiguous
        params["channels_last"].grad = base.contiguous(memory_format=torch.channels_last)
        if RANK == 0:
            params["only_rank0"].grad = torch.full((7,), 2e-3)
        grads = exchange(params, comp, reduction)
        for key, g in grads.items():
            check(f"{tag}.{key}.shape", g is not None and g.shape == params[key].shape)
            check(f"{tag}.{key}.same_on_all_ranks", same_everywhere(g, f"{tag}.{key}"))
        expected_scalar = 1e-3 * (N + 1) / 2
        check(f"{tag}.scalar.value", abs(float(grads["scalar"]) - expected_scalar) <= 2 ** -4 * expected_scalar)
        check(f"{tag}.only_rank0.value",
              torch.allclose(grads["only_rank0"], torch.full((7,), 2e-3 / N), rtol=2 ** -4))
        check(f"{tag}.transposed_equals_channels_last",
              torch.allclose(grads["transposed"].permute(3, 2, 1, 0), grads["channels_last"], rtol=2 ** -3, atol=1e-6))

        # parameter dtypes other than float32
        for dtype in (torch.float16, torch.bfloat16, torch.float64):
            p = torch.nn.Parameter(torch.zeros(33, dtype=dtype))
            p.grad = (torch.linspace(-1, 1, 33) * 1e-2 * (RANK + 1)).to(dtype)
            g = exchange({"p": p}, comp, reduction)["p"]
            ref = torch.linspace(-1, 1, 33) * 1e-2 * (N + 1) / 2
            check(f"{tag}.{dtype}.dtype_kept", g.dtype == dtype)
            check(f"{tag}.{dtype}.close", torch.allclose(g.double(), ref.double(), rtol=2 ** -3, atol=1e-4),
                  f"max diff {(g.double() - ref.double()).abs().max()}")

        # sparse gradients: a clear refusal on every rank, nothing exchanged half-way
        e = torch.nn.Parameter(torch.zeros(10, 3))
        e.grad = torch.sparse_coo_tensor([[1, 4]], torch.ones(2, 3), (10, 3))
        try:
            exchange({"emb": e}, comp, reduction)
            refused = False
        except ValueError as err:
            refused = "sparse" in str(err)
        check(f"{tag}.sparse_refused_clearly", refused)


if __name__ == "__main__":
    checks.main(run)
