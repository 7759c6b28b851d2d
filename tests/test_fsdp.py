"""hvd_compress.fsdp (docs/fsdp.md) on real Gloo ranks, 2 and 4 of them: FSDP2 models built with
fully_shard, trained by tests/fsdp_workers/fsdp_checks.py (launched as tests/ddprun.py launches
the DDP workers); each test reads the checks its job's ranks passed."""
import pytest
import torch.nn as nn

import ddprun
import hvd_compress.fsdp as hcf

MODULE = "fsdp_workers.fsdp_checks"
CODECS = ("bit8", "bit16", "bf16", "fp16", "int8")
_JOBS = {}


def passed(np, tmp_path_factory):
    job = _JOBS.get(np)
    if job is None:
        job = _JOBS[np] = ddprun.run_job(np, [MODULE], tmp_path_factory.mktemp(f"fsdp-{np}"))
    names, problem = job.module_checks(MODULE)
    if problem:
        pytest.fail(problem, pytrace=False)
    return set(names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_none_equals_fsdp2s_own_reduce_scatter(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    for label in ("float32", "reduce_dtype=float16"):
        assert ("none = FSDP2's default reduce-scatter after 4 steps, bit for bit "
                f"({label})") in names
        assert f"none: 4 steps counted ({label})" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_every_codec_reduces_near_fsdp2_and_keeps_ranks_alike(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    for scheme in CODECS:
        for tag in ((scheme, scheme + "+ef") if scheme != "fp16" else (scheme,)):
            assert any(k.startswith(f"{tag}: one step's gradient shards within") for k in names)
            assert f"{tag}: sends at most {0.27 if scheme in ('bit8', 'int8') else 0.51} of " \
                "none's bytes" in names
            assert f"{tag}: 4 steps give the same bits run after run" in names
            assert f"{tag}: every rank holds the same full parameters" in names
    for label in ("bfloat16", "float16"):
        assert any(k.startswith(f"bit8 with reduce_dtype={label}: gradient shards within")
                   for k in names)
    assert "async_op=True: a completed Work, the output reduced" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_error_feedback_is_kept_per_shard_and_resumed(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    for scheme in ("bit8", "bf16"):
        assert f"{scheme}+ef: residuals named by parameter and shard" in names
        assert f"{scheme}+ef: residuals are not zero" in names
        assert f"{scheme}+ef: resumed from the checkpoint = never stopped, bit for bit" in names
        assert f"{scheme}+ef: resumed without the residuals differs (they matter)" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_bad_input_gets_a_clear_error(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    assert "a nan gradient on rank 0 raises FloatingPointError on every rank" in names
    assert f"a inf gradient on rank {np - 1} raises FloatingPointError on every rank" in names
    assert "after the non-finite gradient no rank is left in a collective" in names
    assert "on_nonfinite='pass': a NaN from rank 0 reaches every rank's shards" in names
    assert ("set_gradient_divide_factor (PREMUL_SUM) is refused with a clear error on every "
            "rank") in names
    assert "ranks that register different schemes are refused on every rank" in names
    for label in ("an unknown scheme", "a model without fully_shard",
                  "top-k (a collective of its own)", "error feedback on none",
                  "a bad on_nonfinite"):
        assert f"{label} is refused with a clear error" in names


@pytest.mark.unit
def test_a_model_without_fully_shard_is_refused_before_any_collective():
    with pytest.raises(ValueError, match="wrapped by torch.distributed.fsdp.fully_shard"):
        hcf.register(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)), "bit8")
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        hcf.register(nn.Linear(2, 2), "bit8", on_nonfinite="warn")


@pytest.mark.unit
def test_residuals_are_named_as_fsdp2_lays_out_its_rows():
    """Row k of FSDP2's input holds every parameter's k-th chunk, in the module's order."""
    comm = hcf.CompressedReduceScatter(None, "fsdp.fc", ["fc.weight", "fc.bias"], [6, 2])
    assert comm.members(2) == (["fc.weight#shard0of2", "fc.bias#shard0of2",
                                "fc.weight#shard1of2", "fc.bias#shard1of2"], [6, 2, 6, 2])
