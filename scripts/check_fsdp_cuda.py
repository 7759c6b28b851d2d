#!/usr/bin/env python
"""Does hvd_compress.fsdp run on FSDP2 with NCCL, and do its codecs give the CPU's bits on CUDA
tensors? (issue 56: the FSDP2 front on a GPU)

    python -m scripts.check_fsdp_cuda [--out results/cuda/fsdp_<gpu>.json]
    python -m scripts.check_fsdp_cuda --device cpu      # the same checks on the CPU (Gloo)

From the repository's root, as a module: it imports the checkout's hvd_compress (no install,
no Horovod: a lent GPU machine has torch and the checkout). One process, world size 1 (NCCL
refuses two ranks on one GPU): the default group has Gloo for CPU tensors and NCCL for CUDA
ones, so FSDP2's all-gather and reduce-scatter, and the codecs' all-to-all, run through real
NCCL on the GPU. The checks:
- fsdp:<scheme> on the device: a small network (a convolution and two linear layers, each its
  own fully_shard module, the network the root) trains STEPS steps of SGD with momentum under
  FSDP2 with hvd_compress.fsdp.register(model, scheme), for none, fp16, bit16, bf16, bit8,
  int8 and bit8 with error feedback. `none` must equal FSDP2's own reduce-scatter bit for bit
  (the same network, no register); every codec's first-step gradient shards must be within its
  rounding of FSDP2's (the bounds of tests/test_fsdp.py), and no value may be NaN.
- codec:<scheme>: one module's CompressedReduceScatter called with the same gradient-like
  input on the CPU (Gloo) and on the device (NCCL): the same bits (int8 rounds stochastically
  from the device's generator: within one quantisation step instead), and error feedback's
  residual carried to a second call alike.
Exit status 0 when every check holds, 1 on any failure, 2 where there is no CUDA device, 3
where this torch's FSDP2 takes no custom reduce-scatter.
"""
import argparse
import json
import platform
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
SCHEMES = ("none", "fp16", "bit16", "bf16", "bit8", "int8")
# first-step gradient shards against FSDP2's own: the largest difference over the largest value
BOUNDS = {"fp16": 2e-3, "bit16": 2e-3, "bf16": 0.01, "bit8": 0.08, "int8": 0.03}
STOCHASTIC = ("int8",)


class Net(nn.Module):
    """A convolution and two linear layers: three fully_shard modules of odd dim-0 sizes (FSDP2
    pads them to the ranks)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 5)
        self.fc1 = nn.Linear(6 * 12 * 12, 33)
        self.fc2 = nn.Linear(33, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def batches(device):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 1, 28, 28, generator=g).to(device),
             torch.randint(0, 10, (16,), generator=g).to(device)) for _ in range(STEPS)]


def sharded(device, mesh):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Net().to(device)
    for layer in (model.conv, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(device, mesh, scheme=None, error_feedback=None):
    """(first-step gradient shards, parameter shards after STEPS steps), on the CPU."""
    import hvd_compress.fsdp as hcf
    model = sharded(device, mesh)
    if scheme is not None:
        hcf.register(model, scheme, error_feedback=error_feedback)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = None
    for x, y in batches(device):
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        if first is None:
            first = {n: p.grad.to_local().detach().cpu().clone()
                     for n, p in model.named_parameters()}
        opt.step()
    return first, {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def check_training(device, mesh, report):
    ok = True
    own_first, own_after = train(device, mesh)
    for label, scheme, ef in [(s, s, None) for s in SCHEMES] + [("bit8+ef", "bit8", True)]:
        started = time.perf_counter()
        try:
            first, after = train(device, mesh, scheme, ef)
        except Exception as err:                    # a scheme that cannot run here: say so
            report["fsdp"][label] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            print(f"[check_fsdp_cuda] fsdp:{label}: FAILED ({type(err).__name__}: {err})",
                  flush=True)
            ok = False
            continue
        finite = all(bool(torch.isfinite(t).all()) for t in after.values())
        if scheme == "none":
            good = finite and all(same_bits(after[n], own_after[n]) for n in own_after)
            how = "equal to FSDP2's own reduce-scatter bit for bit after the steps"
        else:
            worst = max(float((first[n] - own_first[n]).abs().max()
                              / own_first[n].abs().max().clamp_min(1e-30)) for n in own_first)
            good = finite and worst <= BOUNDS[scheme]
            how = (f"first-step gradients within {BOUNDS[scheme]} of FSDP2's (largest relative "
                   f"difference {worst:.3g})")
        report["fsdp"][label] = {"ok": good, "compared": how, "finite": finite,
                                 "seconds": round(time.perf_counter() - started, 3)}
        print(f"[check_fsdp_cuda] fsdp:{label}: {'ok' if good else 'MISMATCH'} ({how})",
              flush=True)
        ok &= good
    return ok


def gradient_like(numel, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * 10.0 ** torch.randint(-6, 1, (numel,),
                                                                    generator=g).float()


def reduce_scattered(device, mesh, scheme, ef):
    """fc1's CompressedReduceScatter called twice on the same inputs on `device` (its group):
    the two outputs, on the CPU."""
    import hvd_compress.fsdp as hcf
    model = sharded(device, mesh)
    state = hcf.register(model, scheme, error_feedback=ef)
    comm = state.comms["fc1"]
    group = state.engine.group
    numel = sum(comm.numels)                         # one rank: the row is the whole input
    outs = []
    for call in range(2):
        x = gradient_like(numel, 100 + call).to(device)
        out = torch.empty(numel, device=device)
        comm(out, x, group, dist.ReduceOp.AVG)
        outs.append(out.cpu().clone())
    return outs


def check_codecs(device, cpu_mesh, mesh, report):
    ok = True
    for label, scheme, ef in [(s, s, None) for s in SCHEMES if s != "none"] + [
            ("bit8+ef", "bit8", True)]:
        try:
            cpu = reduce_scattered("cpu", cpu_mesh, scheme, ef)
            dev = reduce_scattered(device, mesh, scheme, ef)
        except Exception as err:
            report["codecs"][label] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
            print(f"[check_fsdp_cuda] codec:{label}: FAILED ({type(err).__name__}: {err})",
                  flush=True)
            ok = False
            continue
        if scheme in STOCHASTIC:
            worst = max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
                        for a, b in zip(cpu, dev))
            good, how = worst < 2 / 127, f"within one quantisation step ({worst:.3g})"
        else:
            good, how = all(same_bits(a, b) for a, b in zip(cpu, dev)), "bit for bit"
        report["codecs"][label] = {"ok": good, "compared": how}
        print(f"[check_fsdp_cuda] codec:{label}: {'ok' if good else 'MISMATCH'} "
              f"(device against CPU, {how})", flush=True)
        ok &= good
    return ok


def init_group(device):
    """World size 1: Gloo for CPU tensors, and NCCL for CUDA ones where there is a device."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timedelta(seconds=120))
    return dist.get_backend()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the checks' own test)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("[check_fsdp_cuda] no CUDA device here: nothing checked (the CPU suite never "
              "needs one; --device cpu runs these checks on Gloo)", file=sys.stderr)
        return 2
    try:
        import hvd_compress.fsdp  # noqa: F401
        from torch.distributed.fsdp import FSDPModule
        FSDPModule.set_custom_reduce_scatter                      # noqa: B018
    except (ImportError, AttributeError) as err:
        print(f"[check_fsdp_cuda] torch {torch.__version__}: its FSDP2 takes no custom "
              f"reduce-scatter ({err}); hvd_compress.fsdp needs one", file=sys.stderr)
        return 3
    from torch.distributed.device_mesh import init_device_mesh
    started = time.perf_counter()
    backend = init_group(args.device)
    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(torch.device(args.device))
    report = {"device": args.device, "backend": backend, "torch": torch.__version__,
              "python": platform.python_version(), "host": platform.node(),
              "horovod_loaded": "horovod" in sys.modules and sys.modules["horovod"] is not None,
              "fsdp": {}, "codecs": {}}
    if device_type == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        mesh = init_device_mesh(device_type, (1,))
        cpu_mesh = mesh if device_type == "cpu" else init_device_mesh("cpu", (1,))
        ok = check_training(args.device, mesh, report)
        ok &= check_codecs(args.device, cpu_mesh, mesh, report)
    finally:
        dist.destroy_process_group()
    report["ok"] = bool(ok)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"[check_fsdp_cuda] {'every check holds' if ok else 'FAILED'} ({report['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
