import json

import numpy as np
import pytest
import torch

from data import EOT_TOKEN, DataError, TokenLoader, get_tokenizer
from prepare_data import play_to_text, prepare_text, write_shard, write_shards


def make_dataset(tmp_path, n_train=1000, n_val=200, shards=2):
    d = tmp_path / "ds"
    d.mkdir()
    write_shard(str(d / "val_000000.npy"), np.arange(n_val) % 50000)
    for i in range(shards):
        write_shard(str(d / f"train_{i + 1:06d}.npy"), (np.arange(n_train) + 10_000 * (i + 1)) % 50000)
    return str(d)


def batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_y_is_x_shifted_by_one(tmp_path):
    loader = TokenLoader(make_dataset(tmp_path), "train", batch_size=3, block_size=8)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (3, 8) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_loader_is_deterministic_given_the_seed(tmp_path):
    d = make_dataset(tmp_path)
    a = batches(TokenLoader(d, "train", batch_size=4, block_size=8, shuffle=True, seed=1), 5)
    b = batches(TokenLoader(d, "train", batch_size=4, block_size=8, shuffle=True, seed=1), 5)
    c = batches(TokenLoader(d, "train", batch_size=4, block_size=8, shuffle=True, seed=2), 5)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))


def test_ranks_get_disjoint_sequences_and_together_cover_an_epoch(tmp_path):
    d = make_dataset(tmp_path, n_train=8 * 16 + 1, shards=2)  # 16 sequences per shard, 32 per epoch
    seen = []
    for rank in range(2):
        loader = TokenLoader(d, "train", batch_size=4, block_size=8, rank=rank, world_size=2, shuffle=True, seed=3)
        seen.append({tuple(row.tolist()) for x, _ in batches(loader, 4) for row in x})
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 32


def test_global_batch_is_the_same_for_any_rank_and_micro_batch_split(tmp_path):
    d = make_dataset(tmp_path)
    # One rank, 2 micro-steps of 4 sequences each.
    single = TokenLoader(d, "train", batch_size=4, block_size=8, shuffle=True, seed=0)
    one_rank = torch.cat([x for x, _ in batches(single, 2)])
    # Two ranks, one micro-step of 4 each; and 4 ranks x 1 micro-step of 2.
    two_ranks = torch.cat(
        [
            TokenLoader(
                d, "train", batch_size=4, block_size=8, rank=r, world_size=2, shuffle=True, seed=0
            ).next_batch()[0]
            for r in range(2)
        ]
    )
    four_ranks = torch.cat(
        [
            TokenLoader(
                d, "train", batch_size=2, block_size=8, rank=r, world_size=4, shuffle=True, seed=0
            ).next_batch()[0]
            for r in range(4)
        ]
    )
    assert torch.equal(one_rank, two_ranks) and torch.equal(one_rank, four_ranks)


def test_loader_wraps_counts_epochs_and_restores_its_position(tmp_path):
    d = make_dataset(tmp_path, n_train=8 * 5 + 1, shards=1)  # 5 sequences per epoch
    loader = TokenLoader(d, "train", batch_size=2, block_size=8, shuffle=True, seed=0)
    batches(loader, 3)
    assert loader.state_dict()["epoch"] == 1
    state = json.loads(json.dumps(loader.state_dict()))
    expected = batches(loader, 4)
    resumed = TokenLoader(d, "train", batch_size=2, block_size=8, shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(expected, batches(resumed, 4)))


def test_missing_data_says_which_command_prepares_it(tmp_path):
    with pytest.raises(DataError, match=r"python prepare_data.py fineweb-edu"):
        TokenLoader(str(tmp_path / "fineweb-edu"), "train", batch_size=2, block_size=8)


def test_empty_shard_and_too_short_shard_are_reported(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    write_shard(str(d / "train_000001.npy"), np.array([], dtype=np.uint16))
    with pytest.raises(DataError, match="is empty"):
        TokenLoader(str(d), "train", batch_size=2, block_size=8)
    write_shard(str(d / "train_000001.npy"), np.arange(5))
    with pytest.raises(DataError, match="fewer than block_size"):
        TokenLoader(str(d), "train", batch_size=2, block_size=8)


def test_play_markdown_becomes_plain_play_text():
    md = "# Hamlet\n\n## ACT I\n\n_Enter Ghost_\n\n**HORATIO**  \nFriends to this ground.  \n\\--and more\n"
    assert play_to_text(md) == "Hamlet\n\nACT I\n\nEnter Ghost\n\nHORATIO:\nFriends to this ground.\n--and more\n"


def test_shakespeare_splits_whole_plays_and_prefixes_endoftext(data_root):
    val = np.load(data_root / "shakespeare" / "val_000000.npy")
    train = np.load(data_root / "shakespeare" / "train_000001.npy")
    assert val[0] == EOT_TOKEN and train[0] == EOT_TOKEN
    assert (val == EOT_TOKEN).sum() == 4 and (train == EOT_TOKEN).sum() == 34  # 38 plays
    assert get_tokenizer().decode(val[1:6].tolist()).startswith("A Midsummer")


def test_text_files_are_prepared_into_val_and_train_shards(tmp_path):
    files = []
    for i in range(10):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(f"Document number {i}. " * 50)
        files.append(str(path))
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"json line {i}"}) for i in range(5)))
    prepare_text(str(tmp_path / "out"), files + [str(jsonl)], shard_tokens=1000, val_fraction=0.1, workers=2)
    val = np.load(tmp_path / "out" / "val_000000.npy")
    train = [np.load(p) for p in sorted((tmp_path / "out").glob("train_*.npy"))]
    assert len(train) >= 2 and all(len(t) == 1000 for t in train[:-1])
    assert (np.concatenate([val, *train]) == EOT_TOKEN).sum() == 15  # 10 files + 5 json lines


def test_interrupted_shard_writing_resumes_where_it_stopped(tmp_path):
    docs = [np.full(7, i, dtype=np.uint16) for i in range(20)]  # 140 tokens
    full = tmp_path / "full"
    full.mkdir()
    write_shards(iter(docs), str(full), shard_tokens=30, val_tokens=20)

    def crash_after(n):
        for i, doc in enumerate(docs):
            if i == n:
                raise KeyboardInterrupt
            yield doc

    part = tmp_path / "part"
    part.mkdir()
    with pytest.raises(KeyboardInterrupt):
        write_shards(crash_after(11), str(part), shard_tokens=30, val_tokens=20)
    progress = json.loads((part / "progress.json").read_text())
    assert progress["shards"] == 2 and "done" not in progress
    write_shards(iter(docs[progress["documents"]:]), str(part), 30, 20, start=progress)
    names = sorted(p.name for p in full.glob("*.npy"))
    assert names == sorted(p.name for p in part.glob("*.npy"))
    for name in names:
        assert np.array_equal(np.load(full / name), np.load(part / name))


def test_fineweb_edu_streams_and_resumes_after_an_interruption(tmp_path, monkeypatch):
    import datasets

    import prepare_data

    rows = [{"text": f"Educational web page number {i}. " * 30} for i in range(40)]
    local = tmp_path / "fineweb.jsonl"
    local.write_text("\n".join(json.dumps(r) for r in rows))
    real_load = datasets.load_dataset
    calls = []

    def local_stream(path, name, split, streaming):
        # Stands in for the HF hub: the same streaming IterableDataset, read from a local file.
        calls.append((path, name, split, streaming))
        return real_load("json", data_files=str(local), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", local_stream)
    prepare_data.prepare_fineweb_edu(str(tmp_path / "full"), "sample-10BT", shard_tokens=3000, workers=2)
    assert calls[0] == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)

    class Interrupted:  # a stream that dies after 25 documents, like a lost connection
        def __iter__(self):
            yield from rows[:25]
            raise ConnectionError("stream lost")

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: Interrupted())
    with pytest.raises(DataError, match="after 1 finished shards .*run the same command again"):
        prepare_data.prepare_fineweb_edu(str(tmp_path / "part"), "sample-10BT", shard_tokens=3000, workers=1)
    progress = json.loads((tmp_path / "part" / "progress.json").read_text())
    assert progress["shards"] == 1 and not progress.get("done")  # died inside the second shard
    monkeypatch.setattr(datasets, "load_dataset", local_stream)
    prepare_data.prepare_fineweb_edu(str(tmp_path / "part"), "sample-10BT", shard_tokens=3000, workers=1)
    full = sorted(p.name for p in (tmp_path / "full").glob("*.npy"))
    assert full[-1] == "val_000000.npy" and full[0] == "train_000001.npy" and len(full) == 3  # shard 0 is val
    assert full == sorted(p.name for p in (tmp_path / "part").glob("*.npy"))
    for name in full:
        assert np.array_equal(np.load(tmp_path / "full" / name), np.load(tmp_path / "part" / name))
