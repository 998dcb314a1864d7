"""Resuming an edited model: a run saved before the model gained a field, or before its code changed.

A fork adds a field to GPTConfig whose default is the model as it was (`n_kv_head: int | None = None`), so the
runs saved before it resume at that default; the fork's check across fields is declared beside them and refuses a
run in one sentence before anything is written. A fork that changes what the model computes but no weight
(QK-norm) resumes an old checkpoint, and says so in one line naming the file that changed.
"""

import os

import pytest

from conftest import TINY, assert_one_sentence, run_train
from test_forks import STEPS, fork_of_the_project, make_edits, metrics, run

# A fork's new fields, as a researcher adds grouped-query attention's and QK-norm's: each default is the model as
# it was (as many key/value heads as heads; no norm), and the check across fields sits beside the one GPTConfig has.
NEW_FIELDS = [
    ("model.py", "    bias: bool = field(default=True, metadata={\"role\": \"identity\", \"ladder\": False})\n",
     "    bias: bool = field(default=True, metadata={\"role\": \"identity\", \"ladder\": False})\n"
     "    # key/value heads (grouped-query attention); None: one per head, as GPT-2\n"
     "    n_kv_head: int | None = field(default=None, metadata={\"role\": \"identity\", \"ladder\": False, "
     "\"check\": \"at least 1\"})\n"
     "    # RMSNorm on queries and keys (QK-norm); False: none, as GPT-2\n"
     "    qk_norm: bool = field(default=False, metadata={\"role\": \"identity\", \"ladder\": False})\n"),
    ("model.py", "        return [\n",
     "        return [\n"
     "            (self.n_kv_head is None or self.n_head % self.n_kv_head == 0,\n"
     "             f\"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}; \"\n"
     "             f\"each key/value head serves n_head / n_kv_head heads, so pick values that divide.\"),\n"),
]


@pytest.fixture()
def args(data_root):
    return [*TINY, f"--data.data_root={data_root}"]


def test_a_run_saved_before_a_new_model_field_resumes_at_its_default(tmp_path, args):
    project = fork_of_the_project(tmp_path / "project")
    old = tmp_path / "old"
    run(project, "train.py", *args, *STEPS, f"--train.out_dir={old}", "--train.hard_stop=3")
    make_edits(project, *NEW_FIELDS)
    # The old run's config has neither field: each is at its default, which is what that run was; and setting the
    # default on the command line (`=None` parses) is the same run.
    resumed = run(project, "train.py", *args, *STEPS, f"--train.out_dir={old}", "--model.n_kv_head=None")
    assert f"resumed from {old / 'step3'}" in resumed.stdout and "model.n_kv_head" not in resumed.stdout
    assert "model.qk_norm" not in resumed.stdout  # neither is a changed setting
    assert f"the model code changed since {old / 'step3'} was saved (model.py)" in resumed.stdout  # the new field
    assert [row["step"] for row in metrics(old)] == [1, 2, 3, 4, 5, 6]
    # The fork's check across fields: one sentence, and no run folder.
    refused = run(project, "train.py", *args, "--model.n_kv_head=3", f"--train.out_dir={tmp_path / 'new'}",
                  check=False)
    assert_one_sentence(refused, "model.n_head=2 is not divisible by model.n_kv_head=3")
    assert not (tmp_path / "new").exists()


def test_an_optional_field_takes_none_from_the_command_line_and_a_config_file():
    from config import ConfigError, check_value, parse_value

    assert parse_value("None", int | None, "model.n_kv_head") is None
    assert parse_value("none", int | None, "model.n_kv_head") is None
    assert parse_value("4", int | None, "model.n_kv_head") == 4
    assert check_value("model.n_kv_head", None, int | None) is None
    assert check_value("model.n_kv_head", 4, int | None) == 4
    with pytest.raises(ConfigError, match=r"model.n_kv_head='four' is not a valid int or None\.$"):
        parse_value("four", int | None, "model.n_kv_head")
    with pytest.raises(ConfigError, match=r"model.n_kv_head must be a int or None, got 'four'\.$"):
        check_value("model.n_kv_head", "four", int | None)
    with pytest.raises(ConfigError, match="is not a valid int"):
        parse_value("None", int, "model.n_layer")  # a field without None still refuses it


def test_a_saved_config_without_a_field_reads_it_at_its_default():
    from config import Config, config_to_dict, with_defaults

    saved = config_to_dict(Config())
    del saved["model"]["bias"], saved["train"]["seed"]
    completed = with_defaults(saved)
    assert completed["model"]["bias"] is True and completed["train"]["seed"] == 1337
    assert with_defaults({"model": {"gone": 1}})["model"]["gone"] == 1  # a field this version lacks stays


FORK = "from model import GPT  # noqa: F401  (model.py's GPT, through a file of one's own)\n"
QK_NORM_LIKE = """import torch.nn.functional as F

import model


class GPT(model.GPT):
    \"\"\"The same weights, another function: the final hidden states RMS-normalised again.\"\"\"

    def hidden_states(self, *args, **kwargs):
        h = super().hidden_states(*args, **kwargs)
        return F.rms_norm(h, h.shape[-1:])
"""


def test_a_change_of_the_model_code_that_keeps_the_weights_is_said_on_resume(tmp_path, data_root, capsys):
    fork = tmp_path / "fork.py"
    fork.write_text(FORK)
    out = tmp_path / "run"
    common = [*TINY, f"--data.data_root={data_root}", *STEPS, f"--train.out_dir={out}",
              f"--train.model_module={fork}"]
    run_train([*common, "--train.hard_stop=2"])
    fork.write_text(FORK + "# a comment, and the layout, change no code\n\n")
    same = run_train([*common, "--train.hard_stop=4"])
    assert "resumed from" in same.stdout and "model code changed" not in same.stdout, same.stdout
    fork.write_text(QK_NORM_LIKE)
    changed = run_train(common)
    lines = [line for line in changed.stdout.splitlines() if "model code changed" in line]
    assert lines == [f"note: the model code changed since {out / 'step4'} was saved ({os.path.realpath(fork)}); its "
                     f"weights fit, so the run goes on with the code as it is now"], changed.stdout
    assert "resumed from" in changed.stdout and [row["step"] for row in metrics(out)] == [1, 2, 3, 4, 5, 6]
    fork.write_text(FORK)  # the researcher moves on: sample.py, evaluation and export-hf (load_model) say so too
    from checkpoint import load_model
    capsys.readouterr()
    load_model(str(out), "cpu", "--init_from", str(fork))
    assert capsys.readouterr().err == (f"note: the model code changed since {out / 'step6'} was saved "
                                       f"({os.path.realpath(fork)}); its weights fit, so it is loaded with the code "
                                       f"as it is now\n")


def test_a_checkpoint_without_a_code_hash_is_resumed_without_a_word_of_it(tmp_path):
    from checkpoint import TrainState
    from checkpoint import code_change_note, model_code

    saved = {"step": 3, "tokens": 384, "best_val_loss": 4.0, "data": {}, "nonfinite_skipped": 0,
             "data_fingerprint": {}}  # trainer.pt of a run saved before checkpoints kept the hash
    assert TrainState.from_dict(saved).model_code == {}
    assert code_change_note(saved.get("model_code"), "model", tmp_path / "step3") == ""
    other = {"model.py": "0" * 64}
    assert code_change_note(model_code("model"), "model", tmp_path / "step3") == ""
    assert "changed since" in code_change_note(other, "model", tmp_path / "step3")


def test_a_model_module_file_moved_since_the_run_is_said_to_be_gone(tmp_path, data_root, capsys):
    """A run trained with train.model_module=A, whose file then moved to B: loading it names A and the flag that
    names a file (a checkpoint's file is never imported), A itself is gone, B loads with a note of the change, and
    resuming with B asks for the file back at A (it advised setting A, which names no file)."""
    from checkpoint import CheckpointError, load_model

    fork, moved = tmp_path / "fork.py", tmp_path / "moved.py"
    fork.write_text(FORK)
    out = tmp_path / "run"
    common = [*TINY, f"--data.data_root={data_root}", *STEPS, f"--train.out_dir={out}"]
    run_train([*common, f"--train.model_module={fork}", "--train.hard_stop=2"])
    fork.rename(moved)
    with pytest.raises(CheckpointError, match=f"pass --model_module={fork} to load it with that file"):
        load_model(str(out), "cpu", "--init_from")
    with pytest.raises(CheckpointError, match=f"train.model_module='{fork}' is no file \\(moved or deleted\\?\\); put "
                                              f"the file that defines your GPT class at that path."):
        load_model(str(out), "cpu", "--init_from", str(fork))
    capsys.readouterr()
    load_model(str(out), "cpu", "--init_from", str(moved))
    note = capsys.readouterr().err  # the file it was trained with gone, the one named in its place
    assert f"the model code changed since {out / 'step2'} was saved ({fork}, {moved})" in note
    refused = run_train([*common, f"--train.model_module={moved}"], check=False)
    assert_one_sentence(refused, f"put that file back at {fork} and set --train.model_module={fork} to resume it")


def test_a_relative_model_module_is_recorded_as_the_file_it_named(tmp_path, monkeypatch):
    """Typed relative to where the run started, it named no file (or another file) from any other folder: sample.py
    said the file was gone, and a resume could load a namesake. The run records the absolute path; a run saved
    before, read back, is taken relative to where it is read from, as it always was."""
    from config import parse_args, with_defaults

    (tmp_path / "my_gpt.py").write_text(FORK)
    monkeypatch.chdir(tmp_path)
    assert parse_args(["--train.model_module=my_gpt.py"]).train.model_module == str(tmp_path / "my_gpt.py")
    saved_before = {"train": {"model_module": "my_gpt.py"}}
    assert with_defaults(saved_before)["train"]["model_module"] == str(tmp_path / "my_gpt.py")
    assert parse_args([]).train.model_module == "model"
