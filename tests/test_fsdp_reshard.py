"""hvd_compress.fsdp's checkpoints loaded at another world size (docs/fsdp.md, "Checkpoints"):
the recut of the residuals (checkpoint.carry) against a direct sum in full-parameter
coordinates, and real Gloo jobs (tests/fsdp_workers/fsdp_reshard.py, launched as tests/ddprun.py
launches them): 2 ranks save, 4 ranks load the 2's and save, 2 ranks load the 4's."""
import pytest
import torch

import ddprun
from hvd_compress.fsdp.checkpoint import carry, padded_numel, shard_rows

MODULE = "fsdp_workers.fsdp_reshard"
CASES = ("bit8+ef", "bf16+ef", "none")
# job -> (ranks, the job whose checkpoints it loads)
JOBS = {"2": (2, None), "4": (4, "2"), "2b": (2, "4")}
_JOBS = {}


def saved_pieces(shape, n, ranks, seed):
    """Random residuals of `ranks` ranks for every shard of n (padding included), and their sum
    over the ranks in full-parameter coordinates (rank order, float32)."""
    g = torch.Generator().manual_seed(seed)
    numel = padded_numel(shape, n)
    rows = torch.randn(ranks, n * numel, generator=g)        # rank r's pieces, shard by shard
    saved = {j: rows[:, j * numel:(j + 1) * numel] for j in range(n)}
    total = rows[0].clone()
    for r in range(1, ranks):
        total += rows[r]
    return saved, total[:torch.Size(shape).numel()]


@pytest.mark.unit
@pytest.mark.parametrize("shape", [(5, 3), (35,), (4, 2), (1, 7)])
@pytest.mark.parametrize("n,new_n", [(2, 4), (4, 2), (3, 2), (2, 3), (4, 1), (1, 4)])
def test_the_recut_puts_the_ranks_sum_in_the_new_shards(shape, n, new_n):
    saved, total = saved_pieces(shape, n, n, seed=n * 10 + new_n)
    rest = torch.Size(shape[1:]).numel()
    for ratio in (1.0, new_n / n):
        pieces = [carry(saved, shape, n, new_n, k, ratio) for k in range(new_n)]
        assert all(p.numel() == padded_numel(shape, new_n) for p in pieces)
        got = torch.cat([p[:(b - a) * rest] for p, (a, b) in
                         zip(pieces, (shard_rows(shape[0], new_n, k) for k in range(new_n)))])
        assert torch.equal(got, total * ratio)                    # one rounding: the multiply
        pads = [p[(b - a) * rest:] for p, (a, b) in
                zip(pieces, (shard_rows(shape[0], new_n, k) for k in range(new_n)))]
        assert all(not p.any() for p in pads)                     # FSDP2's padding stays zero


@pytest.mark.unit
def test_a_recut_reads_only_the_shards_it_overlaps():
    saved, total = saved_pieces((8, 2), 4, 4, seed=1)
    mine = carry({j: saved[j] for j in (2, 3)}, (8, 2), 4, 2, 1)   # rows 4..7: old shards 2, 3
    assert torch.equal(mine, total[8:])


def job(name, tmp_path_factory):
    if name not in _JOBS:
        np, source = JOBS[name]
        env = None
        if source is not None:
            env = {"HVDC_RESHARD_FROM": str(job(source, tmp_path_factory).workdir
                                            / f"reshard-np{JOBS[source][0]}")}
        _JOBS[name] = ddprun.run_job(np, [MODULE], tmp_path_factory.mktemp(f"fsdp-reshard-{name}"),
                                     env_extra=env)
    return _JOBS[name]


def passed(name, tmp_path_factory):
    names, problem = job(name, tmp_path_factory).module_checks(MODULE)
    if problem:
        pytest.fail(problem, pytrace=False)
    return set(names)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,saved", [("4", 2), ("2b", 4)])
def test_a_checkpoint_loads_at_another_world_size(name, saved, tmp_path_factory):
    names = passed(name, tmp_path_factory)
    for case in CASES:
        assert (f"{case}: loaded from {saved} ranks, the model and Adam equal the saved ones, "
                "bit for bit") in names
        assert (f"{case}: the per-element total correction is carried bit for bit, the step "
                "count too") in names
        assert f"{case}: the resharded run goes on, alike on every rank" in names
        if "+ef" in case:
            assert f"{case}: without the carried residuals the run differs (they matter)" in names


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ("4", "2b"))
def test_a_jobs_own_dcp_save_is_resharded_and_another_scheme_refused(name, tmp_path_factory):
    names = passed(name, tmp_path_factory)
    assert "a job's own dcp.save of the front is resharded by load_compression_state" in names
    assert ("another world size's checkpoint of another scheme is still refused, nothing loaded"
            in names)
