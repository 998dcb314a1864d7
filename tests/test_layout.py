"""The house a reader finds: the core at the top, each optional feature one folder down (lab/) and
imported on the line that tests its setting, layers that point one way, short lines, and a step of
the quick start that meets no optional feature. Structure only: the counts (files, functions a step
runs, long functions) are signals a reader weighs, printed by tools/house_counts.py and kept in
docs/measurements.md, never asserted here."""

import ast
import re
import subprocess

from conftest import ROOT
from tools.house_counts import steps_of_the_quick_start

# What the layout issue fixes: the design card's files, the core every run reads, the commands.
TOP_LEVEL = {"train.py", "model.py", "config.py", "checkpoint.py", "checkpoint_folder.py",
             "devices.py", "hellaswag_eval.py", "ladder.py", "data.py", "optimizer.py", "metrics.py",
             "plan.py", "run_dir.py", "sample.py", "prepare_data.py"}
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
    """The modules that reach themselves through `edges`."""
    def reaches_itself(start):
        seen, waiting = set(), list(edges.get(start, ()))
        while waiting:
            module = waiting.pop()
            if module == start:
                return True
            if module not in seen:
                seen.add(module)
                waiting.extend(edges.get(module, ()))
        return False
    return [m for m in edges if reaches_itself(m)]


def is_core(module):
    return "." not in module or module.startswith("configurator.")


def test_the_top_level_holds_the_core_and_the_commands():
    top = {p.name for p in ROOT.glob("*.py")}
    assert top == TOP_LEVEL, sorted(top ^ TOP_LEVEL)


def test_the_core_imports_the_optional_folder_only_inside_functions():
    at_module_level = [f"{p.name} imports {name}" for p in ROOT.glob("*.py") for name, inside in imports(p)
                       if name.startswith("lab") and not inside]
    assert at_module_level == [], at_module_level


def test_no_module_imports_one_that_imports_it_back():
    """Counting every import, those inside functions too (as a reader must): no module reaches, at
    any depth, a module that reaches it back. lab/ builds on the core, and the core reaches lab/
    only where a setting is tested, so neither side needs the other back."""
    every_import = graph(lambda path, name, inside: True)
    assert cycles(every_import) == [], cycles(every_import)


def test_models_file_imports_nothing_of_the_project():
    """model.py is a leaf, as nanoGPT's (it imports only torch): a reader of the model reads one
    file."""
    assert imports(ROOT / "model.py") == []


def test_layers_point_one_way():
    """tools/ and exercises/ import the core; the core never imports them."""
    reaching_up = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in modules() for node in ast.walk(ast.parse(
        p.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
        (n or "").split(".")[0] in ("tools", "exercises") for n in
        ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]))]
    assert reaching_up == [], reaching_up


def test_lines_of_the_modules_are_at_most_100_characters():
    """The core, configurator/ and lab/."""
    long = [f"{p.relative_to(ROOT)}:{number}" for p in modules()
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


def test_the_quick_starts_steps_meet_no_optional_feature(data_root, tmp_path):
    """The functions an ordinary step runs (and one where evaluation, the console line, a checkpoint
    and samples are all due) are the core's: a reader of the quick start's step never meets lab/."""
    steps = steps_of_the_quick_start(data_root, tmp_path / "run")
    for step in (steps[6], steps[8]):
        optional = sorted(function for function in step if not is_core(function[0][:-3].replace("/", ".")))
        assert optional == [], optional
