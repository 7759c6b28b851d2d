"""hvd_compress.fsdp's weights' all-gather (register(..., weights=...), docs/fsdp.md) on real
Gloo ranks, 2 and 4 of them, launched as tests/ddprun.py launches them, with the checks in
tests/fsdp_workers/fsdp_weights.py; each test reads the checks its job's ranks passed."""
import pytest
import torch.nn as nn

import ddprun
import hvd_compress.fsdp as hcf

MODULE = "fsdp_workers.fsdp_weights"
SCHEMES = ("bit8", "int8", "bf16", "bit16")
_JOBS = {}


def passed(np, tmp_path_factory):
    job = _JOBS.get(np)
    if job is None:
        job = _JOBS[np] = ddprun.run_job(np, [MODULE],
                                         tmp_path_factory.mktemp(f"fsdp-weights-{np}"))
    names, problem = job.module_checks(MODULE)
    if problem:
        pytest.fail(problem, pytrace=False)
    return set(names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_weights_none_is_fsdp2s_own_all_gather(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    assert "weights=none = FSDP2's default all-gather after 4 steps, bit for bit" in names
    assert ("weights=none counts what it sends: (n-1) x the shards, each forward and backward"
            in names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_every_rank_computes_with_the_same_decoded_weights(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    for s in SCHEMES:
        assert f"weights={s}: the gathered weights are every shard encoded and decoded" in names
        assert f"weights={s}: every rank gathers the same weights" in names
        assert any(k.startswith(f"weights={s}: the gathered weights within") for k in names)
        assert f"weights={s}: the forward equals a plain module's on the decoded weights" in names
        assert f"weights={s}: the backward's gradient is the one on the decoded weights" in names
        assert any(k.startswith(f"weights={s}: sends at most") for k in names)
        assert f"weights={s}: the optimizer updates the exact float32 shards" in names
        assert f"bit8+ef gradients, weights={s}: 4 steps give the same bits run after run" in names
        assert f"bit8+ef gradients, weights={s}: every rank holds the same parameters" in names
    for label in ("param_dtype=bfloat16", "reshard_after_forward=False"):
        assert (f"weights=bit8 with {label}: gathered within 0.05, trains alike on every rank"
                in names)
    assert ("odd sizes: the gathered weights are every shard encoded and decoded, every rank "
            "alike, and the forward is theirs") in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_kept_codes_spare_the_backwards_gather(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    for s in ("bit8", "int8"):
        assert (f"keep_weight_codes, weights={s}: 4 steps equal the run that gathers again, bit "
                "for bit, every rank alike") in names
        assert (f"keep_weight_codes, weights={s}: a forward and backward sends half, and "
                "nothing is kept after the backward") in names
    assert ("keep_weight_codes: the backward sees the forward's weights where the shards "
            "changed in between (gathering again sees the changed ones)") in names
    assert "keep_weight_codes keeps the codes of the modules resharded after forward only" in names
    assert "ranks that keep the weights' codes differently are refused on every rank" in names
    assert "keep_weight_codes without a weights codec is refused with a clear error" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_gathers_in_pieces_give_the_same_bits(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    assert ("gather_pieces=True: the weights' and gradients' codes in pieces give the bits of "
            "whole gathers, every rank alike") in names
    assert "gather_pieces=None decides after the first steps, alike on every rank" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_bad_weights_get_a_clear_error(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    assert "a NaN weight on rank 0 raises FloatingPointError on every rank, naming it" in names
    assert ("after the NaN weight no rank is left in a collective, and the shards are kept"
            in names)
    assert "an all-gather of the wrong sizes is refused with a clear error" in names
    assert "non-float parameters are refused with a clear error, naming them" in names
    assert "ranks that gather weights differently are refused on every rank" in names
    for label in ("a model without fully_shard", "fp16 weights (a cast: FSDP2's param_dtype)",
                  "top-k weights", "an unknown weights scheme"):
        assert f"{label} is refused with a clear error" in names


@pytest.mark.unit
def test_weights_are_refused_before_any_collective():
    with pytest.raises(ValueError, match="weights must be None or one of"):
        hcf.register(nn.Linear(2, 2), "bit8", weights="onebit")
    with pytest.raises(ValueError, match="wrapped by torch.distributed.fsdp.fully_shard"):
        hcf.register(nn.Linear(2, 2), "bit8", weights="bit8")
    for weights in (None, "none"):
        with pytest.raises(ValueError, match="keep_weight_codes keeps the codes"):
            hcf.register(nn.Linear(2, 2), "bit8", weights=weights, keep_weight_codes=True)


@pytest.mark.unit
@pytest.mark.parametrize("bad", (float("nan"), float("inf"), -float("inf")))
def test_all_finite_finds_one_bad_value_anywhere(bad):
    import torch
    from hvd_compress.fsdp.all_gather import all_finite
    x = torch.randn(1001, generator=torch.Generator().manual_seed(1))
    assert all_finite(x) and all_finite(x[:0])
    assert all_finite(torch.full((7,), 3e38))           # finite, though a sum would overflow
    for at in (0, 500, 1000):
        y = x.clone()
        y[at] = bad
        assert not all_finite(y), at


@pytest.mark.unit
def test_int8_weights_round_to_nearest_the_same_codes_every_time():
    import torch
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    size = hcf.NearestInt8.message_bytes(x.numel(), 256)
    codes = [hcf.NearestInt8.encode_message(x, torch.zeros(size, dtype=torch.uint8), 256)
             for _ in range(2)]
    back = torch.empty_like(x)
    hcf.NearestInt8.decode_messages(codes[0].view(1, -1), x.numel(), back, 256)
    scale = x.view(-1)[:1000].abs().max() / 127
    assert torch.equal(codes[0], codes[1])
    assert (back - x).abs().max() <= scale / 2 * (1 + 1e-6)
