"""Step 1: the course's starting point, pytorch/examples' MNIST trainer, serial.

    python train.py --epochs 1                     # Fashion-MNIST from Debian's package

Make it data-parallel with Horovod (the handout's five changes: hvd.init(), each rank trains on
its own shard of the data, lr x hvd.size(), hvd.DistributedOptimizer, rank 0's initial weights
broadcast to every rank), and log every step's time and loss and every evaluation's accuracy
with kitlog.TrainLog(args.log_dir). Keep the flags: the grader runs
`horovodrun -np 2 python train.py --epochs 1 --train-samples N --test-samples M --log-dir D`.
Step 4 adds --bit8-allreduce / --bit16-allreduce (hvd.Compression.bit8 / .bit16).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader

import data


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


def train(args, model, loader, optimizer, epoch):
    model.train()
    for batch, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if batch % args.log_interval == 0:
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
    print(f"test loss {loss / n:.4f}, accuracy {100 * correct / n:.2f}%")
    return loss / n, correct / n


def main():
    parser = argparse.ArgumentParser(description="pytorch/examples MNIST, serial (course kit)")
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
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set, test_set = data.load(args.dataset, args.data_dir, args.train_samples,
                                    args.test_samples)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    for epoch in range(1, args.epochs + 1):
        train(args, model, train_loader, optimizer, epoch)
        test(model, test_loader)


if __name__ == "__main__":
    main()
