import json
import subprocess
import sys

import pytest

from config import ConfigError, config_from_dict, config_to_dict, parse_args
import warm_python
from conftest import ROOT, TINY, run_train


def write(tmp_path, text):
    path = tmp_path / "cfg.py"
    path.write_text(text)
    return str(path)


def test_overrides_are_parsed_to_the_field_type(tmp_path):
    cfg = parse_args([write(tmp_path, ""), "--model.n_layer=3", "--optim.lr=1e-3", "--data.shuffle=false",
                      "--train.total_batch_size=2e3", "--eval.sample_prompt=ROMEO:"])
    assert cfg.model.n_layer == 3 and cfg.optim.lr == 1e-3 and cfg.data.shuffle is False
    assert cfg.train.total_batch_size == 2000 and cfg.eval.sample_prompt == "ROMEO:"


@pytest.mark.parametrize("text,value", [("true", True), ("1", True), ("false", False), ("0", False)])
def test_bool_accepts_true_false_one_zero(tmp_path, text, value):
    assert parse_args([write(tmp_path, ""), f"--data.shuffle={text}"]).data.shuffle is value


def test_config_file_sets_fields_and_may_compute_them(tmp_path):
    cfg = parse_args([write(tmp_path, "import math\nmodel.n_layer = 6\ntrain.total_batch_size = 2**10\n"
                                      "optim.lr = 3  # an int is fine for a float\n")])
    assert cfg.model.n_layer == 6 and cfg.train.total_batch_size == 1024
    assert cfg.optim.lr == 3.0 and isinstance(cfg.optim.lr, float)


def test_command_line_overrides_win_over_the_file(tmp_path):
    cfg = parse_args([write(tmp_path, "model.n_layer = 6\n"), "--model.n_layer=2"])
    assert cfg.model.n_layer == 2


def test_default_config_file_is_shakespeare():
    assert parse_args([]).data.dataset == "shakespeare"


def test_unknown_override_names_the_closest_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'model.n_layr'; did you mean model.n_layer\?"):
        parse_args([write(tmp_path, ""), "--model.n_layr=3"])


def test_typo_in_config_file_names_line_and_closest_key(tmp_path):
    path = write(tmp_path, "model.n_layer = 2\noptim.weight_decy = 0.1\n")
    with pytest.raises(
        ConfigError, match=r"cfg.py:2: unknown config key 'optim.weight_decy'; did you mean optim.weight_decay\?"
    ):
        parse_args([path])


def test_nanogpt_style_global_in_config_file_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"'batch_size' is not a section.*did you mean data.batch_size\?"):
        parse_args([write(tmp_path, "batch_size = 12\n")])


def test_wrong_types_fail_with_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model.n_layer='many' is not a valid int"):
        parse_args([write(tmp_path, ""), "--model.n_layer=many"])
    with pytest.raises(ConfigError, match=r"model.n_layer must be a int, got '4'"):
        parse_args([write(tmp_path, "model.n_layer = '4'\n")])
    with pytest.raises(ConfigError, match=r"data.shuffle='maybe' is not a valid bool"):
        parse_args([write(tmp_path, ""), "--data.shuffle=maybe"])


def test_missing_config_file_says_what_to_give():
    with pytest.raises(ConfigError, match="config file nope.py not found"):
        parse_args(["nope.py"])


def test_config_round_trips_through_json(tmp_path):
    cfg = parse_args([write(tmp_path, "model.n_layer = 5\n")])
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def test_help_lists_every_field_with_default_and_comment():
    out = warm_python.python(["train.py", "--help"], ROOT).stdout
    for key in [
        "model.n_layer",
        "data.batch_size",
        "train.total_batch_size",
        "optim.lr",
        "eval.val_steps",
        "log.interval",
    ]:
        assert f"--{key}=" in out
    assert "--model.n_layer=12\n      number of transformer blocks" in out


def test_bad_key_on_the_command_line_is_one_line_not_a_traceback():
    result = warm_python.python(["train.py", "--optim.lrr=1"], ROOT)
    assert result.returncode != 0
    assert result.stderr.strip() == "error: command line: unknown config key 'optim.lrr'; did you mean optim.lr?"


def test_fields_with_choices_reject_other_words(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.load='sometimes' is not one of if_available, always, never"):
        parse_args([write(tmp_path, ""), "--checkpoint.load=sometimes"])


def test_counts_must_be_positive_and_heads_must_divide_the_width(tmp_path):
    with pytest.raises(ConfigError, match="log.interval must be at least 1"):
        parse_args([write(tmp_path, ""), "--log.interval=0"])
    with pytest.raises(ConfigError, match="model.n_embd=100 is not divisible by model.n_head=12"):
        parse_args([write(tmp_path, ""), "--model.n_embd=100"])


def test_shipped_config_files_parse():
    assert parse_args([str(ROOT / "config" / "gpt2.py")]).train.total_batch_size == 524288
    assert parse_args([str(ROOT / "config" / "shakespeare.py")]).model.n_layer == 4


def test_word_fields_are_literals_whose_choices_config_py_alone_states(tmp_path):
    with pytest.raises(ConfigError, match="train.dtype='float16' is not one of auto, float32, bfloat16"):
        parse_args(["--train.dtype=float16"])
    help_text = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "--train.nan_policy=\"stop\"" in help_text and "(one of: stop, skip)" in help_text


@pytest.mark.parametrize("override,message", [
    ("--train.max_duration=3 fortnights", "train.max_duration='3 fortnights' is not a duration"),
    ("--train.hard_stop=soon", "train.hard_stop='soon' is not a duration"),
    ("--train.steps_to_skip=9-3", "train.steps_to_skip part '9-3' is not a range"),
])
def test_formatted_strings_fail_before_the_run_folder_is_created(data_root, tmp_path, override, message):
    out = tmp_path / "run"
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", override], check=False)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def test_a_config_file_may_write_hard_stop_as_a_number(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("train.hard_stop = 500\n")
    assert parse_args([str(path)]).train.hard_stop == "500"


def test_help_prints_a_fields_comment_lines_above_it_and_its_trailing_comment():
    from config import TrainConfig, field_comments

    comments = field_comments(TrainConfig)
    # one sentence, from the two comment lines above the field
    assert comments["hard_stop"].startswith("stop (with a checkpoint) after this duration (500steps,")
    assert comments["hard_stop"].endswith("0 trains nothing and saves what was loaded")
    assert comments["seed"] == "model init, data order and sampling"  # a trailing comment alone
