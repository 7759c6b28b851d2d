"""hvd_compress.fsdp's compression state in torch.distributed.checkpoint (docs/fsdp.md,
"Checkpoints") on real Gloo ranks, 2 and 4 of them, launched as tests/ddprun.py launches them,
with the checks in tests/fsdp_workers/fsdp_dcp.py. The 4-rank job also loads a checkpoint the
2-rank job saved (another world size: resharded), so the 2-rank job runs first."""
import pytest

import ddprun

MODULE = "fsdp_workers.fsdp_dcp"
CASES = ("none", "bf16+ef", "bit8+ef", "bit8+ef, weights=bit8")
_JOBS = {}


def job(np, tmp_path_factory):
    if np not in _JOBS:
        env = None
        if np == 4:
            two = job(2, tmp_path_factory)
            env = {"HVDC_FOREIGN_CHECKPOINT": str(two.workdir / "ckpt-bit8+ef")}
        _JOBS[np] = ddprun.run_job(np, [MODULE], tmp_path_factory.mktemp(f"fsdp-dcp-{np}"),
                                   env_extra=env)
    return _JOBS[np]


def passed(np, tmp_path_factory):
    names, problem = job(np, tmp_path_factory).module_checks(MODULE)
    if problem:
        pytest.fail(problem, pytrace=False)
    return set(names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_a_run_resumed_from_dcp_equals_one_that_never_stopped(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    for case in CASES:
        assert f"{case}: resumed from DCP = never stopped, bit for bit, every rank alike" in names
        if "+ef" in case:
            assert f"{case}: resumed without the residuals differs (they matter)" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_the_front_is_dcps_stateful(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    assert ("the front is DCP's Stateful: this rank's own residuals come back, by name"
            in names)
    assert "a job's own dcp.save/dcp.load of the front resumes bit for bit" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("np", (2, 4))
def test_a_checkpoint_of_another_setup_is_refused(np, tmp_path_factory):
    names = passed(np, tmp_path_factory)
    assert "a checkpoint of another scheme is refused on every rank, nothing loaded" in names
    assert "a folder without a checkpoint is refused with a clear error" in names
    if np == 4:
        assert ("a checkpoint of another world size is resharded, not refused (what it carries: "
                "tests/test_fsdp_reshard.py)" in names)
