"""The house in numbers, for review: `python tools/house_counts.py [--data_root DIR]`.

Prints the files at the top and the modules with their lines, the functions of the project over 45
lines, and the project's functions one step of the quick start runs (its own config,
config/shakespeare.py: Muon, GPT-2's vocabulary), over how many files: an ordinary step, and one
where evaluation, the console line, a checkpoint and samples are all due. These are signals for a
reader, never targets: no test asserts them (docs/measurements.md keeps the figures).
"""

import argparse
import ast
import collections
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the project: tools/ is one folder down
sys.path.insert(0, str(ROOT))  # `python tools/house_counts.py` imports the project's modules

import torch  # noqa: E402 - after the line above

from config import parse_args, run_command  # noqa: E402

NOT_MODULES = ("tests", "exercises", "tools", "config", ".git", ".bench", "data", "out")
LONG = 45  # lines: a function longer than this is listed


def modules():
    """The project's modules: every tracked .py file outside tests/, exercises/, tools/ and config/."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                            text=True).stdout.split()
    paths = [ROOT / name for name in listed] or list(ROOT.rglob("*.py"))
    return [p for p in paths if p.relative_to(ROOT).parts[0] not in NOT_MODULES]


def long_functions(paths, longer_than=LONG):
    """[(lines, "file:function")] of the functions (methods too) over `longer_than` lines."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > longer_than:
                    found.append((lines, f"{path.relative_to(ROOT)}:{node.name}"))
    return sorted(found, reverse=True)


def steps_of_the_quick_start(data_root, out):
    """{step: {(file, function)}}: the project's functions run from the call of train_step at a step to
    the next one, every thread included, in the quick start's own config, 12 steps in which
    evaluation, the console line, a checkpoint and samples are all due at steps 4, 8 and 12."""
    import train

    cfg = parse_args([f"--data.data_root={data_root}", f"--train.out_dir={out}",
                      "--train.max_steps=12", "--optim.warmup_steps=2", "--eval.interval=4",
                      "--eval.sample_interval=4", "--checkpoint.interval=4", "--log.interval=4",
                      "--eval.val_steps=1", "--eval.sample_tokens=4"])
    segments, current = {}, [0]
    root = str(ROOT)

    def profile(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(root) or "/tests/" in code.co_filename:
            return
        if code.co_qualname.split(".")[-1].startswith("<"):  # comprehensions and lambdas
            return
        if code.co_name == "train_step" and code.co_filename.endswith("train.py"):
            current[0] += 1
        where = Path(code.co_filename).relative_to(ROOT).as_posix()
        segments.setdefault(current[0], set()).add((where, code.co_qualname))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train.train(cfg)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        torch.set_num_threads(threads)
    return segments


def describe(step):
    """One line per file: its functions in the step."""
    by_file = collections.defaultdict(list)
    for file, function in sorted(step):
        by_file[file].append(function)
    return [f"  {file} {len(names)}: {', '.join(names)}" for file, names in by_file.items()]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_root", default="", help="where the shakespeare dataset is prepared "
                        "(default: a temporary folder, prepared here)")
    args = parser.parse_args(argv)
    found = modules()
    top = sorted(p.name for p in ROOT.glob("*.py"))
    print(f"{len(top)} files at the top: {' '.join(top)}")
    print(f"{len(found)} modules; the longest: " + ", ".join(
        f"{p.relative_to(ROOT)} {n}" for n, p in sorted(
            ((len(p.read_text().splitlines()), p) for p in found), reverse=True)[:5]))
    long = long_functions(found)
    print(f"{len(long)} functions over {LONG} lines:")
    for lines, name in long:
        print(f"  {lines:>4}  {name}")
    with tempfile.TemporaryDirectory() as scratch:
        data_root = args.data_root
        if not data_root:
            from prepare_data import prepare_shakespeare
            data_root = os.path.join(scratch, "data")
            prepare_shakespeare(os.path.join(data_root, "shakespeare"))
        steps = steps_of_the_quick_start(data_root, os.path.join(scratch, "run"))
    # step 6 is ordinary; step 8 has everything due for the second time (the first imports the
    # sampler)
    for label, step in (("an ordinary step", steps[6]), ("a step with everything due", steps[8])):
        files = {file for file, _ in step}
        print(f"{label}: {len(step)} functions over {len(files)} files")
        print("\n".join(describe(step)))


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
