"""The FSDP front's compression state in torch.distributed.checkpoint (DCP), beside the model's
and the optimizer's.

    hcf.save_checkpoint(path, model, optimizer, state)     # every rank: one DCP checkpoint
    hcf.load_checkpoint(path, model, optimizer, state)     # a run made alike, any world size

or, in a job's own dcp.save/dcp.load, the front itself under any key (it is DCP's Stateful; at
another world size, load_compression_state(path, state, key) reads it).

Why this layout: error feedback's residuals differ from rank to rank (each rank's covers what
its own codes dropped, for every destination shard), and DCP keeps a plain tensor once, as if
replicated. So each residual piece ("<fqn>#shard<k>of<n>") travels as a DTensor of n rows
sharded by rank over FSDP's mesh: row r is rank r's, written by rank r and read back by it.
Beside them, one string: what the run was made with (the ranks' agreed setup, the world size,
each module's reduce divisor) and its step count. A residual means nothing to another scheme
or block, so such a checkpoint is refused with a ValueError.

Another world size (or another number of HSDP replicas) is resharded. What the residuals give
the next step is, per parameter element, their sum over the ranks divided by the reduce's
divisor D (FSDP2 averages: D = n, times the replicas under HSDP; float16 gradients are
pre-divided and summed: D = that over FSDP2's pre-divide factor). So the saved pieces are
summed over the saved ranks (in rank order, float32), put in full-parameter coordinates
(FSDP2's chunks on the parameter's shard dim: dim 0 padded, another dim even), scaled by
D(new) / D(saved) and recut into the new world size's shards; shard k's whole correction goes
to rank k of the first replica, its destination, the other ranks' residual of shard k is zero.
The step count carries over.
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
           "load_checkpoint", "load_compression_state", "carry", "shard_rows", "divisor"]

KEY = "hvd_compress"            # the key save_checkpoint keeps the front's state under


def meta_of(front):
    n = front.engine.size()
    return {"format": FORMAT, "front": "hvd_compress.fsdp", "world_size": n,
            "replicas": replicas(front)[0],
            "setup": json.loads(json.dumps(front.setup())), "steps": front.steps,
            "divisors": {c.bucket: divisor(c.param_group, n) for c in front.comms.values()}}


def replicas(front):
    """(replicas, this rank's replica) of FSDP's mesh: HSDP's replicate dimension (a 2-D mesh,
    replicate dim 0, shard dim 1), else (1, 0). Each replica holds every shard; FSDP2
    all-reduces the reduced shards over the replicas after the reduce-scatter."""
    info = param_group_of(front).mesh_info
    if getattr(info, "replicate_mesh_dim", None) is None:
        return 1, 0
    return int(info.replicate_mesh_size), int(info.replicate_mesh_rank)


def param_group_of(front):
    return next(iter(front.comms.values())).param_group


# ---- resharding: FSDP2's layout, the reduce's divisor, the recut --------------------------------
def shard_rows(d0, n, k):
    """The rows [start, stop) of the shard dim that shard k of n holds (FSDP2's torch.chunk cut,
    padded to ceil(d0 / n) rows a shard; a shard past the end is empty: start == stop)."""
    c = -(-d0 // n)
    return min(k * c, d0), min((k + 1) * c, d0)


def _dims(shape, dim=0):
    """(values before the shard dim, its size, values after it) of a `shape` parameter sharded
    on `dim`: a shard piece is the (before, rows, after) block of its rows, flattened (FSDP2
    cuts Shard(dim) chunks with torch.chunk on `dim` and lays each out contiguous)."""
    shape = tuple(int(s) for s in shape) or (1,)
    before = after = 1
    for s in shape[:dim]:
        before *= s
    for s in shape[dim + 1:]:
        after *= s
    return before, shape[dim], after


def padded_numel(shape, n, dim=0):
    """A shard's numel (FSDP2's padded_sharded_param_size) of a `shape` parameter on n ranks,
    sharded on `dim` (FSDP2 pads dim 0 only; another dim it shards evenly or refuses)."""
    before, d, after = _dims(shape, dim)
    return before * -(-d // n) * after


def divisor(group, n):
    """What FSDP2 divides the sum of the ranks' reduce-scatter inputs by on n ranks a replica
    (the gradient_divide_factor, else every rank of every replica: n x replicas), less the
    pre-divide it applies to float16 gradients before they reach the reduce-scatter (and so
    before error feedback keeps them)."""
    mp = group.mp_policy              # FSDPParam's own dtypes are set at the first forward
    dtype = mp.reduce_dtype or mp.param_dtype or group.fsdp_params[0].sharded_param.dtype
    info = group.mesh_info
    copies = int(info.replicate_mesh_size) if getattr(info, "replicate_mesh_dim", None) \
        is not None else 1
    factor = float(group.gradient_divide_factor or n * copies)
    if dtype in (torch.float32, torch.bfloat16):
        return factor
    pre = 1                        # FSDP2's _get_gradient_divide_factors, for float16
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return factor / pre


def carry(saved, shape, n, new_n, k, ratio=1.0, dim=0):
    """The residual that rank k of new_n carries for its own shard k of a `shape` parameter
    sharded on `dim`: saved[j] (every saved rank's residual of shard j of n, a (ranks, numel)
    float32 tensor; at least the shards that new shard k overlaps) summed over the ranks in rank
    order, shard k of new_n of that sum (FSDP2's padding zero), times `ratio` (the divisors'
    D(new) / D(saved))."""
    before, d, after = _dims(shape, dim)
    if dim != 0 and (d % n or d % new_n):
        raise ValueError(f"a parameter of shape {tuple(shape)} sharded on dim {dim}: FSDP2 "
                         f"shards dim {dim} evenly only, {d} rows on {n} and {new_n} ranks")
    c_old, c_new = -(-d // n), -(-d // new_n)
    out = torch.zeros(before, c_new, after, dtype=torch.float32)
    a, b = shard_rows(d, new_n, k)
    for j in range(n):
        ja, jb = shard_rows(d, n, j)
        lo, hi = max(a, ja), min(b, jb)
        if lo >= hi:
            continue
        rows = saved[j].reshape(-1, before, c_old, after)[:, :, lo - ja:hi - ja]
        total = rows[0].to(torch.float32).clone()
        for r in range(1, rows.shape[0]):
            total += rows[r]
        out[:, lo - a:hi - a] = total
    out = out.reshape(-1)
    return out.mul_(ratio) if ratio != 1.0 else out


def _overlapping(shape, n, new_n, k, dim=0):
    """The shards of n that shard k of new_n shares rows with."""
    _, d, _ = _dims(shape, dim)
    a, b = shard_rows(d, new_n, k)
    return [j for j, (ja, jb) in enumerate(shard_rows(d, n, j) for j in range(n))
            if max(a, ja) < min(b, jb)]


def _params(comm):
    """(fqn, full shape, shard dim) of the module's parameters, in the reduce-scatter's order."""
    return [(name, tuple(fp._orig_size), fp.fsdp_placement.dim)
            for name, fp in zip(comm.names, comm.param_group.fsdp_params)]


def _resharded(checkpoint_id, key, front, meta):
    """This rank's residual pieces at its world size from a checkpoint of another (or of
    another number of replicas): one dcp.load a module, of every saved rank's rows of the old
    shards its own new shard overlaps (the transient memory: those rows, one module at a time);
    the other shards' pieces are left out (zeros)."""
    n, new_n, k = meta["world_size"], front.engine.size(), front.engine.rank()
    rows = n * meta.get("replicas", 1)          # every saved rank: n shards x its replicas
    first = replicas(front)[1] == 0             # of the new replicas, the first takes it all
    pieces = {}
    for comm in front.comms.values():
        params = _params(comm)
        template = {f"{fqn}#shard{j}of{n}": torch.zeros(rows, padded_numel(shape, n, dim))
                    for fqn, shape, dim in params
                    for j in _overlapping(shape, n, new_n, k, dim)}
        dcp.load({key: {"residuals": template}}, checkpoint_id=checkpoint_id)
        saved_d = meta.get("divisors", {}).get(comm.bucket, float(n))   # older: FSDP2's AVG
        ratio = divisor(comm.param_group, new_n) / saved_d
        for fqn, shape, dim in params:
            saved = {j: template[f"{fqn}#shard{j}of{n}"]
                     for j in _overlapping(shape, n, new_n, k, dim)}
            # shard k's whole correction on rank k (of the first replica), its destination: the
            # new reduce adds zeros to it (the sum unchanged, bit for bit) and each rank reads
            # only its own shard's rows
            pieces[f"{fqn}#shard{k}of{new_n}"] = \
                carry(saved, shape, n, new_n, k, ratio, dim) if first else \
                torch.zeros(padded_numel(shape, new_n, dim))
        del template
    return pieces


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
                # row (replica x n + shard rank): Shard(0) on every dim of FSDP's mesh
                # (HSDP's is (replicate, shard)), so that no two ranks write one row
                residuals[name] = DTensor.from_local(piece.reshape(1, -1).to(torch.float32),
                                                     front.mesh, [Shard(0)] * front.mesh.ndim,
                                                     run_check=False)
    return {"meta": json.dumps(meta_of(front), sort_keys=True), "residuals": residuals}


def check_meta(front, meta):
    """Raise ValueError naming what differs between a checkpoint's meta and this front (another
    world size is no difference: the modules' shard sizes are compared at the saved one)."""
    if not isinstance(meta, dict) or meta.get("front") != "hvd_compress.fsdp":
        raise ValueError("not a checkpoint of hvd_compress.fsdp's compression state")
    mine = meta_of(front)
    if meta.get("format") != FORMAT:
        raise ValueError(f"this checkpoint's compression state has format {meta.get('format')}, "
                         f"hvd_compress.fsdp reads format {FORMAT}")
    n = meta.get("world_size")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"this checkpoint's compression state names no world size ({n!r})")
    if n != mine["world_size"]:
        mine["setup"]["modules"] = [[c.bucket, [padded_numel(shape, n, dim) for _, shape, dim
                                                in _params(c)]] for c in front.comms.values()]
    diff = [f"{k}: saved {meta['setup'].get(k)!r}, this run {v!r}"
            for k, v in mine["setup"].items() if meta["setup"].get(k) != v]
    if diff:
        raise ValueError("this checkpoint's compression state was made with another setup ("
                         + "; ".join(diff) + ")")


def resharding(front, meta):
    """Whether a checkpoint's residuals must be recut here: another world size, or another
    number of HSDP replicas (their rows: every rank's)."""
    return (meta["world_size"], meta.get("replicas", 1)) != \
        (front.engine.size(), replicas(front)[0])


def load_dcp_state(front, state):
    """Restore what DCP loaded into a dcp_state() template (of this world size: DCP's planner
    finds no piece of this world size's names in a checkpoint of another)."""
    meta = json.loads(state["meta"])
    check_meta(front, meta)
    pieces = {name: t.to_local().reshape(-1).clone() for name, t in state["residuals"].items()}
    _restore(front, meta, pieces)


def _restore(front, meta, pieces):
    front.core.load_state_dict({"format": FORMAT, "scheme": front.describe(),
                                "steps": meta["steps"], "residuals": pieces})


def load_compression_state(checkpoint_id, front, key=KEY):
    """Load the front's state under `key` of a DCP checkpoint (a job's own dcp.save of it), at
    this world size or resharded from another, on every rank; refused as load_checkpoint's."""
    meta = saved_meta(checkpoint_id, key)
    check_meta(front, meta)
    if not resharding(front, meta):
        dcp.load({key: front}, checkpoint_id=checkpoint_id)
    else:
        _restore(front, meta, _resharded(checkpoint_id, key, front, meta)
                 if front.memory is not None else {})


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
    checkpoint of another world size is resharded (DCP reshards the model's and the optimizer's
    DTensors, _resharded the residuals); one of another scheme or setup raises ValueError before
    anything changes."""
    meta = saved_meta(checkpoint_id)
    check_meta(front, meta)
    reshard = resharding(front, meta)
    pieces = _resharded(checkpoint_id, KEY, front, meta) \
        if reshard and front.memory is not None else {}
    model_sd, optim_sd = _states(model, optimizer)
    state = {"model": model_sd, **(extra or {})}
    if not reshard:
        state[KEY] = front
    if optim_sd is not None:
        state["optimizer"] = optim_sd
    dcp.load(state, checkpoint_id=checkpoint_id)
    if optim_sd is None:
        set_model_state_dict(model, model_sd)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if reshard:
        _restore(front, meta, pieces)
