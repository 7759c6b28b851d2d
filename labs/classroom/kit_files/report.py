"""Step 5 (given): fill report_template.md's table from your runs into report.md.

    python report.py                      # every runs/<name>/ that kitlog wrote

Name your run folders by what they are (--log-dir runs/serial, runs/np2-none, runs/np4-bit8,
...). Then write your observations in report.md below the table, in your own words.
"""
import csv
import glob
import os
import sys


def read(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def run_row(folder):
    epochs = read(os.path.join(folder, "epochs-rank0.csv"))
    steps = [row for path in sorted(glob.glob(os.path.join(folder, "steps-rank*.csv")))
             for row in read(path)]
    last = epochs[-1]
    step_ms = 1000 * sum(float(r["seconds"]) for r in steps) / len(steps)
    rank0 = [r for r in read(os.path.join(folder, "steps-rank0.csv"))]
    return (f"| `{os.path.basename(folder)}` | {last['size']} | {len(epochs)} | "
            f"{len(rank0) // len(epochs)} | {step_ms:.1f} | "
            f"{100 * float(last['test_accuracy']):.2f}% |")


def main():
    folders = sorted(os.path.dirname(p) for p in glob.glob("runs/*/epochs-rank0.csv"))
    if not folders:
        sys.exit("no runs/<name>/epochs-rank0.csv: train first (kitlog.TrainLog(args.log_dir))")
    table = ["| run | processes | epochs | steps per epoch (rank 0) | mean step (ms) | accuracy |",
             "|---|---|---|---|---|---|"] + [run_row(f) for f in folders]
    with open("report_template.md") as handle:
        text = handle.read().replace("{{results_table}}", "\n".join(table))
    with open("report.md", "w") as handle:
        handle.write(text)
    print(f"wrote report.md ({len(folders)} runs)")


if __name__ == "__main__":
    main()
