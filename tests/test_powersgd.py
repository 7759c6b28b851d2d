"""PowerSGD (hvd_compress/methods/powersgd.py): the one-process algorithm, and the communicator on real
ranks under horovodrun (Gloo and MPI, 2 and 4 ranks; tests/workers/powersgd_checks.py, in the
shared job of each configuration: tests/hvdrun.py)."""
import pytest
import torch

from hvdrun import across_ranks, passed_checks
from hvd_compress.methods.powersgd import PowerSGD, approximate, initial_q, matrix_shape
from hvd_compress.registry import powersgd_step_bytes


@pytest.mark.unit
def test_full_rank_is_the_exact_mean():
    gen = torch.Generator().manual_seed(0)
    ms = [torch.randn(7, 5, generator=gen) for _ in range(3)]
    approx, _ = approximate(ms, initial_q("w", 5, 5, 0))
    assert torch.allclose(approx, sum(ms) / 3, rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_low_rank_is_the_projection_onto_p():
    """Rank 1 of a rank-1 mean is exact; of a full-rank mean it is not (and the error is what
    error feedback carries)."""
    u, v = torch.randn(6, 1), torch.randn(1, 4)
    approx, _ = approximate([u @ v, 3 * u @ v], initial_q("w", 4, 1, 0))
    assert torch.allclose(approx, 2 * u @ v, rtol=1e-5, atol=1e-6)
    m = torch.randn(6, 4)
    approx, _ = approximate([m], initial_q("w", 4, 1, 0))
    assert not torch.allclose(approx, m, atol=1e-3)
    assert torch.linalg.matrix_rank(approx) == 1


@pytest.mark.unit
def test_shapes_and_bytes():
    assert matrix_shape((5,)) is None and matrix_shape(()) is None
    assert matrix_shape((32, 1, 3, 3)) == (32, 9)
    # conv 32x1x3x3 (32 x 9, r 2): 82 floats; bias 32; one rank sends 2(n-1)/n of each
    assert powersgd_step_bytes([(32, 1, 3, 3), (32,)], 2, 2) == 4 * (82 + 32)
    assert powersgd_step_bytes([(32, 1, 3, 3)], 1, 2) == 0


@pytest.mark.unit
def test_initial_q_is_the_same_on_every_rank_and_differs_by_name():
    assert torch.equal(initial_q("a", 9, 2, 0), initial_q("a", 9, 2, 0))
    assert not torch.equal(initial_q("a", 9, 2, 0), initial_q("b", 9, 2, 0))


@pytest.mark.unit
def test_rank_must_be_positive():
    with pytest.raises(ValueError, match="rank must be >= 1"):
        PowerSGD(rank=0)


@pytest.mark.unit
def test_ddp_variant_options():
    """start_iter, min_compression_rate and init (torch's powerSGD_hook's variant): defaults
    are the method as it was, bad values refused, the matrices left uncompressed those torch's
    hook leaves (its own rule as the reference)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
    assert PowerSGD(1) == PowerSGD(1, start_iter=0, min_compression_rate=0, init="name")
    assert repr(PowerSGD(1)) == "PowerSGD(rank=1)"
    assert PowerSGD(1, start_iter=2) != PowerSGD(1)
    assert "start_iter=2" in repr(PowerSGD(1, start_iter=2))
    for bad, match in (({"start_iter": -1}, "start_iter"), ({"min_compression_rate": -1}, "rate"),
                       ({"min_compression_rate": float("nan")}, "rate"), ({"init": "x"}, "init")):
        with pytest.raises(ValueError, match=match):
            PowerSGD(1, **bad)
    for rank in (1, 2, 4):
        for n, m in ((3, 3), (10, 128), (32, 9), (2, 100), (1, 5), (128, 9216)):
            assert PowerSGD(rank).compresses(n, m)
            r = min(rank, n, m)
            assert PowerSGD(rank, min_compression_rate=2).compresses(n, m) == \
                _should_compress(n, m, r, 2)[0], (rank, n, m)


@pytest.mark.multiprocess
@across_ranks("powersgd_checks")
def test_powersgd_across_ranks(controller, np, request):
    names = passed_checks(request)
    for rk in (1, 2, 8):
        for step in range(3):
            for what in ("equals_reference", "identical_on_all_ranks", "bytes_equal_formula"):
                assert f"rank{rk}.step{step}.{what}" in names
    for what in ("state_dict.resume_gives_same_bits", "optimizer.identical_on_all_ranks",
                 "optimizer.loss_falls"):
        assert what in names
