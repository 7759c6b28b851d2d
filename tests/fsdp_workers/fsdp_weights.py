"""hvd_compress.fsdp's weights' all-gather (weights=...) on real Gloo ranks (tests/test_fsdp_weights.py
starts them through tests/ddprun.py): every rank gathers the same decoded weights, each rank's
shard encoded and decoded as the codec does it; the forward equals a plain module's forward on
those weights, and the backward sees them too; the optimizer updates the exact float32
shards; `none` is FSDP2's own all-gather bit for bit; clear errors for a NaN weight (every
rank, the shards kept), a module without fully_shard, non-float parameters, a call of the
wrong sizes, and schemes that cannot gather weights. Odd sizes (a shard of padding only, odd
rows) gather right. keep_weight_codes: the backward decodes the forward's codes (the same bits,
half the bytes, the forward's weights even where the shards changed in between); gathers in
pieces (gather_pieces=True) give the same bits as whole ones."""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.func import functional_call

import hvd_compress.fsdp as hcf
from hvd_compress.codecs import SCALE_BLOCK
from hvd_compress.front.core import resolve_compression
from checks import check
from fsdp_workers.fsdp_checks import (Net, batches, build, full, grads, local, raised,
                                      same_on_every_rank, train)

# ||gathered - exact|| / ||exact|| of the weights: what each format's rounding allows on
# weights of one scale per block (E4M3: 3 mantissa bits; int8: 1/127 of a block's largest;
# bf16: 8 bits; float16: 11 bits), with room to spare, and far below 1.
TOLERANCE = {"bit8": 0.05, "int8": 0.02, "bf16": 5e-3, "bit16": 1e-3}
CODEC = {"int8": hcf.NearestInt8}
LAYERS = ("fc1", "fc2", "fc3")


class Odd(nn.Module):
    """Sizes that do not divide: 3 rows on 4 ranks (a shard of padding only), rows of 7 and 3
    values (odd shards, messages padded to 4 bytes), a bias of 1."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 3)
        self.b = nn.Linear(3, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def gathered(net, names):
    """The weights each module gathers, as FSDP2 gathers them for its forward."""
    out = {}
    for layer in names:
        module = net.get_submodule(layer)
        module.unshard()
        for pname, p in module.named_parameters():
            out[f"{layer}.{pname}"] = p.detach().clone()
        module.reshard()
    return out


def expected(exact, names, scheme, n):
    """Each module's all-gather as the codec sends it, written out here: rank r's row holds
    every parameter's r-th dim-0 chunk (ceil(rows / n) rows, zero-padded), back to back; the
    row is one message of block-scaled codes; every rank decodes every row."""
    comp = CODEC.get(scheme) or resolve_compression(scheme)
    out = {}
    for layer in names:
        params = [(k, v) for k, v in exact.items() if k.startswith(layer + ".")]
        rows = [math.ceil(v.shape[0] / n) for _, v in params]
        decoded = []
        for r in range(n):
            pieces = []
            for (k, v), c in zip(params, rows):
                chunk = v[r * c:(r + 1) * c].reshape(-1)
                width = v[0].numel()
                pieces.append(F.pad(chunk, (0, c * width - chunk.numel())))
            row = torch.cat(pieces)
            message = torch.zeros(comp.message_bytes(row.numel(), SCALE_BLOCK), dtype=torch.uint8)
            comp.encode_message(row, message, SCALE_BLOCK)
            back = torch.empty_like(row)
            comp.decode_messages(message.view(1, -1), row.numel(), back, SCALE_BLOCK)
            decoded.append(back.split([c * v[0].numel() for (_, v), c in zip(params, rows)]))
        for i, ((k, v), c) in enumerate(zip(params, rows)):
            whole = torch.cat([decoded[r][i].view(c, *v.shape[1:]) for r in range(n)])
            out[k] = whole[:v.shape[0]]
    return out


def exact_weights(net):
    return {k: p.detach().full_tensor() for k, p in net.named_parameters()}


def flat(d):
    return torch.cat([v.reshape(-1) for v in d.values()])


def run(_dist):
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    data = batches(rank)
    x_all = torch.randn(8, 12, generator=torch.Generator().manual_seed(5))   # same on all ranks

    # ---- none: FSDP2's own all-gather, bit for bit -------------------------------------------
    default = train(build(mesh), data)
    ours = build(mesh)
    state = hcf.register(ours, "none", weights="none")
    train(ours, data)
    a, b = local(default), local(ours)
    check("weights=none = FSDP2's default all-gather after 4 steps, bit for bit",
          torch.equal(a, b) and not torch.equal(local(build(mesh)), a),
          f"max difference {(a - b).abs().max().item()}")
    none_bytes = state.pop_stats()["weights_bytes_sent"]
    # 4 steps, a gather before each forward and each backward, (n-1) x the padded row of float32
    check("weights=none counts what it sends: (n-1) x the shards, each forward and backward",
          none_bytes == 4 * 2 * (n - 1) * 4 * sum(sum(c.numels) for c in state.comms.values()),
          str(none_bytes))

    for scheme in ("bit8", "int8", "bf16", "bit16"):
        # ---- the gathered weights: each shard's codes, decoded alike on every rank ------------
        net = build(mesh)
        state = hcf.register(net, "none", weights=scheme)
        exact = exact_weights(net)
        got = gathered(net, LAYERS)
        want = expected(exact, LAYERS, scheme, n)
        check(f"weights={scheme}: the gathered weights are every shard encoded and decoded",
              all(torch.equal(got[k], want[k]) for k in want), str(sorted(want)))
        check(f"weights={scheme}: every rank gathers the same weights",
              same_on_every_rank(dist, flat(got)))
        error = ((flat(got) - flat(exact)).norm() / flat(exact).norm()).item()
        check(f"weights={scheme}: the gathered weights within {TOLERANCE[scheme]} of the exact",
              0 < error < TOLERANCE[scheme], f"relative error {error}")

        # ---- the forward is the forward on the decoded weights; so is the backward ------------
        out = net(x_all)
        plain = Net()
        check(f"weights={scheme}: the forward equals a plain module's on the decoded weights",
              torch.equal(out, functional_call(plain, got, (x_all,)))
              and same_on_every_rank(dist, out.detach()))
        state.pop_stats()
        x, y = data[0]
        before = local(net)
        F.cross_entropy(net(x), y).backward()
        sent = state.pop_stats()["weights_bytes_sent"]
        mine = {k: v.clone().requires_grad_() for k, v in got.items()}
        F.cross_entropy(functional_call(plain, mine, (x,)), y).backward()
        on_decoded = torch.cat([mine[k].grad.reshape(-1) for k in mine])
        dist.all_reduce(on_decoded)
        on_decoded /= n
        ours_full = torch.cat([p.grad.full_tensor().reshape(-1) for p in net.parameters()])
        check(f"weights={scheme}: the backward's gradient is the one on the decoded weights",
              torch.allclose(ours_full, on_decoded, rtol=1e-5, atol=1e-7),
              f"max difference {(ours_full - on_decoded).abs().max().item()}")
        # the codes' bytes over float32's, and what the block scales, the flag and the
        # padding to 4 bytes add on the small modules' rows (fc3's: 72 values on 4 ranks)
        most = 0.27 if "8" in scheme else 0.52
        check(f"weights={scheme}: sends at most {most} of none's bytes a forward and backward",
              0 < sent <= most * none_bytes / 4, f"{sent} of {none_bytes / 4}")

        # ---- the optimizer updates the exact float32 shards ----------------------------------
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        g = grads(net)
        opt.step()
        after = local(net)
        check(f"weights={scheme}: the optimizer updates the exact float32 shards",
              after.dtype == torch.float32 and torch.equal(after, before.add(g, alpha=-0.05)))

        # ---- training: the same bits run after run, every rank alike --------------------------
        runs = []
        for _ in range(2):
            net = build(mesh)
            hcf.register(net, "bit8", error_feedback=True, weights=scheme)
            runs.append(local(train(net, data)))
        check(f"bit8+ef gradients, weights={scheme}: 4 steps give the same bits run after run",
              torch.equal(runs[0], runs[1]) and bool(torch.isfinite(runs[0]).all()))
        check(f"bit8+ef gradients, weights={scheme}: every rank holds the same parameters",
              same_on_every_rank(dist, full(net)))

    # ---- FSDP2's own options beside it: param_dtype=bfloat16, no reshard after forward -------
    for label, kw in (("param_dtype=bfloat16", {"mp": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16)}), ("reshard_after_forward=False", {})):
        net = build(mesh, **kw)
        if not kw:
            for layer in LAYERS:
                net.get_submodule(layer).set_reshard_after_forward(False)
        hcf.register(net, "bit8", weights="bit8")
        exact = exact_weights(net)
        got = gathered(net, LAYERS)
        error = ((flat(got).float() - flat(exact)).norm() / flat(exact).norm()).item()
        train(net, data)
        check(f"weights=bit8 with {label}: gathered within 0.05, trains alike on every rank",
              0 < error < 0.05 and same_on_every_rank(dist, full(net))
              and bool(torch.isfinite(full(net)).all()), f"relative error {error}")

    # ---- odd sizes: a shard of padding only, odd rows ----------------------------------------
    torch.manual_seed(1)
    odd = Odd()
    fully_shard(odd.a, mesh=mesh)
    fully_shard(odd.b, mesh=mesh)
    fully_shard(odd, mesh=mesh)
    hcf.register(odd, "bit8", weights="bit8")
    exact = exact_weights(odd)
    got = gathered(odd, ("a", "b"))
    xo = torch.randn(4, 7, generator=torch.Generator().manual_seed(9))
    check("odd sizes: the gathered weights are every shard encoded and decoded, every rank "
          "alike, and the forward is theirs",
          all(torch.equal(got[k], v) for k, v in expected(exact, ("a", "b"), "bit8", n).items())
          and same_on_every_rank(dist, flat(got))
          and torch.equal(odd(xo), functional_call(Odd(), got, (xo,))))

    kept_and_pieces(mesh, data, x_all)

    # ---- bad input -----------------------------------------------------------------------------
    net = build(mesh)
    state = hcf.register(net, "bit8", weights="bit8")
    if rank == 0:
        with torch.no_grad():
            net.fc2.weight.to_local()[0, 0] = float("nan")
    kept = local(net)
    err = raised(lambda: net(x_all))
    check("a NaN weight on rank 0 raises FloatingPointError on every rank, naming it",
          isinstance(err, FloatingPointError) and "weight on rank 0 " in str(err)
          and "fsdp.fc2" in str(err), repr(err))
    dist.barrier()
    check("after the NaN weight no rank is left in a collective, and the shards are kept",
          torch.equal(local(net).nan_to_num(7.0), kept.nan_to_num(7.0)))

    comm = state.gathers["fc3"]
    err = raised(lambda: comm(torch.empty(3 * n + 1), torch.empty(3), state.engine.group))
    check("an all-gather of the wrong sizes is refused with a clear error",
          isinstance(err, ValueError) and "all-gather output of" in str(err), repr(err))

    class WithCounts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.counts = nn.Parameter(torch.arange(8), requires_grad=False)

        def forward(self, x):
            return self.fc(x)

    counted = WithCounts()
    fully_shard(counted, mesh=mesh)
    err = raised(lambda: hcf.register(counted, "bit8", weights="bit8"))
    check("non-float parameters are refused with a clear error, naming them",
          isinstance(err, ValueError) and "counts (torch.int64)" in str(err), repr(err))

    err = raised(lambda: hcf.register(build(mesh), "bit8",
                                      weights="bit8" if rank == 0 else None))
    check("ranks that gather weights differently are refused on every rank",
          isinstance(err, RuntimeError) and "weights" in str(err), repr(err))

    for label, make, words in (
            ("a model without fully_shard",
             lambda: hcf.register(build(mesh, shard=False), weights="bit8"), "fully_shard"),
            ("fp16 weights (a cast: FSDP2's param_dtype)",
             lambda: hcf.register(build(mesh), weights="fp16"), "param_dtype"),
            ("top-k weights", lambda: hcf.register(build(mesh), weights="topk"), "weights must"),
            ("an unknown weights scheme",
             lambda: hcf.register(build(mesh), weights="bit7"), "weights must")):
        err = raised(make)
        check(f"{label} is refused with a clear error",
              isinstance(err, ValueError) and words in str(err), repr(err))


class Wide(nn.Module):
    """A layer whose codes are several of the engine's pieces (GATHER_PIECE_BYTES) a rank, at 2
    and at 4 ranks, beside a small one."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(512, 1024)
        self.out = nn.Linear(1024, 5)

    def forward(self, x):
        return self.out(torch.tanh(self.big(x)))


def kept_and_pieces(mesh, data, x_all):
    """keep_weight_codes=True: the backward's gather decodes the forward's codes; and
    gather_pieces: the same bits in pieces as whole."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for scheme in ("bit8", "int8"):
        runs, sent = {}, {}
        for keep in (False, True):
            net = build(mesh)
            state = hcf.register(net, "bit8", error_feedback=True, weights=scheme,
                                 keep_weight_codes=keep)
            x, y = data[0]
            F.cross_entropy(net(x), y).backward()
            sent[keep] = state.pop_stats()["weights_bytes_sent"]
            runs[keep] = local(train(net, data))
            if keep:
                left = [name for name, g in state.gathers.items() if g.kept is not None]
        alike = same_on_every_rank(dist, full(net))
        check(f"keep_weight_codes, weights={scheme}: 4 steps equal the run that gathers again, "
              "bit for bit, every rank alike",
              torch.equal(runs[False], runs[True]) and alike,
              f"max difference {(runs[False] - runs[True]).abs().max().item()}")
        check(f"keep_weight_codes, weights={scheme}: a forward and backward sends half, and "
              "nothing is kept after the backward",
              0 < sent[True] and 2 * sent[True] == sent[False] and not left,
              f"{sent[True]} against {sent[False]}; kept after backward: {left}")

    # the shards change between the forward and the backward: the backward still sees the
    # forward's weights (FSDP2's reshard_after_forward=False does the same); gathering again
    # would see the changed ones
    results = {}
    for keep in (False, True):
        net = build(mesh)
        hcf.register(net, "none", weights="bit8", keep_weight_codes=keep)
        forward_weights = gathered(net, LAYERS)
        x, y = data[0]
        loss = F.cross_entropy(net(x), y)
        with torch.no_grad():
            for p in net.parameters():
                p.to_local().mul_(0.5)
        loss.backward()
        results[keep] = torch.cat([p.grad.full_tensor().reshape(-1) for p in net.parameters()])
    mine = {k: v.clone().requires_grad_() for k, v in forward_weights.items()}
    F.cross_entropy(functional_call(Net(), mine, (x,)), y).backward()
    on_forward = torch.cat([mine[k].grad.reshape(-1) for k in mine])
    dist.all_reduce(on_forward)
    on_forward /= n
    check("keep_weight_codes: the backward sees the forward's weights where the shards changed "
          "in between (gathering again sees the changed ones)",
          torch.allclose(results[True], on_forward, rtol=1e-5, atol=1e-7)
          and not torch.allclose(results[False], on_forward, rtol=1e-5, atol=1e-7),
          f"max difference {(results[True] - on_forward).abs().max().item()}")

    # a module that FSDP2 does not reshard after its forward gathers once: nothing to keep
    net = build(mesh)
    net.fc2.set_reshard_after_forward(False)
    state = hcf.register(net, "bit8", weights="bit8", keep_weight_codes=True)
    net(x_all)
    kept = sorted(name for name, g in state.gathers.items() if g.kept is not None)
    net.zero_grad()
    check("keep_weight_codes keeps the codes of the modules resharded after forward only",
          kept == ["fc1", "fc3"], str(kept))

    err = raised(lambda: hcf.register(build(mesh), "bit8", weights="bit8",
                                      keep_weight_codes=rank == 0))
    check("ranks that keep the weights' codes differently are refused on every rank",
          isinstance(err, RuntimeError) and "keep_weight_codes" in str(err), repr(err))
    err = raised(lambda: hcf.register(build(mesh), "bit8", weights="none",
                                      keep_weight_codes=True))
    check("keep_weight_codes without a weights codec is refused with a clear error",
          isinstance(err, ValueError) and "keep_weight_codes" in str(err), repr(err))

    # ---- gathers in pieces: the same bits as whole ---------------------------------------------
    g = torch.Generator().manual_seed(40 + rank)
    wide_data = [(torch.randn(8, 512, generator=g), torch.randint(0, 5, (8,), generator=g))
                 for _ in range(3)]
    runs, pieces = {}, {}
    for in_pieces in (False, True):
        torch.manual_seed(3)
        wide = Wide()
        fully_shard(wide.big, mesh=mesh)
        fully_shard(wide.out, mesh=mesh)
        fully_shard(wide, mesh=mesh)
        state = hcf.register(wide, "bit8", error_feedback=True, weights="bit8",
                             gather_pieces=in_pieces)
        codes = resolve_compression("bit8").message_bytes(512 * 1024 // n, SCALE_BLOCK)
        pieces[in_pieces] = state.engine._gather_pieces(torch.empty(codes, dtype=torch.uint8))
        runs[in_pieces] = local(train(wide, wide_data))
    alike = same_on_every_rank(dist, full(wide))
    check("gather_pieces=True: the weights' and gradients' codes in pieces give the bits of "
          "whole gathers, every rank alike",
          pieces[False] == 1 and pieces[True] > 1 and torch.equal(runs[False], runs[True])
          and alike,
          f"pieces {pieces}; max difference {(runs[False] - runs[True]).abs().max().item()}")

    # gather_pieces=None: decided on every rank alike after the first steps; here (loopback,
    # small messages: nothing timed) whole
    net = build(mesh)
    state = hcf.register(net, "bit8", weights="bit8")
    train(net, data)
    decided = torch.tensor([int(state.engine.in_pieces), int(state.engine.timed)])
    check("gather_pieces=None decides after the first steps, alike on every rank",
          same_on_every_rank(dist, decided) and decided.tolist() == [0, 0], str(decided.tolist()))
