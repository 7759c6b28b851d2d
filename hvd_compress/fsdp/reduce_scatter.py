"""The gradients' reduce-scatter of one fully_shard module, by its front's codec (FSDP2's
ReduceScatter interface, installed with FSDPModule.set_custom_reduce_scatter).

- FSDP2 hands a flat input of n equal rows (row k: every parameter's k-th dim-0 chunk, padded)
  and an output of one row, and calls the collective synchronously (async_op=False) with
  ReduceOp.AVG (float32 and bfloat16 gradients) or SUM after its own pre-divide (float16).
- `none` hands FSDP2's arguments to torch's reduce_scatter_single unchanged: FSDP2's default
  reduce-scatter, bit for bit. A cast (fp16) reduce-scatters the cast codes, divided first
  (as DDP's fp16_compress_hook), and casts back.
- A packet scheme (bit8, bit16, bf16, int8) encodes each row as one message of its own block
  scales, and an all-to-all hands row k of every rank to rank k, which decodes the n messages
  and sums them in float32 in rank order (the codecs' decode_messages): the first phase of the
  two-phase route (exchange/routes.py), cut on FSDP2's shard bounds instead of block bounds.
  Rank k alone computes shard k, from codes decoded in rank order: the same bits run after
  run (int8's once its rounding seed is reset), whatever order the ranks' messages arrive in.
- Every message carries a flag (4 bytes) more: whether the sender's input held a NaN or an
  Inf. So every rank learns of a non-finite gradient in the same call, with no extra
  collective, and every rank raises the same FloatingPointError (on_nonfinite="raise"), before
  error feedback remembers anything; on_nonfinite="pass" decodes them as the codec carries
  them (a gradient scaler that skips such steps wants them).
- Error feedback keeps this rank's residual of its whole input (what its codes dropped, for
  every destination), named per parameter and destination shard ("<fqn>#shard<k>of<n>"), so a
  checkpoint is read by name whatever the modules' grouping.
- FSDP2 reduces only the parameters that got a gradient in this backward (or accumulated one
  while gradient sync was off): the input's rows then hold those parameters' chunks alone. So
  the comm watches its parameter group's post_backward, where FSDP2 picks them, and binds error
  feedback to those parameters' pieces: a parameter without gradient keeps its residual for
  the step it next reduces in, and the others' residuals stay theirs.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..compressors import compressor_name
from ..roles import rounding_stream

__all__ = ["CompressedReduceScatter", "FLAG_BYTES", "all_finite", "completed_work", "watch"]

# The non-finite flag after each message: 4 bytes, so that every row's block scales (float32 at
# its start) stay 4-byte aligned in the collective's buffer.
FLAG_BYTES = 4


def all_finite(x):
    """Whether every value of x is finite, from its smallest and largest: a NaN is both (aminmax
    carries it), an Inf the one or the other. Why not isfinite(x).all(): it makes a boolean
    tensor of x's size first, and on the CPU that cost more than the encode itself
    (docs/fsdp.md, the weights' all-gather)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def completed_work(output):
    """A Work that is already done (the collectives here run synchronously): what FSDP2 waits
    on when it asks for async_op=True."""
    done = torch.futures.Future()
    done.set_result([output])
    return torch._C._distributed_c10d._create_work_from_future(done)


def _has_gradient(group, fsdp_param):
    """Whether FSDP2's post_backward hands this parameter to the reduce-scatter (its own test,
    FSDPParamGroup.post_backward, torch 2.13): a gradient accumulated while sync was off, one
    from this backward, or a zero one for an unused parameter it was told to reduce."""
    if not hasattr(fsdp_param, "_unsharded_param"):
        return False
    if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
        return True
    if fsdp_param.unsharded_param.grad is not None:
        return True
    return bool(getattr(group, "reduce_scatter_unused_params", False)
                and fsdp_param.unsharded_param.requires_grad)


def watch(group, comm):
    """Before FSDP2's post_backward of `group` runs (it picks the parameters with a gradient,
    then reduce-scatters them), note on `comm` which parameters it will pick. Why wrap it: the
    reduce-scatter is handed only their chunks, flat; by then FSDP2 has already dropped the
    gradients that tell them apart. FSDP2 looks the method up on the group at each call."""
    original = group.post_backward
    if getattr(original, "_hvdc_comm", None) is not None:     # registered again: one wrapper
        original = original._hvdc_original

    def post_backward(*args, **kwargs):
        post_backward._hvdc_comm.present = tuple(
            i for i, p in enumerate(group.fsdp_params) if _has_gradient(group, p))
        return original(*args, **kwargs)
    post_backward._hvdc_comm, post_backward._hvdc_original = comm, original
    group.post_backward = post_backward


class CompressedReduceScatter(ReduceScatter):
    """The reduce-scatter of one FSDP module's gradients (FSDP2's ReduceScatter interface), by
    its front's codec; named `bucket` in error feedback and in errors."""

    def __init__(self, front, bucket, names, numels):
        self.front, self.bucket = front, bucket
        self.names, self.numels = list(names), [int(k) for k in numels]
        self.present = None             # the parameters FSDP2 reduces now (None: every one)
        self._group = None

    @property
    def param_group(self):
        """The module's FSDP parameter group (its shapes and dtypes, for resharding)."""
        return self._group

    @param_group.setter
    def param_group(self, group):
        self._group = group
        if group is not None:
            watch(group, self)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def members(self, n, present=None):
        """(names, numels) of the input's pieces: row k holds every parameter's k-th chunk (of
        the parameters `present`, indices in the module's order; None: all of them)."""
        which = range(len(self.names)) if present is None else present
        return ([f"{self.names[i]}#shard{k}of{n}" for k in range(n) for i in which],
                [self.numels[i] for _ in range(n) for i in which])

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.reduce_scatter(output_tensor, input_tensor, group, op)
        return completed_work(output_tensor) if async_op else None

    def reduce_scatter(self, output, input, group, op):
        front = self.front
        if group is not front.engine.group:
            raise ValueError(f"{self.bucket}: FSDP reduce-scatters over another process group "
                             "than the one hvd_compress.fsdp was registered on")
        n, m = front.engine.size(), output.numel()
        if input.numel() != n * m:
            raise ValueError(f"{self.bucket}: reduce-scatter input of {input.numel()} values "
                             f"for an output of {m} on {n} ranks")
        front.reduce_begins(self)
        if compressor_name(front.compression) == "none":     # FSDP2's own, whatever its op
            dist.reduce_scatter_single(output=output, input=input, group=group, op=op)
            front.core.communicator.stats.add("bytes_sent", (n - 1) * m * output.element_size())
        elif not front.packet:
            self._cast(output, input, group, self._divisor(op, n))
        else:
            self._packet(output, input, self._divisor(op, n))
        front.reduce_ends(self)

    def _present(self, numel, n):
        """The parameters in this input (indices; None: every one), as FSDP2 picked them."""
        if numel == n * sum(self.numels):
            return None
        present = self.present
        if present is None or numel != n * sum(self.numels[i] for i in present):
            raise ValueError(
                f"{self.bucket}: a reduce-scatter input of {numel} values on {n} ranks is not "
                f"the module's parameters ({sum(self.numels)} a shard) nor those that got a "
                f"gradient in this backward ({self._names(present)}); hvd_compress.fsdp "
                "cannot name its error feedback's pieces")
        return present

    def _names(self, present):
        return "unknown" if present is None else \
            ", ".join(self.names[i] for i in present) or "none"

    def _divisor(self, op, n):
        if op == dist.ReduceOp.AVG:
            return n
        if op == dist.ReduceOp.SUM:
            return 1
        raise ValueError(f"{self.bucket}: FSDP asks for the reduction {op!r}; hvd_compress.fsdp "
                         "reduces by AVG or SUM (FSDP2's own, without set_gradient_divide_factor)")

    def _cast(self, output, input, group, divisor):
        """A cast (fp16): its codes reduce-scattered (divided first, so that a sum of float16
        codes does not overflow), cast back."""
        comp, stats, n = self.front.compression, self.front.core.communicator.stats, \
            self.front.engine.size()
        codes, ctx = comp.compress(input)
        if divisor != 1:
            codes.div_(divisor)
        reduced = torch.empty(output.numel(), dtype=codes.dtype, device=codes.device)
        dist.reduce_scatter_single(output=reduced, input=codes, group=group,
                                  op=dist.ReduceOp.SUM)
        output.copy_(comp.decompress(reduced, ctx))
        stats.add("bytes_sent", (n - 1) * reduced.numel() * reduced.element_size())

    def _packet(self, output, input, divisor):
        """Each row of the input one message (and a non-finite flag), all-to-all, this rank's
        row of every rank decoded and summed in float32 in rank order."""
        front = self.front
        comp, memory, stats = front.compression, front.memory, front.core.communicator.stats
        n, m, name = front.engine.size(), output.numel(), self.bucket
        block = front.scale_block or max(m, 1)
        x = input if input.dtype == torch.float32 else input.to(torch.float32)
        size = comp.message_bytes(m, block)
        row = size + FLAG_BYTES
        # made for this call and freed after it, as FSDP2's own input is: buffers kept per
        # module would add up to the whole model's gradient, what sharding saves
        send = torch.zeros(n, row, dtype=torch.uint8, device=x.device)
        with stats.timing("compress_s"):
            if memory is not None:
                memory.bind(name, *self.members(n, self._present(input.numel(), n)))
                memory.compensate(name, x, inplace=True)
            send[:, size] = int(not all_finite(x))
            with rounding_stream(name):
                for k in range(n):
                    comp.encode_message(x[k * m:(k + 1) * m], send[k, :size], block)
            if memory is not None:
                kept = torch.empty(n * m, dtype=torch.float32, device=x.device)
                for k in range(n):
                    comp.decode_message(send[k, :size], m, kept[k * m:(k + 1) * m], block)
        with stats.timing("communicate_s"):
            handle = front.engine.alltoall_async(send.view(-1), [row] * n, f"hvdc.{name}")
            received, _ = front.engine.wait(handle)
        stats.add("bytes_sent", (n - 1) * row)
        rows = received.view(n, row)
        flagged = [r for r in range(n) if int(rows[r, size])]
        if flagged and front.on_nonfinite == "raise":
            raise FloatingPointError(
                f"hvd_compress.fsdp: a NaN or Inf gradient on rank {', '.join(map(str, flagged))}"
                f" in {name}'s reduce-scatter (step {front.core.steps}); every rank raises here, "
                "before this module's shard or residual changed (the step is lost, the "
                "parameters are not). on_nonfinite='pass' carries them instead")
        if memory is not None:
            memory.remember(name, x, kept)
        with stats.timing("decompress_s"):
            out = output if output.dtype == torch.float32 else \
                torch.empty(m, dtype=torch.float32, device=x.device)
            comp.decode_messages(rows[:, :size].contiguous(), m, out, block, divisor)
            if out is not output:
                output.copy_(out)
