"""When a run goes wrong: where two runs part, how two checkpoints differ, where a hung job waits.

In the loop (train.py calls these; every rank also registers a stack dump,
run_dir.register_stack_dump):
- `trace_forward` (debug.trace_steps): at the chosen steps, rank 0 runs the step's first micro-batch
  through the model once more with forward hooks on every submodule, and saves each module's inputs
  and outputs to `<out_dir>/traces/step<N>/rank0.pt` with a small `index.json` (OLMo's
  `module_outputs_save_steps`). The extra forward uses the weights of that step (before its update),
  runs in no-grad mode and forks the RNG, so the training itself is unchanged; other steps pay
  nothing.
- `make_deterministic` (train.deterministic): deterministic kernels, for hunting divergences.
- `activation_stats` (log.activations_interval, OLMo-core's GAP monitor): each block's activations
  and each layer's parameter norm, from one extra forward pass of the step's first micro-batch.

From the command line:

    python lab/debug.py compare-traces RUN_A RUN_B [--step N] [--atol 0] [--rtol 0]
    python lab/debug.py compare-state CKPT_A CKPT_B [--top 20] [--model_module FILE]
    python lab/debug.py stacks RUN [--wait 10]

compare-traces answers "where did these two runs start to differ?": per traced step, the modules in
the order they ran, the largest absolute and relative difference of their outputs, and the first
module past the tolerance or with NaN/Inf where the other run has none (exit status 1 when there is
one, as `diff`). compare-state lists the weights and AdamW moments that differ most between two
checkpoints, those with NaN/Inf in one only first. In both, NaN/Inf at the same places in both runs
are no difference. stacks signals a running job's processes, only those proven still to be its ranks
(a rank killed with -9 leaves its pid file, and the pid may go to another process), and prints every
rank's stack, then their frames side by side and where each rank is, so the rank stuck elsewhere
stands out.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import time

import torch

if __name__ == "__main__":  # `python lab/debug.py`: the project's modules are one folder up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import run_dir as run_folder  # noqa: E402 - after the line above
from checkpoint import gpt_class, to_cpu
from config import UserError, config_from_dict, run_command
from optimizer import build_optimizer

TRACES = "traces"
# this project's folder: its frames are the telling ones
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DebugError(UserError):
    """A debug.py argument points at nothing usable; the message says what to give."""


# ------------------------------------------------------------------------------------ in the loop


def make_deterministic():
    """The settings `torch.use_deterministic_algorithms` needs. On GPUs this costs speed
    (docs/measurements.md); an op with no deterministic version raises an error naming it instead of
    running."""
    # deterministic cuBLAS (before its first use)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def tensors_of(value):
    """The tensors in a module's inputs or output (a tensor, a tuple, None), copied to the CPU."""
    items = value if isinstance(value, (tuple, list)) else [value]
    return to_cpu([v for v in items if isinstance(v, torch.Tensor)])


@torch.no_grad()
def trace_forward(model, loader, autocast, out_dir, step, sequences=0):
    """Save every submodule's inputs and outputs for the first micro-batch of `step` (see the top),
    or for its first `sequences` sequences (a GPT's outputs for one sequence do not depend on the
    others)."""
    state = loader.state_dict()
    x, y = loader.next_batch()  # the batch the step is about to train on ...
    loader.load_state_dict(state)  # ... left in place for it
    if sequences:
        x, y = x[:sequences], y[:sequences]
    calls = []
    hooks = [module.register_forward_hook(
        lambda module, inputs, output, name=name or "model": calls.append(
            {"name": name, "inputs": tensors_of(inputs), "output": tensors_of(output)}))
        for name, module in model.named_modules()]
    try:
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), autocast:
            model(x, y)
    finally:
        for hook in hooks:
            hook.remove()
    size = sum(t.numel() * t.element_size() for c in calls for t in c["inputs"] + c["output"])
    free = shutil.disk_usage(out_dir).free
    if size > free // 2:  # a trace must never fill the disk the checkpoints need
        print(f"warning: the trace of step {step} would take {size / 1e9:.1f} GB and {out_dir} has "
              f"{free / 1e9:.1f} GB free, so it is not saved; lower debug.trace_sequences.",
              file=sys.stderr, flush=True)
        return
    folder = os.path.join(out_dir, TRACES, f"step{step}")
    os.makedirs(folder, exist_ok=True)
    torch.save({"step": step, "calls": calls}, os.path.join(folder, "rank0.pt.tmp"))
    os.replace(os.path.join(folder, "rank0.pt.tmp"), os.path.join(folder, "rank0.pt"))
    index = [{"name": c["name"], "inputs": [list(t.shape) for t in c["inputs"]],
              "output": [list(t.shape) for t in c["output"]]} for c in calls]
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump({"step": step, "calls": index}, f, indent=1)


@torch.no_grad()
def activation_stats(raw_model, loader, autocast):
    """log.activations_interval: each block's output on the step's first micro-batch
    (activations/layerNN/rms, mean, max_abs), from forward hooks on one extra forward pass in eval
    mode (no dropout, no random numbers drawn: the training is unchanged), and each layer's
    parameter norm (params/layerNN/norm, params/embedding/norm). The batch is read and put back;
    every value stays on the device (no sync)."""
    position = loader.state_dict()
    x, _ = loader.next_batch()
    loader.load_state_dict(position)
    stats = {}

    def record(i):
        def hook(module, inputs, output):
            out = output.detach().float()
            name = f"activations/layer{i:02d}"
            stats.update({f"{name}/rms": out.pow(2).mean().sqrt(), f"{name}/mean": out.mean(),
                          f"{name}/max_abs": out.abs().amax()})
        return hook

    hooks = [block.register_forward_hook(record(i)) for i, block in enumerate(raw_model.blocks)]
    was_training = raw_model.training
    raw_model.eval()
    try:
        with autocast:
            raw_model(x)
    finally:
        raw_model.train(was_training)
        for hook in hooks:
            hook.remove()
    stats["params/embedding/norm"] = param_norm(raw_model.param_groups()["embedding"])
    for i, block in enumerate(raw_model.blocks):
        stats[f"params/layer{i:02d}/norm"] = param_norm(block.parameters())
    return stats


def param_norm(params):
    """The norm of `params` taken together, on the device."""
    return torch.linalg.vector_norm(torch.stack([p.detach().float().norm() for p in params]))



# --------------------------------------------------------------------------------- compare-traces


def load_traces(run_dir):
    """{step: [call, ...]} of a run's traces."""
    folder = os.path.join(run_dir, TRACES)
    if not os.path.isdir(folder):
        raise DebugError(f"{run_dir} has no {TRACES}/ folder; train it with "
                         "--debug.trace_steps=... to save traces.")
    traces = {}
    for name in os.listdir(folder):
        path = os.path.join(folder, name, "rank0.pt")
        if name.startswith("step") and os.path.exists(path):
            traces[int(name[4:])] = torch.load(path, map_location="cpu", weights_only=True)["calls"]
    return traces


def apart(a, b):
    """Why `a` and `b` cannot be compared value by value, in words, or "" when they can: other
    shapes, or NaN/Inf at other places. NaN compares false with everything, so a plain max |a - b| >
    atol would call a run gone NaN equal to any other; NaN and Inf at the same places in both are no
    difference."""
    if a.shape != b.shape:
        return f"shapes {list(a.shape)} and {list(b.shape)}"
    for name, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        in_a, in_b = test(a), test(b)
        if not torch.equal(in_a, in_b):
            return (f"{name} at different places: {int(in_a.sum())} and {int(in_b.sum())} of "
                    f"{a.numel()} values")
    return ""


def finite_values(a, b):
    """The values of `a` and `b` (compared by `apart` first) where both are finite, in float64."""
    finite = torch.isfinite(a)
    return a[finite].double(), b[finite].double()


def tensor_difference(a, b):
    """(max |a - b|, max |b|, why apart) over the finite values; an infinite difference when
    `apart`."""
    why = apart(a, b)
    if why:
        return float("inf"), 0.0, why
    a, b = finite_values(a, b)
    if not a.numel():
        return 0.0, 0.0, ""
    return (a - b).abs().max().item(), b.abs().max().item(), ""


def relative(largest, scale):
    return largest / scale if scale else (0.0 if largest == 0 else float("inf"))


def compare_calls(calls_a, calls_b, atol, rtol):
    """[(name, max abs, max rel, parted, why apart)] per module call, in execution order. A call
    that cannot be compared value by value (another module, other outputs, NaN/Inf at other places,
    a call one run did not make) parts whatever the tolerances."""
    rows = []
    for a, b in zip(calls_a, calls_b):
        diffs = [tensor_difference(x, y) for x,
                 y in zip(a["output"], b["output"])] or [(0.0, 0.0, "")]
        whys = [why for _, _, why in diffs if why]
        if len(a["output"]) != len(b["output"]):
            whys.insert(0, f"{len(a['output'])} and {len(b['output'])} outputs")
        if a["name"] != b["name"]:
            whys.insert(0, f"the other run calls {b['name']} here")
        largest, scale = max(d for d, _, _ in diffs), max(s for _, s, _ in diffs)
        rows.append((a["name"], largest, max(relative(d, s) for d, s, _ in diffs),
                     bool(whys) or largest > atol + rtol * scale, whys[0] if whys else ""))
    if len(calls_a) != len(calls_b):
        extra = max(calls_a, calls_b, key=len)[len(rows)]
        rows.append(
            (extra["name"], float("inf"), float("inf"), True, f"{len(calls_a)} and {len(calls_b)} "
                                                              "module calls")
        )
    return rows


def compare_traces(run_a, run_b, step=None, atol=0.0, rtol=0.0):
    """Print the comparison; returns (step, module) of the first parting, or None."""
    # written so that NaN fails too: it would let every difference pass
    if not (atol >= 0 and rtol >= 0):
        raise DebugError(f"--atol and --rtol must be numbers of 0 or more (got {atol} and {rtol}); "
                         "give tolerances such as --atol=1e-6.")
    traces_a, traces_b = load_traces(run_a), load_traces(run_b)
    steps = sorted(set(traces_a) & set(traces_b))
    if step is not None:
        steps = [s for s in steps if s == step]
    if not steps:
        raise DebugError(f"{run_a} and {run_b} have no traced step in common"
                         f"{'' if step is None else f' at step {step}'} (they have "
                         f"{sorted(traces_a)} and {sorted(traces_b)}); trace the same "
                         "--debug.trace_steps in both.")
    first = None
    for s in steps:
        a, b = traces_a[s], traces_b[s]
        same_tokens = all(torch.equal(x, y) for x, y in zip(a[0]["inputs"], b[0]["inputs"]))
        differ = "" if same_tokens else "; the input tokens differ (different data)"
        print(f"step {s}: {len(a)} module calls{differ}")
        print(f"  {'module':40s} {'max abs diff':>14s} {'max rel diff':>14s}")
        for name, largest, relative, parted, why in compare_calls(a, b, atol, rtol):
            here = "  <- parts here" if parted and first is None else ""
            print(f"  {name:40s} {largest:14.3e} {relative:14.3e}{here}"
                  f"{f'  ({why})' if why else ''}")
            if parted and first is None:
                first = (s, name, why)
    if first:
        why = first[2] or f"beyond atol={atol}, rtol={rtol}"
        print(f"the runs first part at step {first[0]} in {first[1]} ({why})")
    else:
        print(f"no module parts beyond atol={atol}, rtol={rtol} at step(s) "
              f"{', '.join(map(str, steps))}")
    return first[:2] if first else None


# ---------------------------------------------------------------------------------- compare-state


def named_state(path, model_module="model"):
    """{name: tensor} of a checkpoint's weights and AdamW moments (`optim/<param>/exp_avg`, ...);
    the optimizer's parameters are named by the GPT of `model_module` (--model_module: a file the
    checkpoint names is never imported)."""
    from checkpoint import (SHARDED, check_named_module, read_file, read_trainer_state,
                            resolve_checkpoint)

    if not os.path.isdir(path):
        raise DebugError(f"{path} is not a folder; give a run folder or a step<N> checkpoint "
                         "folder.")
    path = resolve_checkpoint(path)
    if os.path.isdir(os.path.join(path, SHARDED)):  # an FSDP run's pieces, put together (fsdp.py)
        from lab.fsdp import read_tensors

        state = read_tensors(os.path.join(path, SHARDED))
        for name, moments in read_tensors(os.path.join(path, SHARDED), "optim.state.").items():
            param, key = name.rsplit(".", 1)  # the moments are stored by parameter name already
            if moments.dim() > 0:
                state[f"optim/{param}/{key}"] = moments
        return path, state
    state = dict(read_file(path, "model.pt"))
    trainer = read_trainer_state(path)
    optim = read_file(path, "optim.pt")
    # The optimizer numbers parameters in the order of its groups: rebuild them to name the moments.
    cfg = config_from_dict(trainer["config"])
    check_named_module(cfg.train.model_module, model_module, path, "--model_module")
    try:
        # the run's own class, as the user named it: its parameters, in its order
        with torch.device("meta"):
            model = gpt_class(model_module)(cfg.model)
    except ValueError as error:  # a file that is gone, or lies inside a checkpoint
        raise DebugError(f"--model_module: {error}") from None
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg.optim)
    # MuonAdamW: both
    parts = optimizer.optimizers if hasattr(optimizer, "optimizers") else {"": optimizer}
    for part_name, part in parts.items():
        ordered = [names[id(p)] for g in part.param_groups for p in g["params"]]
        saved = optim[part_name] if part_name else optim
        sizes = [len(g["params"]) for g in part.param_groups]
        if [len(g["params"]) for g in saved["param_groups"]] != sizes:
            raise DebugError(f"{path} holds optimizer state grouped otherwise than this code "
                             "groups the model's parameters (the model code changed since); "
                             "compare checkpoints of one code.")
        for index, moments in saved["state"].items():
            for key, value in moments.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[f"optim/{ordered[int(index)]}/{key}"] = value
    return path, state


def compare_state(path_a, path_b, top=20, model_module="model"):
    """Print the tensors that differ, the most different (relative norm) first; returns how many."""
    # 0 would print an empty table, and a negative count would slice the list from its end
    if top < 1:
        raise DebugError(f"--top={top} lists no tensor; give --top=1 or more.")
    path_a, a = named_state(path_a, model_module)
    path_b, b = named_state(path_b, model_module)
    only = sorted(set(a) ^ set(b))
    rows = []
    for name in sorted(set(a) & set(b)):
        why = apart(a[name], b[name])
        if why:  # NaN or Inf in one checkpoint only: the most different of all, listed first
            rows.append((name, float("inf"), float("inf"), why))
            continue
        x, y = finite_values(a[name], b[name])
        if not torch.equal(x, y):
            diff, norm = x - y, x.norm().item()
            rows.append((name, diff.abs().max().item(),
                         diff.norm().item() / norm if norm else float("inf"), ""))
    if not rows and not only:
        print(f"identical: all {len(a)} tensors (weights and AdamW moments) of {path_a} and "
              f"{path_b} are equal")
        return 0
    rows.sort(key=lambda r: -r[2])
    print(f"{len(rows)} of {len(set(a) & set(b))} tensors differ between {path_a} and {path_b}, "
          "most different first:")
    print(f"  {'tensor':50s} {'max abs diff':>14s} {'rel norm diff':>14s}")
    for name, largest, relative, why in rows[:top]:
        print(f"  {name:50s} {largest:14.3e} {relative:14.3e}{f'  ({why})' if why else ''}")
    if len(rows) > top:
        print(f"  ... and {len(rows) - top} more (--top to see them)")
    if only:
        print(f"in one checkpoint only: {', '.join(only)}")
    return len(rows) + len(only)


# ----------------------------------------------------------------------------------------- stacks


def main_thread_frames(dump):
    """The main thread's frames in a faulthandler dump, innermost first, as "file.py:line in
    function" (the main thread is the one whose outermost frame is a script's `<module>`)."""
    threads = [[line.strip() for line in block.splitlines() if line.strip().startswith("File")]
               for block in dump.split("\n\n")]
    threads = [frames for frames in threads if frames]
    frames = next((t for t in threads if t[-1].endswith("in <module>")),
                  threads[0] if threads else [])
    return [
        (f'"{HERE}{os.sep}' in f,
         f.replace('File "', "").replace('", line ', ":").split(os.sep)[-1]) for f in frames
    ]


def where(frames):
    """The innermost frame, and the innermost one in this project's files when that is another."""
    if not frames:
        return "(no frame)"
    ours = next((text for is_ours, text in frames if is_ours), None)
    return frames[0][1] if ours in (None, frames[0][1]) else f"{frames[0][1]}  <- {ours}"


def side_by_side(frames_by_rank, depth=12):
    """The project's frames of every rank's main thread in columns, outermost at the top, so the
    rank whose stack is not like the others shows at a glance."""
    columns = {rank: [text for is_ours, text in frames if is_ours][::-1][:depth]
               for rank, frames in frames_by_rank.items()}
    width = max(24, min(44, 176 // max(1, len(columns))))
    print(" | ".join(f"rank {rank}".ljust(width) for rank in columns).rstrip())
    for row in range(max(map(len, columns.values()), default=0)):
        print(" | ".join((cells[row] if row < len(cells) else "")[:width].ljust(width)
                         for cells in columns.values()).rstrip())


def verified_rank(path, here):
    """(rank info, "") when the pid file at `path` names a process of this host that is still the
    rank that wrote it, else (info or None, why it is not signalled)."""
    try:
        with open(path) as f:
            info = json.load(f)
        rank, pid, host = info["rank"], info["pid"], info["host"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"{path} is unreadable ({type(error).__name__}); not signalled"
    if host != here:
        return info, ""
    if not os.path.isdir(run_folder.PROC):
        return info, (f"rank {rank}: pid {pid} cannot be proven to be this run's rank without "
                      f"{run_folder.PROC}; not signalled (use `py-spy dump --pid {pid}` if it is)")
    started = run_folder.process_start_time(pid)
    if started is None:
        return info, f"rank {rank}: stale pid file, pid {pid} has ended; not signalled"
    if started != info.get("start_time"):  # None: a file from before start times were recorded
        return info, f"rank {rank}: stale pid file, pid {pid} is now another process; not signalled"
    return info, ""


def collect_stacks(run_dir, wait=10.0):
    """{rank: dump} of every rank of the run started on this host that answers SIGUSR1, and the
    ranks that were asked and did not answer. Only a process proven to be the rank is signalled (see
    register_stack_dump); each pid file that is not is reported in one line."""
    folder = os.path.join(run_dir, run_folder.STACKS)
    pid_files = []
    if os.path.isdir(folder):
        pid_files = sorted(f for f in os.listdir(folder) if f.endswith(".pid"))
    if not pid_files:
        raise DebugError(f"no running training has registered in {folder}; give the train.out_dir "
                         "of a run that is running now (or use `py-spy dump --pid PID`).")
    here, asked, elsewhere = socket.gethostname(), {}, []
    for name in pid_files:
        info, why_not = verified_rank(os.path.join(folder, name), here)
        if why_not:
            print(why_not)
        elif info["host"] != here:
            elsewhere.append(f"rank {info['rank']} on {info['host']}")
        else:
            text_path = os.path.join(folder, f"rank{info['rank']}.txt")
            open(text_path, "w").close()  # empty it: the new dump lands at its start
            try:
                # proven this rank a moment ago: no pid is reused that fast
                os.kill(info["pid"], signal.SIGUSR1)
                asked[info["rank"]] = text_path
            except ProcessLookupError:  # it ended since
                print(f"rank {info['rank']}: pid {info['pid']} ended before it could be signalled")
    if elsewhere:
        print(f"on other hosts (run this command there too; the files land in {folder}): "
              f"{', '.join(elsewhere)}")
    elif not asked:
        raise DebugError(f"no rank registered in {folder} is running now (see above); give the "
                         "train.out_dir of a run that is running now.")
    dumps, sizes, deadline = {}, {}, time.monotonic() + wait
    while len(dumps) < len(asked) and time.monotonic() < deadline:
        time.sleep(0.2)
        for rank, path in asked.items():
            size = os.path.getsize(path)
            # written, and no longer growing
            if rank not in dumps and size and sizes.get(rank) == size:
                dumps[rank] = open(path).read()
            sizes[rank] = size
    return dumps, sorted(set(asked) - set(dumps))


def show_stacks(run_dir, wait=10.0):
    dumps, silent = collect_stacks(run_dir, wait)
    for rank in sorted(dumps):
        print(f"==================== rank {rank}\n{dumps[rank].rstrip()}")
    if dumps:
        frames = {rank: main_thread_frames(dumps[rank]) for rank in sorted(dumps)}
        print("==================== side by side (main thread, this project's frames, outermost "
              "first)")
        side_by_side(frames)
        places = {rank: where(f) for rank, f in frames.items()}
        common = max(set(places.values()), key=list(places.values()).count)
        print("==================== where each rank is (main thread, innermost frame)")
        for rank, place in places.items():
            print(f"rank {rank}: "
                  f"{place}{'' if place == common else '   <- not where the others are'}")
    if silent:
        print(f"no answer within {wait:g} s from rank(s) {', '.join(map(str, silent))}")
    return dumps


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("compare-traces", help="where two runs' module outputs start to differ")
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--step", type=int, default=None, help="only this traced step")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (0: any difference "
                                                           "counts)")
    p.add_argument("--rtol", type=float, default=0.0, help="tolerance relative to the largest "
                                                           "output value")
    p = commands.add_parser("compare-state", help="per-tensor differences of two checkpoints")
    p.add_argument("ckpt_a")
    p.add_argument("ckpt_b")
    p.add_argument("--top", type=int, default=20, help="tensors listed")
    p.add_argument("--model_module", default="model", help="the .py file of the GPT the runs "
                                                           "trained with")
    p = commands.add_parser("stacks", help="every rank's stacks of a running (or hung) training")
    p.add_argument("run")
    p.add_argument("--wait", type=float, default=10.0, help="seconds to wait for the dumps")
    args = parser.parse_args(argv)
    if args.command == "compare-traces":
        return 1 if compare_traces(args.run_a, args.run_b, args.step, args.atol, args.rtol) else 0
    if args.command == "compare-state":
        return 1 if compare_state(args.ckpt_a, args.ckpt_b, args.top, args.model_module) else 0
    return 0 if show_stacks(args.run, args.wait) else 1


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
