#!/usr/bin/env bash
# One quiet hold: today's default overlap (this tree) and the opt-in overlap of d45afca, back to back.
cd /work/wt/merge
lscpu | grep "Model name\|CPU family\|^Model:" > runs/overlap-default.cpu
uptime > runs/overlap-default.load
.venv/bin/python -m labs.bench.step --models basic --links 100mbit --ranks 2 --rows stock:none,ours:bit8,ours:bit8+overlap,local --rounds 20 --max-rounds 30 --out runs/overlap-default
uptime >> runs/overlap-default.load
cd /work/wt/old-d45
PYTHONPATH=/work/wt/old-d45 /work/wt/merge/.venv/bin/python scripts/bench_step.py --models basic --links 100mbit --ranks 2 --rows stock:none,ours:bit8,ours:bit8+overlap,local --rounds 20 --max-rounds 30 --out /work/wt/merge/runs/overlap-optin
uptime >> /work/wt/merge/runs/overlap-default.load
