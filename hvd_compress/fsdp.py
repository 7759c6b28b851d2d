"""hvd_compress on PyTorch FSDP2: the project's codecs on the gradients' reduce-scatter of every
module wrapped by `fully_shard`, over torch.distributed (docs/fsdp.md).

    from torch.distributed.fsdp import fully_shard
    import hvd_compress.fsdp as hcf
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = hcf.register(model, "bit8", error_feedback=True)
    ...
    torch.save({"model": ..., "codec": state.compression_state_dict()}, path)   # one per rank

The FSDP front: FSDP2 keeps its own life cycle (when a module's gradients are ready, how they
are padded and laid out, where the reduced shard goes); this module replaces only the collective,
through FSDPModule.set_custom_reduce_scatter. What every front shares is its FrontCore
(front/core.py): the scheme by name, error feedback by parameter name, the ranks' agreement,
the checkpoint format. How one reduce-scatter goes, and why:
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
- Every message carries a flag (4 bytes) more: whether the sender's input held a NaN or an Inf. So
  every rank learns of a non-finite gradient in the same call, with no extra collective, and
  every rank raises the same FloatingPointError (on_nonfinite="raise"), before error feedback
  remembers anything; on_nonfinite="pass" decodes them as the codec carries them (a gradient
  scaler that skips such steps wants them).
- Error feedback keeps this rank's residual of its whole input (what its codes dropped, for
  every destination), named per parameter and destination shard ("<fqn>#shard<k>of<n>"), so a
  checkpoint is read by name whatever the modules' grouping.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .codecs import SCALE_BLOCK
from .compressors import compressor_name
from .engine.base import AVERAGE
from .engine.distributed import TorchEngine
from .front.core import AGREE_TIMEOUT_S, FrontAPI, FrontCore, resolve_compression
from .roles import PacketCompressor, rounding_stream

__all__ = ["FSDPCompression", "CompressedReduceScatter", "register", "fsdp_modules"]

NONFINITE = ("raise", "pass")
# The non-finite flag after each message: 4 bytes, so that every row's block scales (float32 at
# its start) stay 4-byte aligned in the all-to-all's buffer.
FLAG_BYTES = 4


def fsdp_modules(model):
    """(qualified name, module) of every module under `model` (itself included) that
    fully_shard wrapped and that holds parameters of its own (a parameter group)."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError(f"hvd_compress.fsdp: no module of this {type(model).__name__} is "
                         "wrapped by torch.distributed.fsdp.fully_shard: call fully_shard on "
                         "the model (and its blocks) first, then register")
    return [(name, m) for name, m in found if m._get_fsdp_state()._fsdp_param_groups]


def _group(module):
    """The module's one FSDP parameter group (set_custom_reduce_scatter refuses several)."""
    return module._get_fsdp_state()._fsdp_param_groups[0]


class CompressedReduceScatter(ReduceScatter):
    """The reduce-scatter of one FSDP module's gradients (FSDP2's ReduceScatter interface), by
    its front's codec; named `bucket` in error feedback and in errors."""

    def __init__(self, front, bucket, names, numels):
        self.front, self.bucket = front, bucket
        self.names, self.numels = list(names), [int(k) for k in numels]

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def members(self, n):
        """(names, numels) of the input's pieces: row k holds every parameter's k-th chunk."""
        return ([f"{p}#shard{k}of{n}" for k in range(n) for p in self.names],
                [c for _ in range(n) for c in self.numels])

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.front.reduce_scatter(self, output_tensor, input_tensor, group, op)
        if not async_op:
            return None
        done = torch.futures.Future()            # the work is done: a Work that says so
        done.set_result([output_tensor])
        return torch._C._distributed_c10d._create_work_from_future(done)


class FSDPCompression(FrontAPI):
    """The FSDP front: its FrontCore over a TorchEngine of FSDP's shard group, and the
    reduce-scatters it installed, one per module (`comms`, by module name).

    compression: 'none', 'fp16', 'bit16', 'bf16', 'bit8', 'int8' (any packet scheme of the
        registry), or a Compression value of one of them.
    error_feedback: carry each rank's quantisation error to its next step (packet schemes);
        None: the scheme's default.
    on_nonfinite: 'raise' (a NaN/Inf gradient on any rank raises FloatingPointError on every
        rank) or 'pass' (decoded as the codec carries it); packet schemes only.
    """

    def __init__(self, model, compression="bit8", error_feedback=None, scale_block=SCALE_BLOCK,
                 on_nonfinite="raise", agree_timeout_s=AGREE_TIMEOUT_S):
        if on_nonfinite not in NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE}, got {on_nonfinite!r}")
        modules = fsdp_modules(model)
        compression = resolve_compression(compression)
        if callable(getattr(compression, "communicator", None)):
            raise ValueError(f"hvd_compress.fsdp carries codecs of values (none, fp16, bit16, "
                             f"bf16, bit8, int8), not {compressor_name(compression)}, which "
                             "needs a collective of its own")
        self.packet = isinstance(compression, type) and issubclass(compression, PacketCompressor)
        groups = {id(g): g for g in (_group(m).mesh_info.shard_process_group
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
        fqn = {id(p): n for n, p in model.named_parameters()}
        self.comms, self._reduced = {}, set()
        n = self.engine.size()
        for name, module in modules:
            params = _group(module).fsdp_params
            comm = CompressedReduceScatter(
                self, f"fsdp.{name or 'root'}",
                [fqn.get(id(p.sharded_param), f"{name}.{i}") for i, p in enumerate(params)],
                [p.padded_sharded_param_size.numel() for p in params])
            if self.memory is not None:
                self.memory.bind(comm.bucket, *comm.members(n))
            self.comms[name] = comm
        self.core.agree(dict(self.core.setup(), on_nonfinite=on_nonfinite,
                             modules=[(c.bucket, c.numels) for c in self.comms.values()]),
                        "FSDP modules", agree_timeout_s)
        for name, module in modules:
            module.set_custom_reduce_scatter(self.comms[name])

    def pop_stats(self):
        return self.core.pop_stats()

    # ---- one module's reduce-scatter ----------------------------------------------------------
    def reduce_scatter(self, comm, output, input, group, op):
        if group is not self.engine.group:
            raise ValueError(f"{comm.bucket}: FSDP reduce-scatters over another process group "
                             "than the one hvd_compress.fsdp was registered on")
        n, m = self.engine.size(), output.numel()
        if input.numel() != n * m:
            raise ValueError(f"{comm.bucket}: reduce-scatter input of {input.numel()} values "
                             f"for an output of {m} on {n} ranks")
        if comm.bucket in self._reduced:         # a module reduces again: the last step ended
            self._end_step()
        self.core.hooked()
        if compressor_name(self.compression) == "none":     # FSDP2's own, whatever its op
            dist.reduce_scatter_single(output=output, input=input, group=group, op=op)
            self.core.communicator.stats.add("bytes_sent",
                                             (n - 1) * output.numel() * output.element_size())
        elif not self.packet:
            self._cast(output, input, group, self._divisor(op, n, comm))
        else:
            self._packet(comm, output, input, self._divisor(op, n, comm))
        self._reduced.add(comm.bucket)
        if len(self._reduced) == len(self.comms):
            self._end_step()

    def _end_step(self):
        self._reduced = set()
        self.core.end_step(self.core.next_step())

    def _divisor(self, op, n, comm):
        if op == dist.ReduceOp.AVG:
            return n
        if op == dist.ReduceOp.SUM:
            return 1
        raise ValueError(f"{comm.bucket}: FSDP asks for the reduction {op!r}; hvd_compress.fsdp "
                         "reduces by AVG or SUM (FSDP2's own, without set_gradient_divide_factor)")

    def _cast(self, output, input, group, divisor):
        """A cast (fp16): its codes reduce-scattered (divided first, so that a sum of float16
        codes does not overflow), cast back."""
        stats, n = self.core.communicator.stats, self.engine.size()
        codes, ctx = self.compression.compress(input)
        if divisor != 1:
            codes.div_(divisor)
        reduced = torch.empty(output.numel(), dtype=codes.dtype, device=codes.device)
        dist.reduce_scatter_single(output=reduced, input=codes, group=group,
                                  op=dist.ReduceOp.SUM)
        output.copy_(self.compression.decompress(reduced, ctx))
        stats.add("bytes_sent", (n - 1) * reduced.numel() * reduced.element_size())

    def _packet(self, comm, output, input, divisor):
        """Each row of the input one message (and a non-finite flag byte), all-to-all, this
        rank's row of every rank decoded and summed in float32 in rank order."""
        comp, memory, stats = self.compression, self.memory, self.core.communicator.stats
        n, m, name = self.engine.size(), output.numel(), comm.bucket
        block = self.scale_block or max(m, 1)
        x = input if input.dtype == torch.float32 else input.to(torch.float32)
        size = comp.message_bytes(m, block)
        row = size + FLAG_BYTES
        # made for this call and freed after it, as FSDP2's own input is: buffers kept per
        # module would add up to the whole model's gradient, what sharding saves
        send = torch.zeros(n, row, dtype=torch.uint8, device=x.device)
        with stats.timing("compress_s"):
            if memory is not None:
                if input.numel() != sum(comm.numels) * n:   # a parameter without gradient
                    memory.bind(name, [f"{name}:{input.numel()}"], [input.numel()])
                else:
                    memory.bind(name, *comm.members(n))
                memory.compensate(name, x, inplace=True)
            send[:, size] = int(not bool(torch.isfinite(x).all()))
            with rounding_stream(name):
                for k in range(n):
                    comp.encode_message(x[k * m:(k + 1) * m], send[k, :size], block)
            if memory is not None:
                kept = torch.empty(n * m, dtype=torch.float32, device=x.device)
                for k in range(n):
                    comp.decode_message(send[k, :size], m, kept[k * m:(k + 1) * m], block)
        with stats.timing("communicate_s"):
            handle = self.engine.alltoall_async(send.view(-1), [row] * n, f"hvdc.{name}")
            received, _ = self.engine.wait(handle)
        stats.add("bytes_sent", (n - 1) * row)
        rows = received.view(n, row)
        flagged = [r for r in range(n) if int(rows[r, size])]
        if flagged and self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"hvd_compress.fsdp: a NaN or Inf gradient on rank {', '.join(map(str, flagged))}"
                f" in {name}'s reduce-scatter (step {self.core.steps}); every rank raises here, "
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


def register(model, compression="bit8", **options):
    """Install `compression` on the gradients' reduce-scatter of every fully_shard module of
    `model` (call it on every rank alike, after fully_shard, before the first backward); the
    FSDPCompression (keep it for checkpoints and counters)."""
    return FSDPCompression(model, compression, **options)
