import json
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import hellaswag_eval
from conftest import ROOT, TINY, read_metrics, run_train
from hellaswag_fixture import tiny_model, write_hellaswag
from tokenizer import get_tokenizer


def brute_force(model, example):
    """The definition, one ending at a time: (prediction by summed loss, prediction by mean loss)."""
    enc = get_tokenizer()
    sums, means = [], []
    for ending in example["endings"]:
        context, ending_tokens = enc.encode(example["ctx"]), enc.encode(" " + ending)
        tokens = (context + ending_tokens)[-(model.config.block_size + 1):]
        n = min(len(ending_tokens), len(tokens) - 1)
        logits, _ = model(torch.tensor([tokens[:-1]]))
        losses = F.cross_entropy(logits[0, -n:, :50257], torch.tensor(tokens[-n:]), reduction="none")
        sums.append(losses.sum().item())
        means.append(losses.mean().item())
    return min(range(4), key=sums.__getitem__), min(range(4), key=means.__getitem__)


@pytest.mark.parametrize("block_size", [64, 16])  # 16 forces contexts to be cut from the left
def test_acc_and_acc_norm_match_a_brute_force_reference(tmp_path, block_size):
    examples = hellaswag_eval.load_examples(write_hellaswag(tmp_path / "h.jsonl"))
    model = tiny_model(block_size)
    with torch.no_grad():
        expected = [brute_force(model, ex) for ex in examples]
    for ex, (pred, pred_norm) in zip(examples, expected):
        correct, correct_norm, _ = hellaswag_eval.score_examples(model, [ex], "cpu")
        assert (correct, correct_norm) == (int(pred == ex["label"]), int(pred_norm == ex["label"]))
    result = hellaswag_eval.evaluate(model, examples, "cpu", batch_size=5)
    assert result["n"] == 12
    assert result["acc"] == sum(p == ex["label"] for ex, (p, _) in zip(examples, expected)) / 12
    assert result["acc_norm"] == sum(p == ex["label"] for ex, (_, p) in zip(examples, expected)) / 12
    assert (result["truncated"] > 0) == (block_size == 16)


def test_batched_scoring_equals_one_example_at_a_time(tmp_path):
    examples = hellaswag_eval.load_examples(write_hellaswag(tmp_path / "h.jsonl"))
    model = tiny_model()
    one_at_a_time = [hellaswag_eval.score_examples(model, [ex], "cpu") for ex in examples]
    totals = tuple(sum(column) for column in zip(*one_at_a_time))
    assert hellaswag_eval.score_examples(model, examples, "cpu", batch_size=12) == totals
    assert hellaswag_eval.score_examples(model, examples, "cpu", batch_size=5) == totals


def test_counts_sharded_over_two_gloo_ranks_equal_one_process(tmp_path):
    data = write_hellaswag(tmp_path / "h.jsonl", copies=3)  # 9 examples: the ranks get 5 and 4
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(ROOT / "tests" / "hellaswag_on_two_ranks.py"), str(data), str(out)], check=True, timeout=120)
    two = json.loads(out.read_text())
    one = hellaswag_eval.evaluate(tiny_model(), hellaswag_eval.load_examples(data), "cpu", batch_size=2)
    assert (two["n"], two["acc"], two["acc_norm"]) == (one["n"], one["acc"], one["acc_norm"])


def test_offline_without_a_cache_says_where_to_put_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(hellaswag_eval, "URL", "http://127.0.0.1:9/hellaswag_val.jsonl")  # refused at once
    with pytest.raises(hellaswag_eval.HellaSwagError, match="put it at .*hellaswag_val.jsonl, or pass --data PATH"):
        hellaswag_eval.load_examples("", cache_dir=str(tmp_path))
    assert not list(tmp_path.iterdir()) or not (tmp_path / "hellaswag_val.jsonl").exists()


def test_cached_file_is_used_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setattr(hellaswag_eval, "URL", "http://127.0.0.1:9/unreachable")
    write_hellaswag(tmp_path / "hellaswag_val.jsonl", copies=1)
    assert len(hellaswag_eval.load_examples("", cache_dir=str(tmp_path))) == 3


def test_cli_scores_a_run_folder_and_prints_json(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=2"])
    data = write_hellaswag(tmp_path / "h.jsonl")
    result = subprocess.run([sys.executable, "hellaswag_eval.py", f"--init_from={tmp_path / 'run'}", f"--data={data}",
                             "--limit=5", "--device=cpu", "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["n"] == 5 and set(line) == {"n", "acc", "acc_norm"} and 0 <= line["acc"] <= 1
    missing = subprocess.run([sys.executable, "hellaswag_eval.py", f"--init_from={tmp_path / 'run'}",
                              f"--data={tmp_path / 'nope.jsonl'}"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode != 0 and missing.stderr.startswith("error: no HellaSwag file at")


def test_training_loop_logs_hellaswag(data_root, tmp_path):
    data = write_hellaswag(tmp_path / "h.jsonl")
    out = tmp_path / "run"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=4",
                      "--eval.hellaswag_interval=2", f"--eval.hellaswag_data={data}", "--eval.hellaswag_limit=6"])
    rows = {r["step"]: r for r in read_metrics(out)}
    assert "hellaswag/acc" in rows[2] and "hellaswag/acc_norm" in rows[4] and "hellaswag/acc" not in rows[3]
    assert rows[4]["hellaswag/acc"] * 6 == pytest.approx(round(rows[4]["hellaswag/acc"] * 6))
    assert json.loads((out / "metrics_step4.json").read_text())["hellaswag/acc_norm"] == rows[4]["hellaswag/acc_norm"]


def test_a_file_that_is_not_hellaswag_is_reported_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 0}) + "\n{not json\n")
    with pytest.raises(hellaswag_eval.HellaSwagError, match="line 2 of .*bad.jsonl is not a HellaSwag example"):
        hellaswag_eval.load_examples(str(path))
