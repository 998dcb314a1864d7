"""The fifth round of trying to break the trainer as a user would: files from outside are data, never code, secrets
reach no record, and what each refusal says. The slow parts (a real 2-rank sharded checkpoint) are in
tests/test_fsdp.py, which makes one for its module; these run in this process, on tiny runs."""

import io
import os
import pickle
from types import SimpleNamespace

import pytest
import torch


class RunsCode:
    """Unpickled, it would touch the file it names."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_dcp_values_are_read_without_running_code(tmp_path):
    """DCP reads a sharded checkpoint's non-tensor values (the optimizer's lr, betas, names) with torch.load; the
    trainer's planner reads them as weights_only, so a piece file cannot run code either."""
    from sharding import Planner

    planner = Planner(flatten_state_dict=False)
    planner.state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    crafted = io.BytesIO()
    torch.save(RunsCode(tmp_path / "ran"), crafted)
    crafted.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, crafted)
    assert not (tmp_path / "ran").exists()
    value = io.BytesIO()
    torch.save((0.9, 0.95), value)
    value.seek(0)
    planner.load_bytes(item, value)
    assert planner.state_dict["optim.param_groups.0.lr"] == (0.9, 0.95)


def test_the_metadata_reader_builds_only_dcp_classes(tmp_path):
    from sharding import MetadataRefused, read_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(tmp_path / "ran")))
    with pytest.raises(MetadataRefused, match="asks to run posix.system"):
        read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(MetadataRefused, match="holds a dict, not DCP's Metadata"):
        read_metadata(tmp_path)
    assert not (tmp_path / "ran").exists()
