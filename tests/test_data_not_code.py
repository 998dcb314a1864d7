"""Files from outside are data, never code: a checkpoint (in a folder or a bucket) that names a model file of its
own never makes a tool import it, and a tool that loads a checkpoint or GPT-2 into other code than the model that
was trained says so, or refuses.

A model file is imported only when the user names it: train.model_module on the command line or in the config
file of a run, a tool's --model_module. A checkpoint that names one the user did not is one sentence naming the
path and the flag; a file inside a checkpoint folder or the download cache is never imported, even when named; the
bucket's download fetches only the files a checkpoint is made of.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from bucket_fixture import s3  # noqa: F401 - a fixture: moto's S3 server on 127.0.0.1
from conftest import TINY, assert_one_sentence, run_in_process, run_train, tiny_task_data

EVIL = """import os
open({marker!r}, "w").write("ran")  # whoever handed the checkpoint over runs code here
from model import GPT  # noqa: E402,F401
"""


@pytest.fixture(scope="module")
def tiny_run(data_root, tmp_path_factory):
    """A 2-step run of model.py's GPT."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    run_train([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
               "--train.max_steps=2"])
    return out


def naming_a_file_of_its_own(tiny_run, folder, marker):
    """A copy of tiny_run's step2 at `folder` with evil.py beside its files, named in its trainer.pt as
    train.model_module, listed in COMPLETE with every checksum right: what anyone handing a checkpoint over can
    make."""
    from checkpoint import sha256_file

    shutil.copytree(tiny_run / "step2", folder)
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker)))
    trainer = torch.load(folder / "trainer.pt", weights_only=True)
    trainer["config"]["train"]["model_module"] = str(folder / "evil.py")
    torch.save(trainer, folder / "trainer.pt")
    marker_file = json.loads((folder / "COMPLETE").read_text())
    for name in ("trainer.pt", "evil.py"):
        marker_file["files"][name] = sha256_file(folder / name)
    (folder / "COMPLETE").write_text(json.dumps(marker_file))
    return folder


def test_a_checkpoint_naming_a_model_file_makes_no_tool_import_it(tiny_run, data_root, tmp_path):
    import checkpoint
    import hellaswag_eval
    import sample
    import train
    from lab import debug

    marker = tmp_path / "ran"
    folder = naming_a_file_of_its_own(tiny_run, tmp_path / "handed_over", marker)
    evil = folder / "evil.py"
    tools = {"sample.py": (sample.main, ["--init_from", folder, "--device=cpu", "--max_new_tokens=2"]),
             "hellaswag_eval.py": (hellaswag_eval.main, ["--init_from", folder, "--device=cpu"]),
             "export-hf": (checkpoint.main, ["export-hf", folder, tmp_path / "hf"]),
             "compare-state": (debug.main, ["compare-state", folder, folder])}
    for name, (main, args) in tools.items():
        assert_one_sentence(run_in_process(args, main), f"train.model_module={evil}", f"--model_module={evil}",
                            "never imported")
        assert not marker.exists(), name
    reference = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}",
                                "--stage2.start=1", "--stage2.mix=shakespeare:1", f"--stage2.reference={folder}"],
                               train.main)
    assert_one_sentence(reference, f"train.model_module={evil}", f"--train.model_module={evil}")
    # Named, a file inside a checkpoint folder is still never imported: copy it out, read it, and name the copy.
    for name, (main, args) in tools.items():
        assert_one_sentence(run_in_process([*args, f"--model_module={evil}"], main), f"{evil} lies inside",
                            "never imported", "copy the file you trust elsewhere")
    assert not marker.exists() and not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()


def test_a_bucket_checkpoint_that_lists_other_files_is_refused_and_nothing_lands_in_the_cache(s3, tiny_run,
                                                                                             tmp_path):
    import sample
    from lab import remote

    marker = tmp_path / "ran"
    folder = naming_a_file_of_its_own(tiny_run, tmp_path / "step2", marker)
    url = "s3://runs/handed-over"
    fs, root = remote.filesystem(url)
    fs.put(str(folder), f"{root}/step2", recursive=True)
    result = run_in_process(["--init_from", url, "--device=cpu", "--max_new_tokens=2"], sample.main)
    assert_one_sentence(result, f"{url}/step2's marker lists evil.py", "not a file a checkpoint is made of")
    assert not marker.exists()
    run_cache = Path(remote.cache_folder()) / hashlib.sha256(url.encode()).hexdigest()[:16]
    assert not list(run_cache.glob("step2*")) and not list(Path(remote.cache_folder()).rglob("*.py"))


def test_a_model_file_the_user_names_is_imported_and_its_helpers_are_part_of_the_model_code(
        data_root, tmp_path, capsys):
    """A model_module that imports a helper of the project: an edit of the helper (GELU to ReLU) is a change of the
    model code, said on resume and recorded in config_changes.jsonl; sample.py and export-hf refuse it unless told
    to use the code as it is now."""
    import sample

    helper = tmp_path / "helper_act.py"
    helper.write_text("import torch.nn as nn\n\n\ndef activation():\n    return nn.GELU(approximate='tanh')\n")
    module = tmp_path / "my_gpt.py"
    module.write_text("import helper_act\nimport model\n\n\nclass GPT(model.GPT):\n"
                      "    def __init__(self, config, loss_path='chunked'):\n"
                      "        super().__init__(config, loss_path)\n"
                      "        for block in self.blocks:\n            block.mlp.gelu = helper_act.activation()\n")
    out = tmp_path / "run"
    common = [*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
              f"--train.model_module={module}", "--train.max_steps=4", "--checkpoint.interval=2"]
    sys.path.insert(0, str(tmp_path))  # where `import helper_act` finds it, as a project's own module would be
    try:
        run_train([*common, "--train.hard_stop=2"])
        helper.write_text(helper.read_text().replace("nn.GELU(approximate='tanh')", "nn.ReLU()"))
        resumed = run_train(common)
        helper = os.path.realpath(helper)
        assert f"the model code changed since {out / 'step2'} was saved ({helper})" in resumed.stdout
        changes = [json.loads(line) for line in (out / "config_changes.jsonl").read_text().splitlines()]
        assert changes[-1]["step"] == 2 and f"model code {helper}" in changes[-1]["changes"], changes
        Path(helper).write_text(Path(helper).read_text().replace("nn.ReLU()", "nn.GELU()"))  # edited again
        to_sample = ["--init_from", out, "--device=cpu", "--max_new_tokens=2", "--num_samples=1",
                     f"--model_module={module}"]
        assert_one_sentence(run_in_process(to_sample, sample.main), "was saved with other model code", str(helper),
                            "--accept_changed_code")
        sampled = run_in_process([*to_sample, "--accept_changed_code"], sample.main)
        assert sampled.returncode == 0 and sampled.stderr.startswith("note: the model code changed since"), sampled
        assert str(helper) in sampled.stderr.splitlines()[0] and sampled.stdout.startswith("--- sample 0")
        pytest.importorskip("transformers", reason="export-hf needs transformers (pip install transformers)")
        import checkpoint
        refused = run_in_process(["export-hf", out, tmp_path / "hf", f"--model_module={module}"], checkpoint.main)
        assert_one_sentence(refused, "was saved with other model code than is here now", str(helper),
                            "check out the code it was trained with")
        assert not (tmp_path / "hf").exists()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper_act", None)


# ----------------------------------------------------------------------------- code other than the trained model's

RELU = ("model.py", 'self.gelu = nn.GELU(approximate="tanh")', "self.gelu = nn.ReLU()")


@pytest.fixture(scope="module")
def relu_fork(tmp_path_factory):
    """A copy of the project whose model.py computes a ReLU MLP: the same weights as GPT-2, another function."""
    from test_forks import fork_of_the_project
    return fork_of_the_project(tmp_path_factory.mktemp("relu") / "project", RELU)


def test_the_tools_refuse_a_checkpoint_of_other_model_code_unless_told_to_use_the_code_now(relu_fork, data_root,
                                                                                          tmp_path):
    """A ReLU run sampled, scored or exported after model.py went back to GPT-2's GELU: each tool would serve another
    model than the one trained. Each refuses in one sentence naming the file and the one flag that accepts the code
    as it is now; with it, sample.py says so on stderr and samples, and export-hf writes and checks its folder."""
    from test_forks import make_edits, run

    out = tmp_path / "run"
    run(relu_fork, "train.py", *TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}",
        "--train.max_steps=2", "--eval.interval=0")
    project = make_edits(relu_fork, RELU[::2] + RELU[1:2])  # model.py as it was: GPT-2's GELU
    try:
        sample = ["sample.py", f"--init_from={out}", "--device=cpu", "--max_new_tokens=2", "--num_samples=1"]
        scores = ["hellaswag_eval.py", f"--init_from={out}", "--device=cpu", f"--data_dir={tiny_task_data()}",
                  "--limit=1"]
        export = ["checkpoint.py", "export-hf", out, tmp_path / "hf"]
        for command in (sample, scores, export):
            refused = run(project, *command, check=False)
            assert_one_sentence(refused, "was saved with other model code than is here now (model.py)",
                                "pass --accept_changed_code to use the code as it is now")
        assert not (tmp_path / "hf").exists()
        sampled = run(project, *sample, "--accept_changed_code")
        assert sampled.stderr.splitlines()[0].startswith(f"note: the model code changed since {out / 'step2'} "
                                                         "was saved (model.py)")
        assert sampled.stdout.startswith("--- sample 0")
        pytest.importorskip("transformers", reason="export-hf needs transformers (pip install transformers)")
        run(project, *export, "--accept_changed_code")  # checked against the code now, as every export is
        assert (tmp_path / "hf" / "config.json").exists()
    finally:
        make_edits(project, RELU)


def test_gpt2s_weights_in_a_fork_that_computes_otherwise_are_refused_for_sampling_and_scoring(relu_fork, data_root,
                                                                                             tmp_path):
    """GPT-2 through a ReLU fork gave other logits and HellaSwag scores under GPT-2's name (exit 0): sample.py and
    hellaswag_eval.py refuse it; fine-tuning GPT-2 into the fork stays allowed, with a note."""
    transformers = pytest.importorskip("transformers")
    from test_forks import run

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, initializer_range=0.2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    for tool in ("sample.py", "hellaswag_eval.py"):
        refused = run(relu_fork, tool, f"--init_from={tmp_path / 'gpt2'}", "--device=cpu", check=False)
        assert_one_sentence(refused, "weights give other logits in this model than in GPT-2",
                            "load GPT-2 with GPT-2's model.py")
    tuned = run(relu_fork, "train.py", *TINY, f"--data.data_root={data_root}", "--optim.warmup_steps=0",
                f"--checkpoint.load_path={tmp_path / 'gpt2'}", f"--train.out_dir={tmp_path / 'tuned'}",
                "--train.max_steps=1", "--eval.interval=0")
    assert "weights give other logits in this model than in GPT-2" in tuned.stdout


def test_weights_in_another_dtype_than_the_models_are_refused_not_cast(tiny_run, data_root, tmp_path):
    """A model.pt with one weight in bfloat16, every checksum right: a load would cast it to the model's float32 in
    silence. Sampling and training from it are one sentence each (the sharded pieces: tests/test_fsdp.py)."""
    import sample
    import train
    from checkpoint import sha256_file

    step = tmp_path / "step2"
    shutil.copytree(tiny_run / "step2", step)
    weights = torch.load(step / "model.pt", weights_only=True)
    name = next(name for name in weights if name.endswith("attn.c_attn.weight"))
    weights[name] = weights[name].to(torch.bfloat16)
    torch.save(weights, step / "model.pt")
    marker = json.loads((step / "COMPLETE").read_text())
    marker["files"]["model.pt"] = sha256_file(step / "model.pt")
    (step / "COMPLETE").write_text(json.dumps(marker))
    phrase = f"holds {name} as torch.bfloat16 and this model as torch.float32, which a load would cast in silence"
    assert_one_sentence(run_in_process(["--init_from", step, "--device=cpu"], sample.main), phrase)
    out = tmp_path / "out"
    assert_one_sentence(run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}",
                                        f"--checkpoint.load_path={step}", "--train.max_steps=3"], train.main), phrase)
    assert not out.exists() or not any(out.glob("step*"))


def test_a_saved_config_json_naming_a_model_file_imports_nothing_unless_the_command_line_names_it(tmp_path,
                                                                                                  data_root):
    """`python train.py RUN/config.json` (the ladder's way to reproduce a size; a fresh node copies config.json
    from the bucket): the JSON is data, so the file it names is not imported wherever it lies, here at the top
    of the run folder. Named again on the command line, it is the user's word."""
    import train
    from config import ConfigError, parse_args

    marker = tmp_path / "ran"
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    evil = run_folder / "evil.py"
    evil.write_text(EVIL.format(marker=str(marker)))
    (run_folder / "config.json").write_text(json.dumps({"train": {"model_module": str(evil)}}))
    config = str(run_folder / "config.json")
    refused = run_in_process([config, f"--data.data_root={data_root}", "--train.max_steps=1"], train.main)
    assert_one_sentence(refused, f"names train.model_module={evil}", "never imported",
                        f"pass --train.model_module={evil} to train with that file")
    assert not marker.exists()
    assert parse_args([config, f"--train.model_module={evil}"]).train.model_module == str(evil)
    assert parse_args([config, "--train.model_module=model"]).train.model_module == "model"
    with pytest.raises(ConfigError, match="never imported"):
        parse_args([config, "--train.max_steps=1"])
    assert not marker.exists()


def test_the_model_code_covers_helpers_imported_under_try_and_inside_functions(tmp_path):
    """A helper a model file imports anywhere, not only at its top (under `try:`, inside a function), at any depth,
    is part of the model's code: an edit of it is a change a resume and the tools hear of."""
    from checkpoint import model_code

    for name in ("optional_norm", "inner_act", "deeper"):
        (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    (tmp_path / "inner_act.py").write_text("def act():\n    from deeper import VALUE\n    return VALUE\n")
    module = tmp_path / "my_gpt.py"
    module.write_text("import model\ntry:\n    import optional_norm\nexcept ImportError:\n"
                      "    optional_norm = None\n\n\nclass GPT(model.GPT):\n    def activation(self):\n"
                      "        import inner_act\n        return inner_act.act()\n")
    files = {os.path.basename(name) for name in model_code(str(module))}
    assert {"optional_norm.py", "inner_act.py", "deeper.py", "my_gpt.py", "model.py"} <= files
