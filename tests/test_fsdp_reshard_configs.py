"""hvd_compress.fsdp's checkpoints loaded at another world size under FSDP2's other
configurations (docs/fsdp.md, "Another world size"): float16 gradients (FSDP2's pre-divide),
parameters sharded on dim 1, and HSDP's 2 x 2 ranks loaded without replicas. Real Gloo jobs
(tests/fsdp_workers/fsdp_reshard_configs.py, launched as tests/ddprun.py launches them): 2 ranks
save, 4 ranks load the 2's and save (HSDP too, which they also load on 4 ranks without
replicas), 2 ranks load the 4's. The recut on dim 1 against a direct sum (unit)."""
import pytest
import torch

import ddprun
from hvd_compress.fsdp.checkpoint import carry, padded_numel

MODULE = "fsdp_workers.fsdp_reshard_configs"
# job -> (ranks, the job whose checkpoints it loads)
JOBS = {"2": (2, None), "4": (4, "2"), "2b": (2, "4")}
_JOBS = {}


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(3, 8), (2, 8, 3), (5, 4)])
@pytest.mark.parametrize("n,new_n", [(2, 4), (4, 2), (1, 4), (4, 1), (2, 2)])
def test_the_recut_on_dim_1_puts_the_ranks_sum_in_the_new_shards(shape, n, new_n):
    """FSDP2's Shard(1): shard k is torch.chunk(param, n, dim=1)[k], laid out contiguous."""
    g = torch.Generator().manual_seed(n * 10 + new_n)
    numel = padded_numel(shape, n, 1)
    assert numel * n == torch.Size(shape).numel()              # dim 1 even: no padding
    full = torch.randn(n, *shape, generator=g)                  # every saved rank's residual
    saved = {j: torch.stack([c.contiguous().reshape(-1)
                             for c in (r.chunk(n, dim=1)[j] for r in full)]) for j in range(n)}
    total = full[0].clone()
    for r in range(1, n):
        total += full[r]
    for ratio in (1.0, 0.5):
        pieces = [carry(saved, shape, n, new_n, k, ratio, dim=1) for k in range(new_n)]
        want = [c.contiguous().reshape(-1) * ratio for c in total.chunk(new_n, dim=1)]
        assert all(torch.equal(p, w) for p, w in zip(pieces, want))


@pytest.mark.unit
def test_a_dim_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="evenly"):
        carry({0: torch.zeros(1, 6)}, (2, 3), 1, 2, 0, dim=1)


def job(name, tmp_path_factory):
    if name not in _JOBS:
        np, source = JOBS[name]
        env = None
        if source is not None:
            env = {"HVDC_RESHARD_FROM": str(job(source, tmp_path_factory).workdir
                                            / f"reshard-configs-np{JOBS[source][0]}")}
        _JOBS[name] = ddprun.run_job(np, [MODULE],
                                     tmp_path_factory.mktemp(f"fsdp-reshard-configs-{name}"),
                                     env_extra=env)
    return _JOBS[name]


def passed(name, tmp_path_factory):
    names, problem = job(name, tmp_path_factory).module_checks(MODULE)
    if problem:
        pytest.fail(problem, pytrace=False)
    return set(names)


def carried(names, into):
    for what in ("the model and Adam equal the saved ones, bit for bit",
                 "the per-element total correction is carried bit for bit, the step count too",
                 "the resharded run goes on, alike on every rank",
                 "without the carried residuals the run differs (they matter)"):
        assert f"{into}: {what}" in names, into


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,saved,ranks", [("4", 2, 4), ("2b", 4, 2)])
def test_float16_gradients_reshard_by_fsdp2s_divisor(name, saved, ranks, tmp_path_factory):
    carried(passed(name, tmp_path_factory), f"fp16 reduce, {saved} ranks into {ranks}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,saved,ranks", [("4", 2, 4), ("2b", 4, 2)])
def test_parameters_sharded_on_dim_1_reshard(name, saved, ranks, tmp_path_factory):
    carried(passed(name, tmp_path_factory), f"Shard(1), {saved} ranks into {ranks}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,ranks", [("4", 4), ("2b", 2)])
def test_hsdp_loads_without_replicas(name, ranks, tmp_path_factory):
    carried(passed(name, tmp_path_factory), f"HSDP 2x2, 4 ranks into {ranks}")
