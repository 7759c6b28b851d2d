"""The FSDP front's compression state in torch.distributed.checkpoint (DCP), beside the model's
and the optimizer's.

    hcf.save_checkpoint(path, model, optimizer, state)     # every rank: one DCP checkpoint
    hcf.load_checkpoint(path, model, optimizer, state)     # a run made alike, same world size

or, in a job's own dcp.save/dcp.load, the front itself under any key (it is DCP's Stateful).

Why this layout: error feedback's residuals differ from rank to rank (each rank's covers what
its own codes dropped, for every destination shard), and DCP keeps a plain tensor once, as if
replicated. So each residual piece ("<fqn>#shard<k>of<n>") travels as a DTensor of n rows
sharded by rank over FSDP's mesh: row r is rank r's, written by rank r and read back by it.
Beside them, one string: what the run was made with (the ranks' agreed setup, the world size)
and its step count. A residual means nothing to another scheme, block or world size (its
shards are cut by n), so such a checkpoint is refused with a ValueError, not resharded.
"""
import json

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor, Shard

from ..front.core import FORMAT

__all__ = ["KEY", "dcp_state", "load_dcp_state", "saved_meta", "save_checkpoint",
           "load_checkpoint"]

KEY = "hvd_compress"            # the key save_checkpoint keeps the front's state under


def meta_of(front):
    return {"format": FORMAT, "front": "hvd_compress.fsdp", "world_size": front.engine.size(),
            "setup": json.loads(json.dumps(front.setup())), "steps": front.steps}


def dcp_state(front):
    """{'meta': JSON of meta_of(front), 'residuals': {piece name: DTensor (n, numel)}}: every
    piece of every module, zeros where the rank holds none yet, so that a fresh front's
    state_dict() is the template DCP loads into."""
    n, residuals = front.engine.size(), {}
    if front.memory is not None:
        have = front.memory.state_dict()
        for comm in front.comms.values():
            for name, numel in zip(*comm.members(n)):
                piece = have.get(name)
                if piece is None or piece.numel() != numel:
                    piece = torch.zeros(numel, dtype=torch.float32)
                residuals[name] = DTensor.from_local(piece.reshape(1, -1).to(torch.float32),
                                                     front.mesh, [Shard(0)], run_check=False)
    return {"meta": json.dumps(meta_of(front), sort_keys=True), "residuals": residuals}


def check_meta(front, meta):
    """Raise ValueError naming what differs between a checkpoint's meta and this front."""
    if not isinstance(meta, dict) or meta.get("front") != "hvd_compress.fsdp":
        raise ValueError("not a checkpoint of hvd_compress.fsdp's compression state")
    mine = meta_of(front)
    if meta.get("format") != FORMAT:
        raise ValueError(f"this checkpoint's compression state has format {meta.get('format')}, "
                         f"hvd_compress.fsdp reads format {FORMAT}")
    if meta["world_size"] != mine["world_size"]:
        raise ValueError(f"this checkpoint was saved on {meta['world_size']} ranks, this run has "
                         f"{mine['world_size']}: error feedback's residuals are cut by the world "
                         "size (reset_compression_state() and load the model alone to go on)")
    diff = [f"{k}: saved {meta['setup'].get(k)!r}, this run {v!r}"
            for k, v in mine["setup"].items() if meta["setup"].get(k) != v]
    if diff:
        raise ValueError("this checkpoint's compression state was made with another setup ("
                         + "; ".join(diff) + ")")


def load_dcp_state(front, state):
    """Restore what DCP loaded into a dcp_state() template."""
    meta = json.loads(state["meta"])
    check_meta(front, meta)
    pieces = {name: t.to_local().reshape(-1).clone() for name, t in state["residuals"].items()}
    front.core.load_state_dict({"format": FORMAT, "scheme": front.describe(),
                                "steps": meta["steps"], "residuals": pieces})


def saved_meta(checkpoint_id, key=KEY):
    """What the front's state under `key` of a DCP checkpoint was made with (every rank)."""
    holder = {key: {"meta": ""}}
    try:
        dcp.load(holder, checkpoint_id=checkpoint_id)
    except (Exception, CheckpointException) as unread:     # DCP's is a BaseException
        first = str(unread).strip().splitlines()[0] if str(unread).strip() else repr(unread)
        raise ValueError(f"{checkpoint_id}: no hvd_compress.fsdp state under {key!r} could be "
                         f"read ({type(unread).__name__}: {first[:300]})") from unread
    return json.loads(holder[key]["meta"])


def _states(model, optimizer):
    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)


def save_checkpoint(checkpoint_id, model, optimizer, front, extra=None):
    """One DCP checkpoint of the model, the optimizer (or None) and the front, from every rank;
    `extra`: more of the job's own entries (DCP's rules: tensors, DTensors, Stateful, objects)."""
    model_sd, optim_sd = _states(model, optimizer)
    state = {"model": model_sd, KEY: front, **(extra or {})}
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    dcp.save(state, checkpoint_id=checkpoint_id)


def load_checkpoint(checkpoint_id, model, optimizer, front, extra=None):
    """Load a save_checkpoint() into the model, the optimizer and the front, on every rank; a
    checkpoint of another scheme, setup or world size raises ValueError before anything
    changes."""
    check_meta(front, saved_meta(checkpoint_id))
    model_sd, optim_sd = _states(model, optimizer)
    state = {"model": model_sd, KEY: front, **(extra or {})}
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    dcp.load(state, checkpoint_id=checkpoint_id)
    if optim_sd is None:
        set_model_state_dict(model, model_sd)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
