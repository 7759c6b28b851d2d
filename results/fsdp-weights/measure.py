"""What the weights' all-gather in 8 bits costs on the lab's network (labs/mnist.py BasicNet,
each layer its own fully_shard module, Gloo on the CPU): the gathered weights' error against
the exact shards, the bytes each forward gathers, and the loss and accuracy after a short
training against FSDP2's own float32 all-gather. Counts, not timings.

    torchrun --nproc-per-node 2 results/fsdp-weights/measure.py --steps 150

Rank 0 writes weights_error.csv and training.csv beside this file (--out to change).
"""
import argparse
import csv
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hvd_compress.fsdp as hcf
from labs.kit import data as lab_data
from labs.mnist import BasicNet

LAYERS = ("conv1", "conv2", "fc1", "fc2")
# (label, gradients' scheme and options, weights' scheme)
ARMS = (("FSDP2 float32", "none", {}, "none"),
        ("weights=bit8", "none", {}, "bit8"),
        ("weights=int8", "none", {}, "int8"),
        ("bit8+ef gradients", "bit8", {"error_feedback": True}, "none"),
        ("bit8+ef gradients, weights=bit8", "bit8", {"error_feedback": True}, "bit8"))


def build(mesh, seed):
    torch.manual_seed(seed)
    net = BasicNet()
    for layer in LAYERS:
        fully_shard(net.get_submodule(layer), mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def weight_errors(net):
    """Per layer, the gathered weights against the exact ones (full_tensor of the shards)."""
    rows = []
    for layer in LAYERS:
        module = net.get_submodule(layer)
        exact = {k: p.detach().full_tensor() for k, p in module.named_parameters()}
        module.unshard()
        got = {k: p.detach().clone() for k, p in module.named_parameters()}
        module.reshard()
        for k in exact:
            w, g = exact[k].reshape(-1), got[k].reshape(-1)
            nz = w != 0
            rel = (g[nz] - w[nz]).abs() / w[nz].abs()
            rows.append({"param": f"{layer}.{k}", "numel": w.numel(),
                         "norm_rel_error": ((g - w).norm() / w.norm()).item(),
                         "mean_rel_error": rel.mean().item(), "max_rel_error": rel.max().item(),
                         "max_abs_error_over_max_abs": ((g - w).abs().max() /
                                                        w.abs().max()).item(),
                         "zeroed_fraction": ((g == 0) & nz).float().mean().item()})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    data = lab_data.load_dataset(download=False)
    xs, ys = data.train_x[rank::n], data.train_y[rank::n]
    tx, ty = data.test_x[:args.test], data.test_y[:args.test]

    errors, training = [], []
    for label, scheme, options, weights in ARMS:
        net = build(mesh, args.seed)
        state = hcf.register(net, scheme, weights=weights, **options)
        if weights != "none":
            errors += [dict(world_size=n, weights=weights, **r) for r in weight_errors(net)]
        state.pop_stats()
        opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
        torch.manual_seed(args.seed * 1000 + rank)          # the same dropout in every arm
        net.train()
        losses = []
        for step in range(args.steps):
            a = (step * args.batch_size) % (xs.shape[0] - args.batch_size)
            x, y = xs[a:a + args.batch_size], ys[a:a + args.batch_size]
            opt.zero_grad()
            loss = F.nll_loss(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        stats = state.pop_stats()
        net.eval()
        with torch.no_grad():
            out = torch.cat([net(tx[i:i + 500]) for i in range(0, tx.shape[0], 500)])
        forward = state.pop_stats()
        tail = torch.tensor(losses[-50:]).mean()
        dist.all_reduce(tail)
        training.append({
            "world_size": n, "arm": label, "steps": args.steps, "batch_per_rank": args.batch_size,
            "train_loss_last50": (tail / n).item(),
            "test_loss": F.nll_loss(out, ty).item(),
            "test_accuracy": (out.argmax(1) == ty).float().mean().item(),
            "weights_bytes_per_step": stats["weights_bytes_sent"] / args.steps,
            "weights_bytes_per_forward": forward["weights_bytes_sent"] / -(-tx.shape[0] // 500),
            "gradient_bytes_per_step": stats["bytes_sent"] / args.steps})
        if rank == 0:
            print(training[-1], flush=True)
    if rank == 0:
        out = Path(args.out)
        for name, rows in (("weights_error", errors), ("training", training)):
            path = out / f"{name}-np{n}.csv"
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            print("wrote", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
