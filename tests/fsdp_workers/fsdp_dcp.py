"""hvd_compress.fsdp's compression state in torch.distributed.checkpoint on real Gloo ranks
(tests/test_fsdp_dcp.py starts them through tests/ddprun.py): a run saved after 2 steps with
the model's and Adam's state, loaded into a fresh model and front and run 2 steps more, equals
the run that never stopped, bit for bit (none, bf16, bit8, error feedback on, the weights
gathered in bit8 too); without the residuals it differs; the front is DCP's Stateful in a job's
own dcp.save/dcp.load; a checkpoint of another scheme is refused on every rank before anything
changes, and one of another world size ($HVDC_FOREIGN_CHECKPOINT) loads, resharded."""
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import hvd_compress.fsdp as hcf
from checks import check
from fsdp_workers.fsdp_checks import (batches, folder, fresh, local, raised, same_on_every_rank,
                                      steps)

STEPS = 4
CASES = (("none", {}), ("bf16", {"error_feedback": True}), ("bit8", {"error_feedback": True}),
         ("bit8", {"error_feedback": True, "weights": "bit8"}))


def label(scheme, options):
    return scheme + ("+ef" if options.get("error_feedback") else "") + \
        (f", weights={options['weights']}" if "weights" in options else "")








def run(_dist):
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    data = batches(rank, STEPS)

    for scheme, options in CASES:
        tag = label(scheme, options)
        net, opt, _ = fresh(mesh, scheme, options)
        steps(net, opt, data)
        straight = local(net)

        net, opt, state = fresh(mesh, scheme, options)
        steps(net, opt, data[:2])
        path = folder(f"ckpt-{tag.replace(', ', '-').replace('=', '')}")
        hcf.save_checkpoint(path, net, opt, state)
        for keep in (True, False) if options.get("error_feedback") else (True,):
            net, opt, state = fresh(mesh, scheme, options)
            hcf.load_checkpoint(path, net, opt, state)
            if not keep:
                state.reset_compression_state()
            steps(net, opt, data[2:])
            after = local(net)
            if keep:
                check(f"{tag}: resumed from DCP = never stopped, bit for bit, every rank alike",
                      torch.equal(after, straight) and state.steps == STEPS
                      and same_on_every_rank(dist, torch.cat([p.full_tensor().reshape(-1)
                                                              for p in net.parameters()])),
                      f"max difference {(after - straight).abs().max().item()}, "
                      f"steps {state.steps}")
            else:
                check(f"{tag}: resumed without the residuals differs (they matter)",
                      not torch.equal(after, straight))

    # ---- the front as DCP's Stateful, in a job's own dcp.save / dcp.load ---------------------
    net, opt, _ = fresh(mesh, "bit8", {"error_feedback": True})
    steps(net, opt, data)
    straight = local(net)
    net, opt, state = fresh(mesh, "bit8", {"error_feedback": True})
    steps(net, opt, data[:2])
    model_sd, optim_sd = get_state_dict(net, opt)
    path = str(folder("ckpt-own"))
    dcp.save({"model": model_sd, "optim": optim_sd, "codec": state}, checkpoint_id=path)
    saved = state.compression_state_dict()
    net, opt, state = fresh(mesh, "bit8", {"error_feedback": True})
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.load({"model": model_sd, "optim": optim_sd, "codec": state}, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    loaded = state.compression_state_dict()
    check("the front is DCP's Stateful: this rank's own residuals come back, by name",
          sorted(saved["residuals"]) == sorted(loaded["residuals"])
          and all(torch.equal(saved["residuals"][k], loaded["residuals"][k])
                  for k in saved["residuals"]) and loaded["steps"] == 2
          and not same_on_every_rank(dist, torch.cat([loaded["residuals"][k]
                                                      for k in sorted(loaded["residuals"])])))
    steps(net, opt, data[2:])
    check("a job's own dcp.save/dcp.load of the front resumes bit for bit",
          torch.equal(local(net), straight))

    # ---- bad input: another scheme's, another world size's checkpoint ------------------------
    net, opt, state = fresh(mesh, "bf16", {"error_feedback": True})
    before = local(net)
    err = raised(lambda: hcf.load_checkpoint(path.replace("ckpt-own", "ckpt-bit8+ef"),
                                             net, opt, state))
    check("a checkpoint of another scheme is refused on every rank, nothing loaded",
          isinstance(err, ValueError) and "another setup" in str(err) and "bit8" in str(err)
          and torch.equal(local(net), before) and state.steps == 0, repr(err))
    err = raised(lambda: hcf.load_checkpoint(folder("ckpt-empty-" + str(n)), net, opt, state))
    check("a folder without a checkpoint is refused with a clear error",
          err is not None and torch.equal(local(net), before), repr(err))
    foreign = os.environ.get("HVDC_FOREIGN_CHECKPOINT")
    if foreign:
        net, opt, state = fresh(mesh, "bit8", {"error_feedback": True})
        before = local(net)
        err = raised(lambda: hcf.load_checkpoint(foreign, net, opt, state))
        check("a checkpoint of another world size is resharded, not refused (what it carries: "
              "tests/test_fsdp_reshard.py)",
              err is None and state.steps == 2 and not torch.equal(local(net), before), repr(err))
