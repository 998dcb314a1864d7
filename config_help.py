"""What a user is told about a config: the `python train.py --help` listing, the key suggested for a mistyped
one, the sentence for a config file that fails as it runs, and the override that sets a key back (run_dir.py's
refusals). All run only when a user asks or errs, so the default run does not load them. config.py imports this
module lazily, so it imports none of the project's modules (that would be a cycle); it returns sentences, and
config.py raises them as ConfigErrors."""

import dataclasses
import difflib
import inspect
import json
import re
import traceback
import typing
from typing import Literal


def field_comments(cls):
    """Each field's documentation in the dataclass source: the `# comment` lines just above it, then its
    trailing `# comment` (a long one goes above, so no line is over 120 characters)."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        if re.match(r"\s+#", line):
            above.append(line.strip()[1:].strip())
            continue
        match = re.match(r"\s+(\w+)\s*:[^#]*(?:#\s*(.*))?$", line)
        if match:
            comments[match.group(1)] = " ".join(above + [match.group(2) or ""]).strip()
        above = []
    return comments


def help_text(cfg, usage):
    """`usage`, then every field of `cfg` (a default Config) with its default and its comment."""
    lines = [usage, "",
             "  --dry_run   print the plan (model, batch, schedule, optimizer groups, checkpoints) and plot the LR;",
             "              touch no run folder", "",
             "The defaults below are the dataclass defaults (GPT-2's hyperparameters); without CONFIG_FILE,",
             "config/shakespeare.py is applied first. Bools take true/false/1/0; lists are comma-separated.", ""]
    for section_field in dataclasses.fields(cfg):
        section_name, section = section_field.name, getattr(cfg, section_field.name)
        comments = field_comments(type(section))
        lines.append(f"{section_name}:")
        for f in dataclasses.fields(section):
            choices = typing.get_args(f.type) if typing.get_origin(f.type) is Literal else ()
            note = f" (one of: {', '.join(choices)})" if choices else ""
            default = json.dumps(getattr(section, f.name))
            lines.append(f"  --{section_name}.{f.name}={default}\n      {comments.get(f.name, '')}{note}")
    return "\n".join(lines)


def closest_key(keys, key):
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not match:  # fall back on the field name alone, e.g. `batch_size` -> `data.batch_size`
        by_field = {k.split(".")[1]: k for k in keys}
        found = difflib.get_close_matches(key.split(".")[-1], list(by_field), n=1, cutoff=0.6)
        match = [by_field[found[0]]] if found else []
    return f"; did you mean {match[0]}?" if match else "; `python train.py --help` lists every key."


# nanoGPT's names for what a setting here does: a config that uses one is told which.
NANOGPT_KEYS = {
    "init_from": "train.py starts from weights with checkpoint.load_path (nanoGPT's init_from): gpt2, "
                 "gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face GPT-2 folder or a run folder, e.g. `python "
                 "train.py config/finetune_shakespeare.py --checkpoint.load_path=gpt2`",
}


def unknown_key_message(keys, key, where):
    """The sentence for a `key` that is none of `keys`, said to be found in `where`."""
    if key in NANOGPT_KEYS:
        return f"{where}: {key} is nanoGPT's name; {NANOGPT_KEYS[key]}."
    return f"{where}: unknown config key '{key}'{closest_key(keys, key)}"


def not_a_section_message(keys, name, path):
    """The sentence for a name a config file at `path` set that is no section."""
    if name in NANOGPT_KEYS:
        return unknown_key_message(keys, name, str(path))
    return (f"{path}: '{name}' is not a section; config files set fields as section.field = value"
            f"{closest_key(keys, name)}")


def config_file_failure(error, path, sections, keys):
    """The sentence for a config file at `path` that raised `error` as it ran: the line to fix, or for a field a
    section lacks the key meant. `sections` maps each section's name to its object, `keys` lists every key."""
    if isinstance(error, SyntaxError):
        return f"{path}:{error.lineno}: syntax error ({error.msg}); fix that line."
    if isinstance(error, SystemExit):  # sys.exit() or exit() in the file: it would end the run silently, with status 0
        return f"{path} calls sys.exit(); a config file only sets fields, so remove that call."
    if isinstance(error, KeyboardInterrupt):
        return (f"{path} was interrupted (Ctrl-C) while it ran; a config file only sets fields, so remove "
                f"whatever loops or waits in it.")
    line = next((f.lineno for f in reversed(traceback.extract_tb(error.__traceback__)) if f.filename == str(path)), "?")
    # Sections are slotted dataclasses, so assigning a field they lack raises AttributeError:
    # "'OptimConfig' object has no attribute 'weight_decy'".
    match = re.search(r"'(\w+)' object has no attribute '(\w+)'", str(error))
    if isinstance(error, AttributeError) and match:
        section = next((n for n, s in sections.items() if type(s).__name__ == match.group(1)), "?")
        return unknown_key_message(keys, f"{section}.{match.group(2)}", f"{path}:{line}")
    return f"{path}:{line}: {type(error).__name__}: {error}; fix that line."


def as_override(key, value):
    """The command-line override that sets `key` to `value`: --data.mix=shakespeare:3,python:1."""
    if isinstance(value, list):
        value = ",".join(map(str, value))
    elif isinstance(value, bool):
        value = str(value).lower()
    return f"--{key}={value}"
