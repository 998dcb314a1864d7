"""The capstone's expected loss curve (docs/exercises.md shows it): model.py's GPT and exercise 16's, both
trained by train.py on the same seed and data at the quick start's shape, as exercise 16's check trains them.

    python exercises/grader/plot_capstone.py [OUT.png] [--steps=60]
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from exercises.grader.checking import run_training  # noqa: E402
from exercises.grader.feed_capstone import QUICK_START  # noqa: E402

CAPSTONE = Path(__file__).resolve().parents[1] / "16_gpt.py"


def main(argv):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = next((a for a in argv if not a.startswith("--")), "docs/capstone_loss.png")
    steps = int(next((a.split("=")[1] for a in argv if a.startswith("--steps=")), "60"))
    common = [str(QUICK_START), "--optim.warmup_steps=2", "--eval.sample_interval=0", f"--train.max_steps={steps}",
              "--eval.interval=0", "--train.no_checkpoints=true", "--train.loss_path=full"]
    with tempfile.TemporaryDirectory() as folder:
        curves = {"model.py": run_training(common + [f"--train.out_dir={folder}/model"]),
                  "exercise 16 (train.model_module)": run_training(
                      common + [f"--train.out_dir={folder}/yours", f"--train.model_module={CAPSTONE}"])}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (name, rows), style in zip(curves.items(), ("-", "--")):
        ax.plot([r["step"] for r in rows], [r["train/loss"] for r in rows], style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("train/loss")
    ax.set_title("exercise 16 against model.py (the quick start's shape)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    last = {name: rows[-1]["train/loss"] for name, rows in curves.items()}
    print(f"wrote {out}; loss at step {steps}: " + ", ".join(f"{n} {v:.4f}" for n, v in last.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
