"""Top-K sparsification (hvd_compress/methods/topk.py): selection, residual, sparse sum, and the
communicator on real ranks under horovodrun (tests/workers/topk_checks.py, in the shared job of
each configuration: tests/hvdrun.py)."""
import math

import pytest
import torch

from hvdrun import across_ranks, passed_checks
from hvd_compress.exchange.memory import ResidualMemory
from hvd_compress.methods.topk import TopK, scatter_sum, select
from hvd_compress.registry import topk_step_bytes


@pytest.mark.unit
@pytest.mark.parametrize("numel,ratio", [(1, 0.01), (100, 0.01), (1000, 0.013), (4097, 0.5), (50, 1.0)])
def test_select_takes_exactly_the_k_largest(numel, ratio):
    gen = torch.Generator().manual_seed(numel)
    g = torch.randn(numel, generator=gen)
    k = TopK(ratio).k(numel)
    assert k == min(numel, max(1, math.ceil(ratio * numel)))
    idx = select(g, k)
    assert idx.numel() == k and torch.equal(idx, idx.sort().values)
    chosen = torch.zeros(numel, dtype=torch.bool)
    chosen[idx] = True
    if k < numel:
        assert g.abs()[chosen].min() >= g.abs()[~chosen].max()


@pytest.mark.unit
def test_ties_go_to_the_lowest_indices_and_nan_counts_as_largest():
    g = torch.tensor([0.5, -2.0, 0.5, 0.5, float("nan"), 0.1, -0.5])
    assert select(g, 3).tolist() == [0, 1, 4]          # NaN, 2.0, then the first 0.5
    assert select(g, 5).tolist() == [0, 1, 2, 3, 4]
    assert select(torch.zeros(4), 2).tolist() == [0, 1]


@pytest.mark.unit
def test_residual_is_what_was_not_sent():
    g = torch.tensor([3.0, -1.0, 0.2, -4.0, 0.0])
    idx = select(g, 2)
    kept = torch.zeros_like(g)
    kept[idx] = g[idx]
    mem = ResidualMemory()
    residual = mem.remember("w", g, kept)
    assert torch.equal(residual, torch.tensor([0.0, -1.0, 0.2, 0.0, 0.0]))
    assert torch.equal(mem.compensate("w", torch.zeros(5)), residual)


@pytest.mark.unit
def test_sparse_sum_equals_the_dense_sum_of_what_was_sent():
    gen = torch.Generator().manual_seed(3)
    gs = [torch.randn(300, generator=gen) for _ in range(3)]
    idxs = [select(g, 30) for g in gs]
    dense = torch.zeros(300)
    for g, idx in zip(gs, idxs):
        d = torch.zeros(300)
        d[idx] = g[idx]
        dense += d
    assert torch.equal(scatter_sum(idxs, [g[i] for g, i in zip(gs, idxs)], 300), dense)


@pytest.mark.unit
def test_bytes_and_bad_ratio():
    assert topk_step_bytes([(1000,), (10,)], 2, 0.01) == 8 * (10 + 1)
    assert topk_step_bytes([(1000,)], 4, 0.01) == 3 * 8 * 10
    assert topk_step_bytes([(1000,)], 1, 0.01) == 0
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError, match="ratio must be in"):
            TopK(bad)


@pytest.mark.multiprocess
@across_ranks("topk_checks")
def test_topk_across_ranks(controller, np, request):
    names = passed_checks(request)
    for ratio in (0.01, 0.1, 1.0):
        for step in range(3):
            for what in ("equals_reference_bit_for_bit", "identical_on_all_ranks", "bytes_equal_formula"):
                assert f"ratio{ratio}.step{step}.{what}" in names
    assert "optimizer.identical_on_all_ranks" in names and "optimizer.loss_falls" in names
