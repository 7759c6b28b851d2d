"""hvd_compress.fsdp (docs/fsdp.md) under FSDP2's other configurations on real Gloo ranks, 2 and
4 of them, launched as tests/ddprun.py launches them, with the checks in
tests/fsdp_workers/fsdp_configs.py: HSDP (4 ranks as 2 replicas of 2 shards), gradient
accumulation without reduction, a module whose parameters do not all get a gradient, and
parameters sharded on dim 1."""
import pytest

import ddprun
import hvd_compress.fsdp as hcf

MODULE = "fsdp_workers.fsdp_configs"
CODECS = ("bit8", "bit8+ef", "bit16", "bit16+ef", "bf16", "bf16+ef", "fp16", "int8", "int8+ef")
_JOBS = {}


def passed(np, tmp_path_factory):
    job = _JOBS.get(np)
    if job is None:
        job = _JOBS[np] = ddprun.run_job(np, [MODULE],
                                         tmp_path_factory.mktemp(f"fsdp-configs-{np}"))
    names, problem = job.module_checks(MODULE)
    if problem:
        pytest.fail(problem, pytrace=False)
    return set(names)


def holds(names, label, none_label=None):
    """The three checks every configuration runs: none = FSDP2's, ranks alike, residuals."""
    assert any(k.startswith(f"{none_label or label}: none = FSDP2's default after")
               for k in names), label
    for tag in CODECS:
        assert f"{label}: {tag} leaves every rank with the same parameters" in names
    assert f"{label}: bit8+ef's residuals telescope: reduced sums + correction = FSDP2's" \
        in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_gradient_accumulation_without_sync_reduces_once(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    holds(names, "accumulating 2 batches")
    assert ("accumulating 2 batches: one reduce-scatter a module and a step, steps counted"
            in names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_a_parameter_without_gradient_keeps_its_residual(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    holds(names, "a parameter without gradient")
    assert ("a parameter without gradient: residuals named by parameter and shard (none for "
            "the one never reduced)") in names
    assert ("a parameter without gradient keeps its residual through the step it misses, the "
            "others' change") in names
    assert "a parameter never given a gradient has no residual" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_parameters_sharded_on_dim_1(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    assert "Shard(1): FSDP2 shards fc1.weight and fc2.weight on dim 1" in names
    holds(names, "Shard(1)")


@pytest.mark.multiprocess
def test_hsdp_replicas_stay_identical_and_resume(tmp_path_factory):
    names = passed(4, tmp_path_factory)
    holds(names, "HSDP 2x2", "HSDP 2x2 (float32)")
    assert any(k.startswith("HSDP 2x2 (reduce_dtype=float16): none = FSDP2's default")
               for k in names)
    assert ("HSDP 2x2, all-reduce on the last of 2 batches: bit8+ef's residuals telescope: "
            "reduced sums + correction = FSDP2's") in names
    assert "HSDP 2x2: replicas that register different codecs are refused on every rank" in names
    assert "HSDP 2x2: DCP gives every rank (each replica) its own residuals back" in names
    assert "HSDP 2x2: bit8+ef resumed from DCP = never stopped, bit for bit" in names


@pytest.mark.unit
def test_an_input_of_no_known_parameters_is_refused_by_name():
    """The input FSDP2 hands holds every parameter, or those post_backward picked; else the
    residual's pieces cannot be named, and the collective says so instead of guessing."""
    comm = hcf.CompressedReduceScatter(None, "fsdp.fc", ["fc.weight", "fc.bias", "fc.x"],
                                       [6, 2, 3])
    assert comm._present(2 * 11, 2) is None                       # every parameter
    comm.present = (0, 2)
    assert comm._present(2 * 9, 2) == (0, 2)
    assert comm.members(2, (0, 2)) == (["fc.weight#shard0of2", "fc.x#shard0of2",
                                        "fc.weight#shard1of2", "fc.x#shard1of2"], [6, 3, 6, 3])
    with pytest.raises(ValueError, match=r"fsdp.fc: .* \(fc.weight, fc.x\)"):
        comm._present(2 * 8, 2)
