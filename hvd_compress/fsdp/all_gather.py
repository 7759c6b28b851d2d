"""The weights' all-gather of one fully_shard module as block-scaled 8-bit codes (ZeRO++'s qwZ),
decoded on arrival (FSDP2's AllGather interface, installed with FSDPModule.set_custom_all_gather).

- FSDP2 hands this rank's input (every parameter's shard of the module, padded, back to back)
  as a view of its row of the output, and an output of n such rows, one per rank in rank order.
- `none` hands them to torch's all_gather_single unchanged: FSDP2's default, bit for bit.
- A weight codec encodes the input as one message of its own block scales and a non-finite
  flag; an all-gather of the messages gives every rank every row's codes, and every rank
  decodes every row, its own included, into the output. So every rank computes with the same
  decoded weights, while the sharded parameters the optimizer updates stay exact: only the
  gathered copy is quantised, and it is gathered again, from the exact shards, every forward.
- Only deterministic codecs: FSDP2 gathers a module again for its backward (after a forward
  that resharded it), and the backward must see the weights the forward saw. bit8, bit16 and
  bf16 round to nearest; int8 here does too (NearestInt8: qwZ's symmetric int8), not the
  gradients' stochastic int8.
- A NaN or Inf weight on any rank raises FloatingPointError on every rank in the same call (the
  flag), before any rank decodes: a weight that is not finite has no use for a forward.
- keep_weight_codes: a module's forward gather keeps the messages it received, and the
  gather before its backward decodes them again instead of encoding and gathering anew: the
  backward sees the forward's weights bit for bit (FSDP2's reshard_after_forward=False does
  the same with the unsharded weights), and a step sends a third less. The price is memory:
  every module's n messages (a byte a value for bit8, about a quarter of its float32 weights)
  from its forward to its backward, where FSDP2's default holds nothing.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from ..codecs import int8 as int8_codec
from ..compressors import Int8Compressor, compressor_name
from ..front.core import resolve_compression
from ..roles import Stats
from .reduce_scatter import FLAG_BYTES, all_finite, completed_work

__all__ = ["CompressedAllGather", "NearestInt8", "WeightStats", "WEIGHT_SCHEMES",
           "weight_codec", "all_finite"]

WEIGHT_SCHEMES = ("none", "bit8", "int8", "bit16", "bf16")


class NearestInt8(Int8Compressor):
    """int8 codes with a scale per block (amax / 127), rounded to nearest: the same codes for
    the same weights every time (Int8Compressor's layout, not its stochastic rounding)."""

    @classmethod
    def encode_blocks(cls, flat, codes, scales, block):
        nb = int8_codec.num_blocks(flat.numel(), block)
        v = F.pad(flat.reshape(-1), (0, nb * block - flat.numel())).view(nb, block)
        s = v.abs().amax(dim=1) / int8_codec.LEVELS
        scales.copy_(s)
        safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1)
        q = torch.round(v / safe).clamp_(-int8_codec.LEVELS, int8_codec.LEVELS)
        codes.view(torch.int8).copy_(q.reshape(-1)[:flat.numel()].to(torch.int8))


class WeightStats(Stats):
    """The weights' all-gathers' counters, apart from the gradients' (the front's pop_stats
    names them weights_<counter>): bytes_sent is what this rank sent of its shards."""
    FIELDS = ("compress_s", "communicate_s", "decompress_s", "bytes_sent")


def weight_codec(weights):
    """The codec of the weights' all-gather: None (not installed: FSDP2's own), 'none' (ours,
    counted, FSDP2's bits), or a deterministic packet codec."""
    if weights is None or weights == "none":
        return weights
    if weights == "int8":
        return NearestInt8
    if weights not in WEIGHT_SCHEMES:
        raise ValueError(f"weights must be None or one of {WEIGHT_SCHEMES} (deterministic "
                         f"codecs: the backward gathers again and must see the forward's "
                         f"weights; a cast is FSDP2's MixedPrecisionPolicy(param_dtype=...)), "
                         f"got {weights!r}")
    return resolve_compression(weights)


class CompressedAllGather(AllGather):
    """The all-gather of one FSDP module's parameter shards (FSDP2's AllGather interface), by
    its front's weight codec; named `bucket` in errors. With `param_group` (the module's FSDP2
    parameter group) and `keep`, the forward's messages are kept for the backward (`kept`)."""

    def __init__(self, front, bucket, param_group=None, keep=False):
        self.front, self.bucket = front, bucket
        self.param_group, self.keep = param_group, keep
        self.kept = None            # the forward's received messages, until the backward's gather

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.all_gather(output_tensor, input_tensor, group)
        return completed_work(output_tensor) if async_op else None

    def all_gather(self, output, input, group):
        front = self.front
        if group is not front.engine.group:
            raise ValueError(f"{self.bucket}: FSDP all-gathers over another process group "
                             "than the one hvd_compress.fsdp was registered on")
        n, m = front.engine.size(), input.numel()
        if output.numel() != n * m:
            raise ValueError(f"{self.bucket}: all-gather output of {output.numel()} values for "
                             f"an input of {m} on {n} ranks")
        if not output.dtype.is_floating_point:
            raise ValueError(f"{self.bucket}: FSDP all-gathers {output.dtype} (parameters of "
                             "several dtypes, or not floating point); weights= compresses "
                             "floating-point parameters of one dtype")
        stats = front.weight_stats
        if front.weights == "none":
            dist.all_gather_single(output, input, group=group)
            stats.add("bytes_sent", (n - 1) * m * output.element_size())
            return
        comp, block = front.weights, front.scale_block or max(m, 1)
        size = comp.message_bytes(m, block)
        row = size + FLAG_BYTES
        phase = self._phase()
        kept, self.kept = self.kept, None   # used once: a later backward gathers afresh
        if phase is TrainingState.PRE_BACKWARD and kept is not None and kept.numel() == n * row:
            rows = kept.view(n, row)        # the forward's messages: its weights, bit for bit
        else:
            rows = self._gather(input, group, comp, block, size, row)
            if phase is TrainingState.FORWARD and self.keep and \
                    self.param_group._reshard_after_forward:
                self.kept = rows
        with stats.timing("decompress_s"):
            out = output.view(n, m) if output.dtype == torch.float32 else \
                torch.empty(n, m, dtype=torch.float32, device=input.device)
            for k in range(n):
                comp.decode_messages(rows[k:k + 1, :size].contiguous(), m, out[k], block)
            if out.data_ptr() != output.data_ptr():
                output.view(n, m).copy_(out)

    def _phase(self):
        """FSDP2's state of this module's group as it gathers (FORWARD: its forward or a
        forward prefetch; PRE_BACKWARD: its backward or a backward prefetch), or None."""
        return getattr(self.param_group, "_training_state", None)

    def _gather(self, input, group, comp, block, size, row):
        """This rank's shard encoded (and its non-finite flag), every rank's gathered: the
        (n, row) messages, checked for a flag on any rank."""
        stats, n, m = self.front.weight_stats, self.front.engine.size(), input.numel()
        x = input if input.dtype == torch.float32 else input.to(torch.float32)
        send = torch.zeros(row, dtype=torch.uint8, device=x.device)
        finite = all_finite(x)
        send[size] = int(not finite)
        with stats.timing("compress_s"):
            if finite:                          # int8 cannot encode them; the flag tells all
                comp.encode_message(x.contiguous(), send[:size], block)
        engine = self.front.engine
        with stats.timing("communicate_s"):      # the engine's: timed, in pieces on a slow link
            received = engine.wait(engine.allgather_async(send, f"hvdc.{self.bucket}"))
        stats.add("bytes_sent", (n - 1) * row)
        rows = received.view(n, row)
        flagged = [r for r in range(n) if int(rows[r, size])]
        if flagged:
            raise FloatingPointError(
                f"hvd_compress.fsdp: a NaN or Inf weight on rank {', '.join(map(str, flagged))} "
                f"in {self.bucket}'s all-gather ({compressor_name(comp)} weights); every rank "
                "raises here, before any rank decoded; the sharded parameters are as they were")
        return rows
