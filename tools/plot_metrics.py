"""Curves of one or more runs: `python tools/plot_metrics.py RUN_DIR [RUN_DIR ...] [--out DIR]`.

One PNG per plot (loss, HellaSwag, tasks, LR, throughput) and x axis (step, tokens), every run overlaid, read
from each run's metrics.jsonl (metrics.read_jsonl: a cut-off last line is dropped with a warning).
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: tools/ is one folder down
sys.path.insert(0, ROOT)  # `python tools/plot_metrics.py` imports the project's modules

from config import UserError, run_command  # noqa: E402 - after the line above
from metrics import read_jsonl  # noqa: E402


PLOTS = {  # file name -> metrics drawn in it
    "loss": ["train/loss", "val/loss"],
    "hellaswag": ["eval/hellaswag/acc_norm", "eval/hellaswag/acc"],
    "tasks": ["eval/average", "eval/average_centered"],
    "lr": ["optim/lr"],
    "throughput": ["throughput/tokens_per_sec"],
}


def run_labels(run_dirs):
    """Each run's label: the shortest tail of its path that no other run's path ends with, so runs whose
    folders share a name stay apart (ladders/adamw/2x32 and ladders/muon/2x32: adamw/2x32, muon/2x32)."""
    paths = [os.path.abspath(d).strip(os.sep).split(os.sep) for d in run_dirs]
    labels = []
    for i, path in enumerate(paths):
        others = paths[:i] + paths[i + 1:]
        length = next((n for n in range(1, len(path)) if all(other[-n:] != path[-n:] for other in others)), len(path))
        labels.append("/".join(path[-length:]))
    return labels


def plot_runs(run_dirs, out_dir):
    """One PNG per plot and x axis (step, tokens), every run overlaid. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    # A list, not a dict by label: a run given twice is drawn twice rather than silently dropped.
    runs = [(label, read_jsonl(os.path.join(d, "metrics.jsonl"))) for label, d in zip(run_labels(run_dirs), run_dirs)]
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is a file, not a folder; give --out a folder (new or existing) for the PNGs.")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for plot_name, names in PLOTS.items():
        for x_axis in ("step", "tokens"):
            fig, ax = plt.subplots(figsize=(8, 5))
            drawn = 0
            for run_name, rows in runs:
                for name in names:
                    points = [(r[x_axis], r[name]) for r in rows if name in r and x_axis in r]
                    if points:
                        ax.plot(*zip(*points), label=f"{run_name} {name}", marker="." if len(points) < 50 else None)
                        drawn += 1
            if drawn:
                ax.set_xlabel(x_axis)
                ax.set_title(plot_name)
                ax.grid(alpha=0.3)
                ax.legend()
                path = os.path.join(out_dir, f"{plot_name}_vs_{x_axis}.png")
                fig.savefig(path, dpi=100, bbox_inches="tight")
                written.append(path)
            plt.close(fig)
    return written


def main(argv):
    parser = argparse.ArgumentParser(description="Plot the metrics of one or more runs.")
    parser.add_argument("run_dirs", nargs="+", help="run folders holding metrics.jsonl")
    parser.add_argument("--out", help="where to write the PNGs (default: <first run>/plots)")
    args = parser.parse_args(argv)
    missing = [d for d in args.run_dirs if not os.path.exists(os.path.join(d, "metrics.jsonl"))]
    if missing:
        raise UserError(f"{missing[0]} has no metrics.jsonl; give the train.out_dir of a run.")
    empty = [d for d in args.run_dirs if not read_jsonl(os.path.join(d, "metrics.jsonl"))]
    if empty:
        raise UserError(f"{empty[0]}/metrics.jsonl holds no rows yet, so there is nothing to plot; plot the run once "
                        f"it has logged a step.")
    for path in plot_runs(args.run_dirs, args.out or os.path.join(args.run_dirs[0], "plots")):
        print(path)


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
