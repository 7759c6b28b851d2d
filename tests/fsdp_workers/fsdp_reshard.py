"""hvd_compress.fsdp's checkpoints resharded to another world size, on real Gloo ranks
(tests/test_fsdp_reshard.py starts them through tests/ddprun.py). Every job saves, after 2 steps
with Adam, one checkpoint a case (bit8 and bf16 with error feedback, none) and, beside it, what
a same-size load restores (the full parameters and Adam's state) and the per-element total
correction of the residuals (each rank's pieces put in full-parameter coordinates, summed over
the ranks in rank order in float32, divided by the reduce's n). A job given another world size's
folder ($HVDC_RESHARD_FROM) loads its checkpoints and checks: the model and the optimizer equal
the saved ones bit for bit, the total correction equal bit for bit (2 <-> 4 ranks: the divisors'
ratio is a power of two and shard k's correction lies whole on rank k), the step count carried,
the run goes on alike on every rank and the carried residuals change it; a job's own dcp.save of
the front reads back through load_compression_state; another scheme is still refused."""
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hvd_compress.fsdp as hcf
from checks import check
from fsdp_workers.fsdp_checks import batches, folder, fresh, raised, same_on_every_rank, steps

CASES = (("bit8", {"error_feedback": True}), ("bf16", {"error_feedback": True}), ("none", {}))


def label(scheme, options):
    return scheme + ("+ef" if options.get("error_feedback") else "")








def restored(net, opt):
    """The full parameters and Adam's full state, by name (what a load must give back)."""
    model_sd, optim_sd = get_state_dict(net, opt)
    whole = {f"model.{k}": v.full_tensor() for k, v in model_sd.items()}
    for fqn, entries in optim_sd["state"].items():
        for k, v in entries.items():
            whole[f"optim.{fqn}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return whole


def total_correction(net, state):
    """Per parameter, every rank's residual pieces ("<fqn>#shard<k>of<n>") in full-parameter
    coordinates (FSDP2's chunks of ceil(rows / n) rows, the padding cut off), summed over the
    ranks in rank order (float32) and divided by n (FSDP2 averages float32 gradients)."""
    n = dist.get_world_size()
    shapes = {k: tuple(p.shape) for k, p in net.named_parameters()}
    every = [None] * n
    dist.all_gather_object(every, state.compression_state_dict()["residuals"])
    totals = {}
    for residuals in every:
        full = {}
        for name, piece in residuals.items():
            fqn, shard = name.split("#shard")
            k, of = map(int, shard.split("of"))
            assert of == n, name
            buf = full.setdefault(fqn, torch.zeros(n * piece.numel()))
            buf[k * piece.numel():(k + 1) * piece.numel()] = piece
        for fqn, buf in full.items():
            part = buf[:torch.Size(shapes[fqn]).numel()]       # the padding cut off
            totals[fqn] = part.clone() if fqn not in totals else totals[fqn] + part
    return {fqn: t / n for fqn, t in totals.items()}


def equal(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def run(_dist):
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    data = batches(rank, 4)
    here = folder(f"reshard-np{n}")

    for scheme, options in CASES:                        # save, and what a load must restore
        tag = label(scheme, options)
        net, opt, state = fresh(mesh, scheme, options)
        steps(net, opt, data[:2])
        hcf.save_checkpoint(str(here / f"ckpt-{tag}"), net, opt, state)
        ref = {"restored": restored(net, opt), "total": total_correction(net, state),
               "steps": state.steps}
        if scheme == "bit8":
            model_sd, optim_sd = get_state_dict(net, opt)
            dcp.save({"model": model_sd, "optim": optim_sd, "codec": state},
                     checkpoint_id=str(here / "ckpt-own"))
        if rank == 0:
            torch.save(ref, here / f"ref-{tag}.pt")
    dist.barrier()

    source = os.environ.get("HVDC_RESHARD_FROM")
    if not source:
        return
    source = Path(source)
    for scheme, options in CASES:
        tag = label(scheme, options)
        ref = torch.load(source / f"ref-{tag}.pt")
        saved_n = hcf.saved_meta(str(source / f"ckpt-{tag}"))["world_size"]
        net, opt, state = fresh(mesh, scheme, options)
        hcf.load_checkpoint(str(source / f"ckpt-{tag}"), net, opt, state)
        check(f"{tag}: loaded from {saved_n} ranks, the model and Adam equal the saved ones, "
              "bit for bit", equal(restored(net, opt), ref["restored"]) and saved_n != n)
        total = total_correction(net, state)
        worst = max(((total[k] - ref["total"][k]).abs().max().item() for k in total
                     if k in ref["total"]), default=None)
        check(f"{tag}: the per-element total correction is carried bit for bit, the step count "
              "too", equal(total, ref["total"]) and state.steps == ref["steps"],
              f"max difference {worst}, steps {state.steps}")
        steps(net, opt, data[2:])
        after = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
        check(f"{tag}: the resharded run goes on, alike on every rank",
              bool(torch.isfinite(after).all()) and same_on_every_rank(dist, after))
        if options.get("error_feedback"):
            net, opt, state = fresh(mesh, scheme, options)
            hcf.load_checkpoint(str(source / f"ckpt-{tag}"), net, opt, state)
            state.reset_compression_state()
            steps(net, opt, data[2:])
            dropped = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
            check(f"{tag}: without the carried residuals the run differs (they matter)",
                  not torch.equal(after, dropped))

    # a job's own dcp.save of the front, its model loaded by dcp.load, the front's state after
    net, opt, state = fresh(mesh, "bit8", {"error_feedback": True})
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(source / "ckpt-own"))
    set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    hcf.load_compression_state(str(source / "ckpt-own"), state, key="codec")
    ref = torch.load(source / "ref-bit8+ef.pt")
    check("a job's own dcp.save of the front is resharded by load_compression_state",
          equal(total_correction(net, state), ref["total"]) and state.steps == 2
          and equal(restored(net, opt), ref["restored"]))

    net, opt, state = fresh(mesh, "bf16", {"error_feedback": True})
    before = torch.cat([p.detach().to_local().reshape(-1) for p in net.parameters()])
    err = raised(lambda: hcf.load_checkpoint(str(source / "ckpt-bit8+ef"), net, opt, state))
    check("another world size's checkpoint of another scheme is still refused, nothing loaded",
          isinstance(err, ValueError) and "another setup" in str(err) and state.steps == 0
          and torch.equal(torch.cat([p.detach().to_local().reshape(-1)
                                     for p in net.parameters()]), before), repr(err))
