"""Behaviours of the reference documents (OLMo-core's trainer, the OLMo README) the trainer matches: a benchmark run
loads nothing, activation and parameter statistics, slow bookkeeping said, the epoch as a metric, saving what was
loaded before training, and a run notifier."""

import http.server
import json
import os
import threading

import numpy as np
import pytest
import torch

from lab.debug import activation_stats
from conftest import TINY, assert_one_sentence, read_metrics, run_in_process, run_train
from model import GPT, GPTConfig


def args(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0", *extra]


def test_no_checkpoints_neither_resumes_nor_reads_load_path(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "trained", "--train.max_steps=4"))
    fresh = run_train(args(data_root, tmp_path / "fresh", "--train.max_steps=2"))
    bench = run_train(args(data_root, tmp_path / "bench", "--train.max_steps=2", "--train.no_checkpoints=true",
                           f"--checkpoint.load_path={tmp_path / 'trained'}"))
    assert "this run loads no checkpoint and saves none" in bench.stdout and "loaded" not in bench.stdout
    assert read_metrics(tmp_path / "bench")[0]["train/loss"] == read_metrics(tmp_path / "fresh")[0]["train/loss"]
    assert not [name for name in os.listdir(tmp_path / "bench") if name.startswith("step")]
    assert fresh.returncode == 0


class OneBatch:
    """A loader of one batch that says where it is (activation_stats reads the batch and puts it back)."""

    def __init__(self, x):
        self.x, self.position = x, 0

    def next_batch(self):
        self.position += 1
        return self.x, self.x

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_activation_and_parameter_statistics_match_a_hand_computation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=8, dropout=0.1))
    x = torch.randint(0, 64, (3, 16))
    loader = OneBatch(x)
    stats = activation_stats(model, loader, torch.autocast("cpu", enabled=False))
    assert loader.position == 0 and model.training  # the batch put back, the mode restored
    with torch.no_grad():  # by hand: the blocks one after another, in eval mode (no dropout)
        hidden = model.transformer.wte(x) + model.transformer.wpe(torch.arange(16))
        for i, block in enumerate(model.transformer.h):
            block.eval()
            hidden = block(hidden)
            assert stats[f"activations/layer{i:02d}/rms"] == pytest.approx(hidden.pow(2).mean().sqrt().item(), rel=1e-6)
            assert stats[f"activations/layer{i:02d}/mean"] == pytest.approx(hidden.mean().item(), rel=1e-5, abs=1e-7)
            assert stats[f"activations/layer{i:02d}/max_abs"] == pytest.approx(hidden.abs().max().item())
            weights = torch.cat([p.flatten() for p in block.parameters()])
            assert stats[f"params/layer{i:02d}/norm"] == pytest.approx(weights.norm().item(), rel=1e-6)
    embeddings = torch.cat([model.transformer.wte.weight.flatten(), model.transformer.wpe.weight.flatten()])
    assert stats["params/embedding/norm"] == pytest.approx(embeddings.norm().item(), rel=1e-6)


def test_activation_statistics_are_logged_on_their_cadence_and_change_no_training_number(data_root, tmp_path,
                                                                                          monkeypatch):
    run_train(args(data_root, tmp_path / "on", "--train.max_steps=4", "--log.activations_interval=2"))
    rows = {r["step"]: r for r in read_metrics(tmp_path / "on")}
    assert "activations/layer01/rms" in rows[2] and "params/layer00/norm" in rows[4]
    assert not any("activations/" in key for key in rows[1]) and not any("activations/" in key for key in rows[3])
    from lab import debug  # at 0 (the default) the step does no extra work: the function is never called
    monkeypatch.setattr(debug, "activation_stats", lambda *a: pytest.fail("activation statistics at interval 0"))
    run_train(args(data_root, tmp_path / "off", "--train.max_steps=4"))
    off = read_metrics(tmp_path / "off")
    assert [r["train/loss"] for r in off] == [rows[s]["train/loss"] for s in (1, 2, 3, 4)]


def test_slow_bookkeeping_is_said_with_its_time(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=2", "--log.bookkeeping_soft_timeout=1e-9",
                            "--checkpoint.async_save=true", "--checkpoint.interval=1"))
    assert "warning: collecting the metrics of step 2 took" in result.stderr
    assert "more than log.bookkeeping_soft_timeout=1e-09 s" in result.stderr
    assert "warning: waiting for the previous checkpoint took" in result.stderr


def test_async_bookkeeping_is_on_by_default_where_a_gloo_group_exists():
    import train
    from config import parse_args

    cfg = parse_args([])
    assert cfg.log.async_bookkeeping == "auto"
    assert [train.async_bookkeeping(cfg, type("P", (), {"world_size": n})) for n in (1, 2)] == [False, True]


def test_the_epoch_is_a_metric_and_resumes_with_the_position(tmp_path):
    root = tmp_path / "data"
    (root / "tiny").mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, 50000, size=80 * 32 + 1).astype(np.uint16)  # 80 sequences of 32
    np.save(root / "tiny" / "train_000001.npy", tokens)
    np.save(root / "tiny" / "val_000000.npy", tokens[:500])
    common = TINY + [f"--data.data_root={root}", "--data.dataset=tiny", f"--train.out_dir={tmp_path / 'run'}",
                     "--train.max_steps=24", "--eval.interval=0", "--data.batch_size=4", "--model.block_size=32"]
    run_train(common + ["--train.hard_stop=12"])
    run_train(common)
    epochs = [r["data/epoch"] for r in read_metrics(tmp_path / "run")]  # 80 sequences, 4 per step: 20 steps an epoch
    assert epochs == [1] * 19 + [2] * 5 and all(isinstance(e, int) for e in epochs)  # counted from 1
    trainer = torch.load(tmp_path / "run" / "step24" / "trainer.pt", weights_only=True)
    assert trainer["data"] == {"position": 96, "epoch": 1}


def test_a_run_saves_what_it_loaded_without_training_a_step(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "source", "--train.max_steps=3"))
    result = run_train(args(data_root, tmp_path / "saved", "--train.hard_stop=0", "--checkpoint.fixed_steps=0",
                            f"--checkpoint.load_path={tmp_path / 'source'}", "--checkpoint.load_trainer_state=false"))
    assert f"loaded weights, optimizer state from {tmp_path / 'source' / 'step3'}; the run starts at step 0" \
        in result.stdout and "resumed from" not in result.stdout
    assert "train.hard_stop=0: trained nothing" in result.stdout and not read_metrics(tmp_path / "saved")
    a = torch.load(tmp_path / "source" / "step3" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "saved" / "step0" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture()
def webhook():
    """A small HTTP server on 127.0.0.1 that keeps what is posted to it."""
    posted = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", posted
    server.shutdown()


def test_the_notifier_says_when_the_run_starts_finishes_stops_and_fails(data_root, tmp_path, webhook, monkeypatch):
    url, posted = webhook
    run_train(args(data_root, tmp_path / "run", "--train.max_steps=2", f"--log.slack_webhook={url}"))
    assert [p["text"] for p in posted] == ["run: started", "run: finished at step 2"]
    posted.clear()
    monkeypatch.setenv("SLACK_WEBHOOK_URL", url)  # the environment's webhook, when the field is empty
    run_train(args(data_root, tmp_path / "stopped", "--train.max_steps=4", "--train.time_limit=1e-6"))
    assert [p["text"] for p in posted] == ["stopped: started", "stopped: stopped at the time limit "
                                           "(train.time_limit) after step 1; its checkpoint is saved"]
    posted.clear()
    run_train(args(data_root, tmp_path / "nan", "--train.max_steps=2", "--optim.lr=1e30", "--optim.grad_clip=0",
                   f"--log.slack_webhook={url}"), check=False)
    assert posted[0]["text"] == "nan: started" and posted[-1]["text"].startswith("nan: failed: train/")


def test_a_notifier_that_cannot_post_is_a_warning_and_the_run_goes_on(data_root, tmp_path):
    result = run_in_process(args(data_root, tmp_path / "run", "--train.max_steps=2",
                                 "--log.slack_webhook=http://127.0.0.1:9/nobody"))
    assert result.returncode == 0 and "warning: the run notifier could not post" in result.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


@pytest.fixture(scope="module")
def char_root(tmp_path_factory):
    """The plays as characters, `python prepare_data.py shakespeare-char`, prepared once."""
    import prepare_data
    root = tmp_path_factory.mktemp("char")
    result = run_in_process(["shakespeare-char", "--out_dir", str(root / "shakespeare-char")], prepare_data.main)
    assert "as 82 characters (model.vocab_size=82)" in result.stdout, result.stdout + result.stderr
    return root


CHAR_TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
             "--data.batch_size=4", "--train.total_batch_size=128", "--optim.warmup_steps=2", "--eval.val_steps=2",
             "--eval.interval=0"]


def test_nanogpts_first_run_trains_on_characters_and_samples_them(char_root, tmp_path):
    folder = char_root / "shakespeare-char"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["vocab_size"] == len(meta["vocab"]) == 82 and "R" in meta["vocab"] and "\n" in meta["vocab"]
    assert int(np.load(folder / "train_000001.npy").max()) < 82  # one id per character
    out = tmp_path / "run"
    run_train(["config/shakespeare_char.py", *CHAR_TINY, f"--data.data_root={char_root}", f"--train.out_dir={out}",
               "--train.max_steps=4", "--eval.sample_interval=4", "--eval.sample_tokens=20",
               "--eval.sample_prompt=ROMEO:"])
    samples = (out / "samples.txt").read_text()
    assert samples.count("ROMEO:") == 2 and all(c in meta["vocab"] + "-" for c in samples.replace("--- step", ""))
    import sample
    printed = run_in_process([f"--init_from={out}", "--prompt=JULIET:", "--max_new_tokens=10", "--num_samples=1",
                              "--device=cpu"], sample.main)
    assert printed.returncode == 0 and printed.stdout.startswith("--- sample 0\nJULIET:")
    assert len(printed.stdout.split("JULIET:")[1].rstrip("\n")) == 10  # ten characters: one token each


def test_the_evaluations_that_need_gpt2s_tokenizer_say_so_for_a_character_model(char_root, tmp_path):
    import hellaswag_eval
    out = tmp_path / "run"
    run_train(["config/shakespeare_char.py", *CHAR_TINY, f"--data.data_root={char_root}", f"--train.out_dir={out}",
               "--train.max_steps=2", "--eval.sample_interval=0"])
    assert_one_sentence(run_in_process([f"--init_from={out}"], hellaswag_eval.main),
                        "scored with GPT-2's tokenizer", "a vocabulary of 82 tokens")
    refused = run_train(["config/shakespeare_char.py", *CHAR_TINY, f"--data.data_root={char_root}",
                         f"--train.out_dir={tmp_path / 'tasks'}", "--eval.tasks=hellaswag", "--eval.tasks_interval=1"],
                        check=False)
    assert_one_sentence(refused, "eval.tasks are scored with GPT-2's tokenizer", "character-level")
    assert not (tmp_path / "tasks").exists()
