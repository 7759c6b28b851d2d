#!/usr/bin/env python
"""Draw docs/architecture.png: the plugin's layers (left, bottom to top, as
tests/test_import_graph.py states them), one bucket's hot path (middle) and Compression.auto's
loop (right).

    python scripts/draw_architecture.py            # writes docs/architecture.png
"""
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt                       # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch   # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "architecture.png"

# bottom to top; (package, what it is)
LAYERS = [
    ("codecs/", "pure bit functions"),
    ("registry.py", "one entry per scheme"),
    ("roles.py", "the contract"),
    ("compressors/", "one file per scheme"),
    ("engine/", "Horovod | torch.distributed"),
    ("exchange/", "buckets, routes, memory"),
    ("costmodel/", "alpha-beta, bytes"),
    ("methods/", "top-k, PowerSGD"),
    ("auto/", "Compression.auto"),
    ("compression.py", "the namespace"),
    ("front/", "the core every front shares"),
    ("overlap.py", "the overlapped schedule"),
    ("optimizer.py, ddp.py", "Horovod's and DDP's fronts"),
]

HOT_PATH = [
    ("gradient hook", "the bucket's last gradient is in"),
    ("copy", "gradients -> the bucket's flat float32 buffer"),
    ("encode", "compensate, encode to one message, remember"),
    ("launch", "allgather / alltoall / allreduce, async"),
    ("backward goes on", "earlier layers' gradients, more buckets"),
    ("finish", "decode and sum the ranks' codes / n"),
    ("update", ".grad is its slice of the bucket; its parameters step"),
]

AUTO_LOOP = [
    ("measure", "warm-up steps: pace, links, codecs, errors"),
    ("plan", "rank 0 picks a label per bucket, broadcasts"),
    ("exchange", "each bucket by its label's communicator"),
    ("check drift", "measured step against the predicted one"),
]


def box(ax, x, y, w, h, title, text, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.015",
                                fc=color, ec="#333333", lw=0.8))
    ax.text(x + 0.012, y + h * 0.62, title, fontsize=8.5, weight="bold", va="center")
    ax.text(x + 0.012, y + h * 0.26, text, fontsize=7, va="center", color="#333333")


def arrow(ax, a, b, **kw):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=9, lw=0.9,
                                 color=kw.pop("color", "#333333"), clip_on=False, **kw))


def draw(path=OUT):
    fig, ax = plt.subplots(figsize=(12, 7))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")

    ax.text(0.02, 0.97, "Layers (imports point down only)", fontsize=10, weight="bold")
    y0, top = 0.02, 0.93                     # the column's room, shared by however many layers
    pitch = (top - y0) / len(LAYERS)
    h, gap = pitch * 0.68, pitch * 0.32
    for i, (name, what) in enumerate(LAYERS):
        y = y0 + i * (h + gap)
        color = "#dbe9f6" if i < 3 else "#e8f3e0" if i < len(LAYERS) - 3 else "#fbe5d6"
        box(ax, 0.02, y, 0.24, h, name, what, color)
        if i:
            arrow(ax, (0.14, y - 0.002), (0.14, y - gap + 0.004))

    ax.text(0.31, 0.97, "One bucket's hot path", fontsize=10, weight="bold")
    h, gap, top = 0.085, 0.042, 0.86
    for i, (title, text) in enumerate(HOT_PATH):
        y = top - i * (h + gap)
        color = "#fff2cc" if i < 4 else "#e2f0d9" if i == 4 else "#dbe9f6"
        box(ax, 0.31, y, 0.29, h, title, text, color)
        if i:
            arrow(ax, (0.455, y + h + gap - 0.004), (0.455, y + h + 0.002))
    ax.text(0.61, top - 1.5 * (h + gap) + h / 2, "during backward\n(gradient hooks)",
            fontsize=7.5, color="#7f6000", va="center")
    ax.text(0.61, top - 5.5 * (h + gap) + h / 2, "next forward\n(or step())", fontsize=7.5, color="#1f4e79",
            va="center")

    ax.text(0.73, 0.97, "Compression.auto's loop", fontsize=10, weight="bold")
    h, x, w = 0.11, 0.73, 0.25
    spots = [0.78, 0.56, 0.34, 0.12]
    for (title, text), y in zip(AUTO_LOOP, spots):
        box(ax, x, y, w, h, title, text, "#f2e6f7")
    for y, y2 in zip(spots, spots[1:]):
        arrow(ax, (x + w / 2, y - 0.002), (x + w / 2, y2 + h + 0.002))
    arrow(ax, (x + w + 0.002, spots[3] + h / 2), (x + w + 0.002, spots[0] + h / 2),
          connectionstyle="arc3,rad=0.15", color="#7030a0")
    ax.text(x + w + 0.035, 0.5, "drift:\nre-plan", fontsize=7.5, color="#7030a0", va="center")
    arrow(ax, (x - 0.002, spots[3] + h / 2), (x - 0.002, spots[2] + h / 2),
          connectionstyle="arc3,rad=-0.5", color="#555555")
    ax.text(x - 0.035, spots[3] + h + 0.01, "no drift", fontsize=7, color="#555555",
            ha="right")

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(draw(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
