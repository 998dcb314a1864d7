"""Turns a config file and command-line overrides into a validated `Config`.

    python train.py [CONFIG_FILE] [--section.field=value ...]

A config file is a small Python file run with one name per section of `config.Config` (`model`,
`data`, `train`, ...) already defined, so it sets fields by assignment: `model.n_layer = 12`.
Overrides on the command line use the same dotted names and are applied after the file. Unlike
nanoGPT's exec-based configurator, every key is checked (a typo fails with the closest valid key)
and every value is converted to and checked against the field's type.
"""

import dataclasses
import difflib
import inspect
import json
import re
import sys
import traceback
import types
import typing
from pathlib import Path

from config import Config

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parent.parent / "config" / "shakespeare.py"
TRUE_WORDS, FALSE_WORDS = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
# Fields that take one of a few words.
CHOICES = {
    "train.dtype": ("auto", "float32", "bfloat16"),
    "train.compile": ("auto", "true", "false"),
    "checkpoint.load": ("if_available", "always", "never"),
    "train.nan_policy": ("stop", "skip"),
}
# Fields that count something and must be at least 1.
POSITIVE = ("model.block_size", "model.n_layer", "model.n_head", "model.n_embd", "data.batch_size",
            "train.total_batch_size", "log.interval", "log.metrics_collect_interval", "eval.val_steps")


class ConfigError(Exception):
    """A mistake in a config file or override; train.py prints it as one line and exits."""


def sections(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def all_keys(cfg):
    return [f"{name}.{f.name}" for name, sec in sections(cfg).items() for f in dataclasses.fields(sec)]


def closest_key(cfg, key):
    match = difflib.get_close_matches(key, all_keys(cfg), n=1, cutoff=0.5)
    if not match:  # fall back on the field name alone, e.g. `batch_size` -> `data.batch_size`
        by_field = {k.split(".")[1]: k for k in all_keys(cfg)}
        field = difflib.get_close_matches(key.split(".")[-1], list(by_field), n=1, cutoff=0.6)
        match = [by_field[field[0]]] if field else []
    return f"; did you mean {match[0]}?" if match else "; `python train.py --help` lists every key."


def unknown_key_error(cfg, key, where):
    return ConfigError(f"{where}: unknown config key '{key}'{closest_key(cfg, key)}")


def field_type(cfg, key):
    section_name, name = key.split(".", 1)
    section = sections(cfg)[section_name]
    return {f.name: f.type for f in dataclasses.fields(section)}[name]


def parse_value(text, type_, key):
    """Convert a command-line string to the field's type; `none` is accepted where None is."""
    args = typing.get_args(type_)
    if typing.get_origin(type_) in (typing.Union, types.UnionType) and type(None) in args:
        if text.lower() in ("none", "null", ""):
            return None
        type_ = next(a for a in args if a is not type(None))
    try:
        if type_ is bool:
            if text.lower() not in TRUE_WORDS | FALSE_WORDS:
                raise ValueError
            return text.lower() in TRUE_WORDS
        if type_ is int:
            return int(float(text)) if re.fullmatch(r"\d+(\.0*)?e\d+", text) else int(text)
        if type_ is float:
            return float(text)
        if typing.get_origin(type_) is list:
            item_type = typing.get_args(type_)[0]
            return [parse_value(item.strip(), item_type, key) for item in text.split(",") if item.strip()]
        return text
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a valid {getattr(type_, '__name__', type_)}.") from None


def check_value(key, value, type_):
    """Values set by config files are Python objects: check them against the field's type."""
    args = typing.get_args(type_)
    if value is None and type(None) in args:
        return None
    if args and type(None) in args:
        type_ = next(a for a in args if a is not type(None))
    if type_ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(type_) is list:
        if isinstance(value, (list, tuple)):
            return list(value)
        raise ConfigError(f"{key} must be a list, got {value!r}.")
    if type(value) is not type_:
        raise ConfigError(f"{key} must be a {type_.__name__}, got {value!r}.")
    return value


def load_config_file(cfg, path):
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; give the path to a file such as config/gpt2.py.")
    namespace = dict(sections(cfg))
    try:
        exec(compile(path.read_text(), str(path), "exec"), namespace)
    except AttributeError as error:
        # Sections are slotted dataclasses, so assigning a field they lack raises AttributeError:
        # "'OptimConfig' object has no attribute 'weight_decy'".
        match = re.search(r"'(\w+)' object has no attribute '(\w+)'", str(error))
        if not match:
            raise
        section = next((n for n, s in sections(cfg).items() if type(s).__name__ == match.group(1)), "?")
        line = next((f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)), "?")
        raise unknown_key_error(cfg, f"{section}.{match.group(2)}", f"{path}:{line}") from None
    for name, value in namespace.items():
        if name in sections(cfg) or name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        raise ConfigError(
            f"{path}: '{name}' is not a section; config files set fields as section.field = value"
            f"{closest_key(cfg, name)}"
        )
    for key in all_keys(cfg):
        section_name, name = key.split(".")
        section = sections(cfg)[section_name]
        setattr(section, name, check_value(key, getattr(section, name), field_type(cfg, key)))


def apply_override(cfg, arg):
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError(f"cannot read argument '{arg}'; overrides look like --train.max_steps=100.")
    key, text = arg[2:].split("=", 1)
    if key not in all_keys(cfg):
        raise unknown_key_error(cfg, key, "command line")
    section_name, name = key.split(".")
    setattr(sections(cfg)[section_name], name, parse_value(text, field_type(cfg, key), key))


def field_comments(cls):
    """The trailing `# comment` of each field in the dataclass source: the documentation of a key."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
        if match:
            comments[match.group(1)] = match.group(2)
    return comments


def help_text():
    cfg = Config()
    lines = [__doc__.strip().splitlines()[2].strip(), "",
             "The defaults below are the dataclass defaults (GPT-2's hyperparameters); without CONFIG_FILE,",
             "config/shakespeare.py is applied first. Bools take true/false/1/0; lists are comma-separated.", ""]
    for section_name, section in sections(cfg).items():
        comments = field_comments(type(section))
        lines.append(f"{section_name}:")
        for f in dataclasses.fields(section):
            default = json.dumps(getattr(section, f.name))
            lines.append(f"  --{section_name}.{f.name}={default}\n      {comments.get(f.name, '')}")
    return "\n".join(lines)


def parse_args(argv):
    """Build the run's Config from `argv` (without the program name)."""
    if "--help" in argv or "-h" in argv:
        print(help_text())
        sys.exit(0)
    cfg = Config()
    config_file = argv[0] if argv and not argv[0].startswith("--") else DEFAULT_CONFIG_FILE
    load_config_file(cfg, config_file)
    for arg in argv[1:] if argv and not argv[0].startswith("--") else argv:
        apply_override(cfg, arg)
    for key, allowed in CHOICES.items():
        section_name, name = key.split(".")
        value = getattr(sections(cfg)[section_name], name)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of those.")
    for key in POSITIVE:
        section_name, name = key.split(".")
        if getattr(sections(cfg)[section_name], name) < 1:
            raise ConfigError(f"{key} must be at least 1; set it to a positive number.")
    if cfg.model.n_embd % cfg.model.n_head:
        raise ConfigError(f"model.n_embd={cfg.model.n_embd} is not divisible by model.n_head={cfg.model.n_head}; "
                          f"every head gets n_embd / n_head dimensions, so pick values that divide.")
    return cfg


def config_to_dict(cfg):
    return dataclasses.asdict(cfg)


def config_from_dict(data):
    """Rebuild a Config saved with config_to_dict (checkpoints store the config this way)."""
    cfg = Config()
    for section_name, values in data.items():
        section = sections(cfg).get(section_name)
        for name, value in values.items():
            if section is not None and hasattr(section, name):
                setattr(section, name, value)
    return cfg
