"""A stand-in for W&B's client, put first on PYTHONPATH by tests/test_devices.py (no W&B server here).

`init` returns a run that logs nowhere; once it has logged step $FAKE_WANDB_CANCEL_AFTER it tags itself
`cancel`, once, as a user would in W&B's web page. `Api().run(path).tags` reads the tags from
$FAKE_WANDB_DIR/tags.json and `update` writes them back. FAKE_WANDB_API=down: the API raises, as for a
server that cannot be reached; FAKE_WANDB_INIT=down: `init` raises too, after making its folder (dir/wandb), as
W&B's does once its retries are spent."""

import json
import os
from pathlib import Path


def state(name):
    return Path(os.environ["FAKE_WANDB_DIR"]) / name


def read_tags():
    return json.loads(state("tags.json").read_text()) if state("tags.json").exists() else []


class CommError(Exception):
    """W&B's error for a server it cannot reach (wandb.errors.CommError)."""


class Run:
    def __init__(self, project, id):
        self.id, self.path, self.offline = id, f"someone/{project}/{id}", False

    def log(self, values, step=None):
        after = int(os.environ.get("FAKE_WANDB_CANCEL_AFTER", "0"))
        if after and step >= after and not state("tagged").exists():
            state("tagged").touch()
            state("tags.json").write_text(json.dumps([*read_tags(), "cancel"]))

    def finish(self):
        pass


def init(*, project, id, dir=None, **settings):
    if dir:
        os.makedirs(os.path.join(dir, "wandb"), exist_ok=True)
    if os.environ.get("FAKE_WANDB_INIT") == "down":
        raise CommError("Run initialization has timed out after 90.0 sec.\nPlease refer to the documentation")
    return Run(project, id)


class ApiRun:
    def __init__(self, path):
        self.path, self.tags = path, read_tags()

    def update(self):
        state("tags.json").write_text(json.dumps(self.tags))


class Api:
    def __init__(self):
        if os.environ.get("FAKE_WANDB_API") == "down":
            raise ConnectionError("api.wandb.ai cannot be reached")

    def run(self, path):
        return ApiRun(path)
