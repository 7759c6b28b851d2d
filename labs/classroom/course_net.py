"""The grader's own copy of the course's network (the kit's train.py Net: pytorch/examples'
MNIST network), into which it loads the weights a kit's trainer ended with, to score them on
test labels that never enter a sandbox.

The weights come back from the kit's sandbox as plain arrays (the student side packs rank 0's
model's state, an .npz without pickles; schema.py checks each). Loading them here runs none of
the kit's code: only this file's forward pass, on the grader's own test images.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """pytorch/examples' network: two convolutions, dropout, two linear layers (as train.py)."""

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


SHAPES = [(name, tuple(t.shape)) for name, t in Net().state_dict().items()]
PARAMETERS = sum(torch.Size(shape).numel() for _, shape in SHAPES)


def _shapes_text(shapes):
    return ", ".join(f"{name} {'x'.join(map(str, shape))}" for name, shape in shapes)


def load(weights):
    """The course's Net holding `weights` ([(name, tensor)] in the model's state order, as the
    student side sent them), or a ValueError saying how they differ from the course's network
    (matched by shape, in order: a model wrapped in another module keeps its shapes)."""
    got = [(str(name), tuple(t.shape) if isinstance(t, torch.Tensor) else None) for name, t in weights]
    if [shape for _, shape in got] != [shape for _, shape in SHAPES]:
        raise ValueError(f"its layers are {_shapes_text(got[:8]) or 'none'}"
                         f"{', ...' if len(got) > 8 else ''}; the course's network's are "
                         f"{_shapes_text(SHAPES)}")
    bad = [(name, t.dtype) for name, t in weights if not t.is_floating_point()]
    if bad:
        raise ValueError(f"its {bad[0][0]} holds {bad[0][1]} values, not floating point")
    net = Net()
    net.load_state_dict({name: t.to(torch.float32) for (name, _), (_, t) in zip(SHAPES, weights)})
    return net.eval()


@torch.no_grad()
def accuracy(net, x, y, batch=500):
    """The share of `x` (N x 1 x 28 x 28, normalised as the kit's data.py does) that `net`
    classifies as `y`; a non-finite output is a wrong answer."""
    correct = 0
    for start in range(0, len(y), batch):
        out = net(x[start:start + batch])
        finite = torch.isfinite(out).all(dim=1)
        correct += int(((out.argmax(dim=1) == y[start:start + batch]) & finite).sum())
    return correct / len(y) if len(y) else 0.0
