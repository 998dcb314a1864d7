"""The house a reader finds: the core at the top, each optional feature one folder down (lab/) and
imported on the line that tests its setting, layers that point one way, short lines, and a step of
the quick start that visits few functions and files."""

import ast
import collections
import contextlib
import io
import re
import subprocess
import sys
import threading
from pathlib import Path

import torch

from config import parse_args
from conftest import ROOT

# What the layout issue fixes: the design card's files, the core every run reads, the commands.
TOP_LEVEL = {"train.py", "model.py", "config.py", "checkpoint.py", "hellaswag_eval.py", "ladder.py",
             "data.py", "optimizer.py", "metrics.py", "plan.py", "run_dir.py", "sample.py",
             "prepare_data.py"}
NOT_MODULES = ("tests", "exercises", "tools", "config", ".git", ".bench", "data", "out")


def tracked_python_files():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [ROOT / name for name in listed] or [p for p in ROOT.rglob("*.py") if ".bench" not in p.parts]


def modules():
    """The project's modules: every .py file outside tests/, exercises/, tools/ and config/."""
    return [p for p in tracked_python_files() if p.relative_to(ROOT).parts[0] not in NOT_MODULES]


def imports(path):
    """[(module imported, inside a function?)] of `path`: `import a.b`, `from a.b import c` as a.b
    and a.b.c (c may be a module), each project module by its dotted name."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, inside) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.module, inside))
                found.extend((f"{child.module}.{alias.name}", inside) for alias in child.names)
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in modules()}
    return [(name, inside) for name, inside in found if name in names]


def graph(keep):
    """{module: {module it imports}} over the project's modules, for the imports `keep` accepts."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts):
            {name for name, inside in imports(p) if keep(p, name, inside)} for p in modules()}


def cycles(edges):
    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in edges.get(start, ()))
    return [m for m in edges if reaches(m, m)]


def is_core(module):
    return "." not in module or module.startswith("configurator.")


def test_the_top_level_holds_the_core_and_the_commands_at_most_13_files():
    top = {p.name for p in ROOT.glob("*.py")}
    assert top == TOP_LEVEL and len(top) <= 13, sorted(top ^ TOP_LEVEL)


def test_at_most_30_modules_none_over_800_lines():
    found = modules()
    assert len(found) <= 30, [str(p.relative_to(ROOT)) for p in found]
    long = [f"{p.relative_to(ROOT)}: {n}" for p in found if (n := len(p.read_text().splitlines())) > 800]
    assert long == [], long


def test_the_core_imports_the_optional_folder_only_inside_functions():
    at_module_level = [f"{p.name} imports {name}" for p in ROOT.glob("*.py") for name, inside in imports(p)
                       if name.startswith("lab") and not inside]
    assert at_module_level == [], at_module_level


def test_layers_point_one_way():
    """The core imports the core without a cycle, lazy imports included; lab/ builds on the core (at
    module level or not) without a cycle of its own; the core reaches lab/ only on the line that tests a
    setting, inside a function: the one arrow allowed to point up. tools/ and exercises/ import the
    core; the core never imports them."""
    core = graph(lambda path, name, inside: is_core(".".join(path.relative_to(ROOT).with_suffix("").parts))
                 and is_core(name))
    assert cycles(core) == []
    downward = graph(lambda path, name, inside: not (is_core(".".join(
        path.relative_to(ROOT).with_suffix("").parts)) and not is_core(name)))
    assert cycles(downward) == []
    reaching_up = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in modules() for node in ast.walk(ast.parse(
        p.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
        (n or "").split(".")[0] in ("tools", "exercises") for n in
        ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]))]
    assert reaching_up == [], reaching_up


def test_lines_of_the_top_level_modules_are_at_most_100_characters():
    long = [f"{p.name}:{number}" for p in ROOT.glob("*.py")
            for number, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 100]
    assert long == [], long


def test_no_line_of_the_project_is_over_120_characters():
    long = [f"{p.relative_to(ROOT)}:{number}" for p in tracked_python_files()
            for number, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert long == [], long


def test_no_issue_numbers_or_history_in_code_tests_or_config_files():
    """History lives in docs/measurements.md and the commit messages."""
    pattern = re.compile(r"\b[Ii]ssue \d+|\(was \d|\bwas \d[\d,.]* (?:s|ms|lines|files|GB)\b|\b20\d\d-\d\d-\d\d\b")
    found = [f"{p.relative_to(ROOT)}:{number}" for p in tracked_python_files()
             for number, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], found


def test_no_project_file_inspects_autograds_graph():
    """The loss a reader meets is plain PyTorch: no autograd node class names, no walk of the graph."""
    words = ("Backward0", "next_functions", ".grad_fn")
    found = [f"{p.relative_to(ROOT)}: {w}" for p in modules() for w in words if w in p.read_text()]
    assert found == [], found


def test_models_forward_computes_its_loss_with_cross_entropy():
    tree = ast.parse((ROOT / "model.py").read_text())
    gpt = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPT")
    forward = next(n for n in gpt.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert "F.cross_entropy(" in ast.unparse(forward)


def test_the_loop_calls_train_step_from_one_line():
    def name(call):
        return getattr(call.func, "id", getattr(call.func, "attr", None))

    calls = [node.lineno for p in modules() for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Call) and name(node) == "train_step"]
    assert len(calls) == 1, calls
    functions = [n for n in ast.parse((ROOT / "train.py").read_text()).body if isinstance(n, ast.FunctionDef)]
    names = [f.name for f in functions]
    assert names[names.index("train") + 1] == "train_step"  # the step is the function right below the loop
    step = ast.unparse(functions[names.index("train_step")])
    assert all(call in step for call in ("model(x, y)", ".backward()", "clip_grad_norm_", "optimizer.step()"))


def steps_of_the_quick_start(data_root, out):
    """{step: {(file, function)}}: the project's functions run from the call of train_step at a step to
    the next one, every thread included, in the quick start's own config (config/shakespeare.py: Muon,
    GPT-2's vocabulary), 12 steps in which evaluation, the console line, a checkpoint and samples are all
    due at steps 4, 8 and 12."""
    import train

    cfg = parse_args([f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=12",
                      "--optim.warmup_steps=2", "--eval.interval=4", "--eval.sample_interval=4",
                      "--checkpoint.interval=4", "--log.interval=4", "--eval.val_steps=1",
                      "--eval.sample_tokens=4"])
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
        segments.setdefault(current[0], set()).add((Path(code.co_filename).relative_to(ROOT).as_posix(),
                                                     code.co_qualname))

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


def test_the_quick_starts_step_visits_few_functions_and_files(data_root, tmp_path):
    """An ordinary step at most 21 project functions over 6 files (nanoGPT: 7 over 2; nanochat about
    15-20 over 5-6; the fused loss asks loss_slice_rows for its slices' size); a step where evaluation, the
    console line, a checkpoint and samples are all due at most 46 over 8 (its second time: the first imports the
    sampler)."""
    steps = steps_of_the_quick_start(data_root, tmp_path / "run")
    ordinary, all_due = steps[6], steps[8]
    files = collections.Counter(file for file, _ in ordinary)
    assert len(ordinary) <= 21 and len(files) <= 6, sorted(ordinary)
    files = collections.Counter(file for file, _ in all_due)
    assert len(all_due) <= 46 and len(files) <= 8, sorted(all_due)


def test_the_readme_is_at_most_250_lines():
    """The quick start and the map; the detail lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
