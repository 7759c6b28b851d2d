"""The course's solution of steps 1 and 4: the kit's trainer, data-parallel with Horovod.

Never handed out (labs.classroom.solution installs it into a kit to grade the grader). The
kit's serial train.py with Horovod's five changes, kitlog's per-step logging and the
compression flags; labs/mnist.py is the project's full trainer.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd

import data
import kitlog


class Net(nn.Module):
    """pytorch/examples' network: two convolutions, dropout, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


def train(args, model, loader, sampler, optimizer, epoch, log):
    model.train()
    sampler.set_epoch(epoch)
    for batch, (x, y) in enumerate(loader):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        log.step(epoch, batch, time.perf_counter() - start, loss.item())
        if batch % args.log_interval == 0 and hvd.rank() == 0:
            print(f"epoch {epoch} step {batch}/{len(loader)} loss {loss.item():.4f}")


def test(model, loader):
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            output = model(x)
            loss += F.nll_loss(output, y, reduction="sum").item()
            correct += int((output.argmax(dim=1) == y).sum())
    n = len(loader.dataset)
    if hvd.rank() == 0:
        print(f"test loss {loss / n:.4f}, accuracy {100 * correct / n:.2f}%")
    return loss / n, correct / n


def main():
    parser = argparse.ArgumentParser(description="pytorch/examples MNIST with Horovod (course)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "mnist"])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--train-samples", type=int, default=None)
    parser.add_argument("--test-samples", type=int, default=None)
    parser.add_argument("--log-dir", default="runs/serial")
    compression = parser.add_mutually_exclusive_group()
    compression.add_argument("--bit8-allreduce", action="store_true")
    compression.add_argument("--bit16-allreduce", action="store_true")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set, test_set = data.load(args.dataset, args.data_dir, args.train_samples,
                                    args.test_samples)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                 seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    compression = (hvd.Compression.bit8 if args.bit8_allreduce else
                   hvd.Compression.bit16 if args.bit16_allreduce else hvd.Compression.none)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    log = kitlog.TrainLog(args.log_dir)
    for epoch in range(1, args.epochs + 1):
        train(args, model, train_loader, sampler, optimizer, epoch, log)
        log.epoch(epoch, *test(model, test_loader))


if __name__ == "__main__":
    main()
