"""FSDPCompression: the FSDP front. FSDP2 keeps its own life cycle (when a module's gradients
are ready, how they are padded and laid out, where the reduced shard goes, when a module's
weights are gathered); this front replaces only the collectives, per module: the gradients'
reduce-scatter (reduce_scatter.py) and, asked for, the weights' all-gather (all_gather.py).
What every front shares is its FrontCore (front/core.py): the scheme by name, error feedback
by parameter name, the ranks' agreement, the checkpoint format. It is also DCP's Stateful
(checkpoint.py): torch.distributed.checkpoint saves and loads it beside the model.
"""
from torch.distributed.fsdp import FSDPModule

from ..codecs import SCALE_BLOCK
from ..ddp import PIECES_BELOW_BITS_PER_S, PIECES_DECIDED_AT
from ..compressors import compressor_name
from ..engine.base import AVERAGE
from ..engine.distributed import TorchEngine
from ..front.core import AGREE_TIMEOUT_S, FrontAPI, FrontCore, resolve_compression
from ..roles import PacketCompressor
from . import checkpoint
from .all_gather import CompressedAllGather, WeightStats, weight_codec
from .reduce_scatter import CompressedReduceScatter

__all__ = ["FSDPCompression", "fsdp_modules", "NONFINITE"]

NONFINITE = ("raise", "pass")


def fsdp_modules(model):
    """(qualified name, module) of every module under `model` (itself included) that
    fully_shard wrapped and that holds parameters of its own (a parameter group)."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError(f"hvd_compress.fsdp: no module of this {type(model).__name__} is "
                         "wrapped by torch.distributed.fsdp.fully_shard: call fully_shard on "
                         "the model (and its blocks) first, then register")
    return [(name, m) for name, m in found if m._get_fsdp_state()._fsdp_param_groups]


def param_group(module):
    """The module's one FSDP parameter group (set_custom_reduce_scatter refuses several)."""
    return module._get_fsdp_state()._fsdp_param_groups[0]


class FSDPCompression(FrontAPI):
    """The FSDP front: its FrontCore over a TorchEngine of FSDP's shard group, and the
    collectives it installed, one per module (`comms`: reduce-scatters, `gathers`: the
    weights' all-gathers, by module name).

    compression: 'none', 'fp16', 'bit16', 'bf16', 'bit8', 'int8' (any packet scheme of the
        registry), or a Compression value of one of them: the gradients' reduce-scatter.
    error_feedback: carry each rank's quantisation error to its next step (packet schemes);
        None: the scheme's default.
    on_nonfinite: 'raise' (a NaN/Inf gradient on any rank raises FloatingPointError on every
        rank) or 'pass' (decoded as the codec carries it); packet schemes only.
    weights: None (FSDP2's own all-gather, untouched), 'none' (ours, FSDP2's bits, counted) or
        'bit8', 'int8', 'bit16', 'bf16': the weights' all-gather as block-scaled codes.
    gather_pieces: Gloo's large alltoalls (the gradients' codes) and all-gathers (the
        weights' codes) in pieces (True), whole (False), or None: decided after
        PIECES_DECIDED_AT steps, as hvd_compress.ddp decides it (docs/ddp.md, "Gathers in
        pieces on a slow link"): in pieces where rank 0's large collectives sent below
        PIECES_BELOW_BITS_PER_S, alike on every rank.
    keep_weight_codes: with a weights codec, the backward decodes the codes its module's
        forward gathered instead of gathering again (all_gather.py: a third less on the wire a
        step, the gathered codes held from each module's forward to its backward).
    """

    def __init__(self, model, compression="bit8", error_feedback=None, scale_block=SCALE_BLOCK,
                 on_nonfinite="raise", agree_timeout_s=AGREE_TIMEOUT_S, weights=None,
                 keep_weight_codes=False, gather_pieces=None):
        if on_nonfinite not in NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE}, got {on_nonfinite!r}")
        self.weights, self.weights_name = weight_codec(weights), weights
        if keep_weight_codes and self.weights in (None, "none"):
            raise ValueError("keep_weight_codes keeps the codes of a weights codec (weights="
                             f"'bit8', 'int8', 'bit16' or 'bf16'), not weights={weights!r}; "
                             "FSDP2's own is reshard_after_forward=False")
        self.keep_weight_codes = bool(keep_weight_codes)
        self.weight_stats = WeightStats()
        modules = fsdp_modules(model)
        compression = resolve_compression(compression)
        if callable(getattr(compression, "communicator", None)):
            raise ValueError(f"hvd_compress.fsdp carries codecs of values (none, fp16, bit16, "
                             f"bf16, bit8, int8), not {compressor_name(compression)}, which "
                             "needs a collective of its own")
        self.packet = isinstance(compression, type) and issubclass(compression, PacketCompressor)
        groups = {id(g): g for g in (param_group(m).mesh_info.shard_process_group
                                     for _, m in modules)}
        if len(groups) != 1:
            raise ValueError("hvd_compress.fsdp: the modules shard over different process "
                             "groups; one shard group for the whole model is supported")
        group = next(iter(groups.values()))
        self.core = FrontCore("hvd_compress.fsdp", compression,
                              "alltoall" if self.packet else None, AVERAGE, 0, scale_block,
                              error_feedback, engine=TorchEngine(group))
        self.compression, self.engine = self.core.compression, self.core.engine
        self.on_nonfinite, self.scale_block = on_nonfinite, scale_block
        self.mesh = param_group(modules[0][1]).mesh_info.mesh
        fqn = {id(p): n for n, p in model.named_parameters()}
        self.comms, self.gathers, self._reduced = {}, {}, set()
        n = self.engine.size()
        for name, module in modules:
            params = param_group(module).fsdp_params
            names = [fqn.get(id(p.sharded_param), f"{name}.{i}") for i, p in enumerate(params)]
            if self.weights is not None:
                odd = [f"{k} ({p.sharded_param.dtype})" for k, p in zip(names, params)
                       if not p.sharded_param.dtype.is_floating_point]
                if odd:
                    raise ValueError(f"hvd_compress.fsdp: weights={weights!r} compresses "
                                     "floating-point parameters; fsdp."
                                     f"{name or 'root'} holds {', '.join(odd)}")
                self.gathers[name] = CompressedAllGather(self, f"fsdp.{name or 'root'}",
                                                         param_group(module),
                                                         self.keep_weight_codes)
            comm = CompressedReduceScatter(
                self, f"fsdp.{name or 'root'}", names,
                [p.padded_sharded_param_size.numel() for p in params])
            comm.param_group = param_group(module)     # shapes and dtypes, for resharding
            if self.memory is not None:
                self.memory.bind(comm.bucket, *comm.members(n))
            self.comms[name] = comm
        # keep_weight_codes and gather_pieces are agreed on (ranks that gather differently
        # would hang) but not in setup(): a checkpoint does not depend on them
        self.gather_pieces = gather_pieces
        if gather_pieces is not None:
            self.engine.in_pieces, self.engine.timed = bool(gather_pieces), False
        agreed = dict(self.setup(), keep_weight_codes=self.keep_weight_codes,
                      gather_pieces=gather_pieces)
        self.core.agree(agreed, "FSDP modules", agree_timeout_s)
        # HSDP: FSDP2 all-reduces the reduced shards over the replicas, so replicas whose shard
        # groups chose different codecs would average shards of different rounding (each
        # group agrees within itself only)
        replicas = getattr(param_group(modules[0][1]).mesh_info, "replicate_process_group", None)
        if replicas is not None:
            self.core.agree(agreed, "FSDP modules across replicas", agree_timeout_s,
                            engine=TorchEngine(replicas))
        for name, module in modules:
            module.set_custom_reduce_scatter(self.comms[name])
            if name in self.gathers:
                module.set_custom_all_gather(self.gathers[name])

    def setup(self):
        """What every rank must agree on, and what a checkpoint must have been made with."""
        return dict(self.core.setup(), on_nonfinite=self.on_nonfinite,
                    weights=self.weights_name,
                    modules=[(c.bucket, c.numels) for c in self.comms.values()])

    def pop_stats(self):
        """The core's counters (the gradients') and, where this front gathers the weights,
        theirs as weights_<counter> (bytes_sent, compress_s, communicate_s, decompress_s)."""
        stats = self.core.pop_stats()
        weights = self.weight_stats.pop()
        if self.weights is not None:
            stats.update({f"weights_{k}": v for k, v in weights.items()})
        return stats

    # ---- a step: every module's reduce-scatter, once ----------------------------------------
    def reduce_begins(self, comm):
        if comm.bucket in self._reduced:         # a module reduces again: the last step ended
            self._end_step()
        self.core.hooked()

    def reduce_ends(self, comm):
        self._reduced.add(comm.bucket)
        if len(self._reduced) == len(self.comms):
            self._end_step()

    def _end_step(self):
        self._reduced = set()
        if self.gather_pieces is None and self.core.steps + 1 == PIECES_DECIDED_AT:
            self._decide_pieces()
        self.core.end_step(self.core.next_step())

    def _decide_pieces(self):
        """Gloo's large gathers in pieces from now on if rank 0's large collectives were slow
        (a slow link), said by rank 0 so that every rank cuts alike (gather_pieces=None):
        hvd_compress.ddp's rule. Why: over a slow link a whole large gather or alltoall ends
        tens of ms later on one rank than on the other, and the ranks drift apart (docs/fsdp.md,
        the weights' section, has this front's figures)."""
        self.engine.decide_pieces(PIECES_BELOW_BITS_PER_S)

    # ---- torch.distributed.checkpoint's Stateful ----------------------------------------------
    def state_dict(self):
        """The compression state as DCP saves it (checkpoint.py): every rank's residuals as one
        DTensor per piece, and what the run was made with."""
        return checkpoint.dcp_state(self)

    def load_state_dict(self, state):
        """Restore a state_dict() that DCP loaded; a checkpoint of another setup is refused."""
        checkpoint.load_dcp_state(self, state)
