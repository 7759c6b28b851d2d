"""hvd_compress.fsdp's checkpoints resharded under FSDP2's other configurations, on real Gloo ranks
(tests/test_fsdp_reshard_configs.py starts them through tests/ddprun.py): float16 gradients
(FSDP2's pre-divide: the reduce's divisor D is n / 2 on 2 and 4 ranks, not n), parameters
sharded on dim 1 (shard_placement_fn), and HSDP (2 replicas of 2 shards: D = 4, the residuals
on all 4 ranks). Every job saves, after 2 steps with Adam and bit8 with error feedback, one
checkpoint a case and, beside it, what a load must restore: the full parameters and Adam's
state, and the per-element total correction (every rank's residual pieces in full-parameter
coordinates, summed over the ranks in rank order in float32, over D). A job given another
job's folder ($HVDC_RESHARD_FROM) loads its checkpoints at its own world size (and, for the
HSDP one, without replicas) and checks the model and Adam bit for bit, the total correction
bit for bit, the step count, that the run goes on alike on every rank, and that the carried
residuals change it.
"""
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import hvd_compress.fsdp as hcf
from hvd_compress.fsdp.checkpoint import shard_rows
from checks import check
from fsdp_workers.fsdp_checks import Net, batches, folder, same_on_every_rank, steps
from fsdp_workers.fsdp_configs import on_dim1, sharded
from fsdp_workers.fsdp_reshard import equal, restored

FP16 = MixedPrecisionPolicy(reduce_dtype=torch.float16)


def cases(n):
    """name -> (mesh shape, mp policy, placement fn, D): what the job at n ranks saves."""
    found = {"fp16 reduce": ((n,), FP16, None, n / 2),      # FSDP2's pre-divide: 2 on 2 or 4
             "Shard(1)": ((n,), None, on_dim1, n)}
    if n == 4:
        found["HSDP 2x2"] = ((2, 2), None, None, 4)
    return found


_MESHES = {}


def mesh_of(shape):
    """One mesh a shape for the job (each init_device_mesh makes process groups)."""
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")) \
            if len(shape) == 2 else init_device_mesh("cpu", shape)
    return _MESHES[shape]


def make(shape, mp, placement):
    net = sharded(Net, mesh_of(shape), mp, placement)
    state = hcf.register(net, "bit8", error_feedback=True)
    return net, torch.optim.Adam(net.parameters(), lr=0.01), state


def total_correction(net, state, divisor):
    """Per parameter, every rank's (every replica's) residual pieces in full-parameter
    coordinates (FSDP2's chunks on the parameter's shard dim, the padding cut off), summed over
    the ranks in rank order (float32), over the reduce's divisor."""
    n = state.engine.size()
    params = {fqn: (tuple(p.shape), p.placements[-1].dim) for fqn, p in net.named_parameters()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, state.compression_state_dict()["residuals"])
    totals = {}
    for residuals in every:
        for fqn, (shape, dim) in params.items():
            before = int(torch.Size(shape[:dim]).numel())
            d, after = shape[dim], int(torch.Size(shape[dim + 1:]).numel())
            whole = torch.zeros(before, d, after)
            for k in range(n):
                piece = residuals.get(f"{fqn}#shard{k}of{n}")
                a, b = shard_rows(d, n, k)
                if piece is not None and b > a:
                    whole[:, a:b] = piece.reshape(before, -1, after)[:, :b - a]
            totals[fqn] = whole if fqn not in totals else totals[fqn] + whole
    return {fqn: (t / divisor).reshape(params[fqn][0]) for fqn, t in totals.items()}


def full_params(net):
    return torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])


def run(_dist):
    rank, n = dist.get_rank(), dist.get_world_size()
    data = batches(rank, 4)
    here = folder(f"reshard-configs-np{n}")
    for tag, (shape, mp, placement, divisor) in cases(n).items():
        net, opt, state = make(shape, mp, placement)
        steps(net, opt, data[:2])
        hcf.save_checkpoint(str(here / f"ckpt-{tag}"), net, opt, state)
        ref = {"restored": restored(net, opt), "total": total_correction(net, state, divisor),
               "steps": state.steps}
        if rank == 0:
            torch.save(ref, here / f"ref-{tag}.pt")
    dist.barrier()

    source = os.environ.get("HVDC_RESHARD_FROM")
    if source:
        source = Path(source)
        saved_n = int(source.name.rsplit("np", 1)[1])
        for tag, (_, mp, placement, _) in cases(saved_n).items():
            loads(source, tag, saved_n, mp, placement)
    if n == 4:                     # HSDP's 2 x 2 ranks into 4 ranks without replicas
        loads(here, "HSDP 2x2", n, None, None)


def loads(source, tag, saved_n, mp, placement):
    """Load the checkpoint `tag` of `source` (saved on saved_n ranks) into a run on this job's
    ranks (a 1-D mesh), and check it."""
    n = dist.get_world_size()
    shape = (n,)
    divisor = cases(n)["fp16 reduce" if mp is not None else "Shard(1)"][3]
    ref = torch.load(source / f"ref-{tag}.pt")
    net, opt, state = make(shape, mp, placement)
    hcf.load_checkpoint(str(source / f"ckpt-{tag}"), net, opt, state)
    into = f"{tag}, {saved_n} ranks into {n}"
    check(f"{into}: the model and Adam equal the saved ones, bit for bit",
          equal(restored(net, opt), ref["restored"]))
    total = total_correction(net, state, divisor)
    worst = max((total[k] - ref["total"][k]).abs().max().item() for k in total)
    check(f"{into}: the per-element total correction is carried bit for bit, the step count "
          "too", equal(total, ref["total"]) and state.steps == ref["steps"],
          f"max difference {worst}, steps {state.steps}")
    steps(net, opt, batches(dist.get_rank(), 4)[2:])
    after = full_params(net)
    check(f"{into}: the resharded run goes on, alike on every rank",
          bool(torch.isfinite(after).all()) and same_on_every_rank(dist, after))
    net, opt, state = make(shape, mp, placement)
    hcf.load_checkpoint(str(source / f"ckpt-{tag}"), net, opt, state)
    state.reset_compression_state()
    steps(net, opt, batches(dist.get_rank(), 4)[2:])
    check(f"{into}: without the carried residuals the run differs (they matter)",
          not torch.equal(after, full_params(net)))
