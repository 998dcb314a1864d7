"""FSDP (train.data_parallel=fsdp): each rank holds 1/world_size of the weights, gradients and
AdamW's state.

DDP keeps the whole model and optimizer on every GPU; FSDP cuts each tensor into one piece per rank,
gathers a block's weights just before the block runs and frees them after, and reduce-scatters the
gradients so that each rank keeps its own piece. PyTorch does the work (FSDP2's `fully_shard`, and
torch.distributed.checkpoint, "DCP", for checkpoints that each rank writes its own piece of); this
file only calls it where the trainer needs it:

    build_for_fsdp(...)       train.py's build_model: the model's shapes, no weights, and a record
                              of how it drew them
    shard_and_fill(...)       train.py's wrap_model: `shard` each block, then the whole model; then
                              `materialise`: each rank fills its own pieces, equal to the weights a
                              whole build would draw
    share_generator(...)      train.py's write_samples: rank 0's sampling generator on every rank
    ShardedCheckpoints        the Checkpointer's sharded saves: `start` has every rank write its
                              pieces into step<N>.partial/sharded/; `whole_weights`, the whole
                              weights on rank 0 (model.pt beside the pieces,
                              checkpoint.unsharded_interval)
    load_shards(...)          a checkpoint into this run's model and optimizer, whatever world size
                              wrote it
    full_into_sharded(...)    model.pt/optim.pt (a DDP run's) into a sharded model: DDP runs resume
                              as FSDP
    apply(...)                what was read, put into the model and optimizer
    read_tensors(folder)      a sharded checkpoint's tensors put together in one process (sample.py,
                              export-hf, debug.py compare-state)
    check_metadata(...)       its .metadata, unpickled with DCP's own classes only (a checkpoint is
                              data, never code), naming only pieces the checkpoint's marker lists

DCP reads `.metadata` with a plain pickle.load and the optimizer's small values (lr, betas, names)
with torch.load(weights_only=False): a checkpoint handed over by anyone could run any code it likes.
Every read here goes through `Reader` and `Planner` instead, which allow only the classes a real
checkpoint holds.

Imported only by runs and tools that meet FSDP: `import train` does not load it.
"""

import os
import pickle
import shutil
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from config import UserError
from model import output_parameters

# Inside a checkpoint folder: DCP's .metadata and one __<rank>_0.distcp file per rank.
FOLDER = "sharded"


def shard(model, bf16, compiled):
    """Shard `model` in place: each block is one FSDP unit (its weights are gathered for its forward
    and backward only), then the root takes the rest (embeddings, final norm, output layer). With
    bf16 (CUDA), the gathered weights are bf16 and gradients are reduced in fp32, while each rank's
    piece and AdamW stay fp32 (torchtitan's default policy). With torch.compile, each block is
    compiled on its own, before it is sharded. score_tokens (the tasks' scoring) gathers the root's
    weights as forward does: FSDP hooks forward alone."""
    if bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    # Read while the model is whole; asked by name once it is sharded (model.py).
    outputs = {id(p) for p in output_parameters(model)}
    model.output_names = [name for name, p in model.named_parameters() if id(p) in outputs]
    for block in model.blocks:
        if compiled:
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    register_fsdp_forward_method(model, "score_tokens")
    return model


def shard_and_fill(model, record, seed, procs, compiled):
    """train.py's wrap_model: `shard` the model; one built on meta (`record`) then gets its pieces,
    drawn from `seed` as a whole build would draw them (`materialise`)."""
    shard(model, bf16=isinstance(procs.autocast, torch.autocast), compiled=compiled)
    if record is not None:
        materialise(model, record, seed, procs.device)


def share_generator(generator):
    """Rank 0's state of `generator` on every rank (train.py's write_samples): each rank runs the
    samples' forwards, which gather weights from all, so all must draw the same tokens."""
    state = [generator.get_state()]
    dist.broadcast_object_list(state, src=0)
    generator.set_state(state[0])


# ------------------------------------------------------------------------- sharded initialisation
# A model too big for one GPU cannot be built whole on one first. So the model is built on the
# `meta` device (shapes, no numbers), sharded, and then each rank fills its own pieces (OLMo-core's
# and torchtitan's order). The pieces must equal what a whole build draws with the same seed (DDP's
# start, and what a resume on another world size expects): while the model is built on meta, every
# operation that creates or initialises a tensor is recorded in order (its constructor's inits, then
# the model's own _init_weights); `materialise` replays them on the CPU, drawing the same random
# numbers in the same order, but holds a whole tensor only from the last operation that overwrites
# all of it to its last operation, then keeps this rank's piece. For GPT-2 that is one parameter at
# a time: a rank's peak is its pieces plus the largest tensor (docs/fsdp.md measures it). A model
# whose init the record cannot replay (an operation that reads another tensor, such as copy_ from a
# table it computed, or a buffer) is built whole on the CPU instead, as before, and the run says so.


@dataclass
class Operation:
    """One recorded operation: `func` (aten) on the tensor `uid` (a view of `size`, `stride`,
    `offset` into a storage of `numel` elements), or creating it (`creates`), with its other
    arguments (no tensors)."""
    func: object
    uid: int
    creates: bool
    size: tuple
    stride: tuple
    offset: int
    numel: int
    dtype: torch.dtype
    args: tuple
    kwargs: dict
    # Every element of the storage gets a value that does not depend on the old ones.
    overwrites: bool


@dataclass
class InitRecord:
    """What building the model on meta did, in order, and which recorded tensor each parameter
    is."""
    operations: list = field(default_factory=list)
    params: dict = field(default_factory=dict)  # parameter name -> uid of the tensor holding it
    unreplayable: str = ""  # why the record cannot be replayed ("" when it can)


class RecordInit(TorchDispatchMode):
    """Records the operations that create or initialise tensors while a model is built on meta."""

    def __init__(self):
        super().__init__()
        self.record = InitRecord()
        self.uids = {}  # a live storage -> the uid of the tensor it holds
        self.uids_given = []
        # uids of tensors computed from other tensors (mul, a table from arange, ...)
        self.computed = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        schema = func._schema.arguments
        first_alias = schema[0].alias_info if schema else None  # how the first argument is used
        in_place = bool(tensors) and first_alias is not None and first_alias.is_write
        if in_place:
            target = args[0]
            uid = self.uids.get(key(target))
            if len(tensors) > 1 or uid is None:  # e.g. copy_ from a computed table: not replayed
                self.refuse(f"{func} reads another tensor")
            else:
                whole = target.numel() == storage_numel(target)
                self.add(func, uid, target, args[1:], kwargs, creates=False,
                         overwrites=whole and (seeded or func in OVERWRITING))
            return out
        for result in (out if isinstance(out, (tuple, list)) else [out]):
            if not isinstance(result, torch.Tensor):
                continue
            if all(key(result) != key(t) for t in tensors):  # a new storage
                # A storage freed and reused gets a new uid.
                self.uids[key(result)] = uid = len(self.uids_given)
                self.uids_given.append(uid)
                if tensors:  # not replayed: a parameter made so is refused (build_on_meta)
                    self.computed.add(uid)
                    if seeded:
                        self.refuse(f"{func} draws random numbers from a tensor's values")
                else:
                    self.add(func, uid, result, args, kwargs, creates=True, overwrites=True)
        return out

    def add(self, func, uid, tensor, args, kwargs, creates, overwrites):
        self.record.operations.append(Operation(
            func, uid, creates, tuple(tensor.shape), tuple(tensor.stride()),
            tensor.storage_offset(), storage_numel(tensor), tensor.dtype, tuple(args), dict(kwargs),
            overwrites))

    def refuse(self, why):
        self.record.unreplayable = self.record.unreplayable or why


# The inits that overwrite without drawing (the random inits are tagged seeded).
OVERWRITING = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}


def key(tensor):
    # The storage, shared by views and by a Parameter and its data.
    return tensor.untyped_storage()._cdata


def storage_numel(tensor):
    return tensor.untyped_storage().nbytes() // tensor.element_size()


def build_on_meta(make_model):
    """(model on meta, InitRecord): `make_model()` run on the meta device, with the record of how it
    initialised."""
    recorder = RecordInit()
    with torch.device("meta"), recorder:
        model = make_model()
    record, computed = recorder.record, recorder.computed
    record.params = {name: recorder.uids.get(key(p)) for name, p in model.named_parameters()}
    if not record.unreplayable:
        written = {op.uid for op in record.operations if op.overwrites}
        odd = [name for name, uid in record.params.items()
               if uid is None or uid in computed or uid not in written]
        if odd:
            record.unreplayable = f"parameter {odd[0]} is computed from other tensors"
        elif any(True for _ in model.buffers()):
            record.unreplayable = "the model has buffers"
    return model, record


def build_for_fsdp(make_model, device, is_master):
    """train.py's build_model under FSDP: (model on meta, InitRecord), or, for a fork's init the
    record cannot replay, (the model built whole on `device`, as DDP builds it, None), which rank 0
    says."""
    model, record = build_on_meta(make_model)
    if not record.unreplayable:
        return model, record
    if is_master:
        print(f"note: the model is built whole on every rank before it is sharded "
              f"({record.unreplayable}, which sharded initialisation cannot replay; docs/fsdp.md).")
    return make_model().to(device), None


@torch.no_grad()
def materialise(model, record, seed, device):
    """Give the sharded meta `model` storage on `device` and fill each rank's pieces: the record
    replayed on the CPU from `seed` (build_model's), each whole tensor held only while it is being
    initialised. The global random state is left as it was."""
    places = {}  # a parameter held under several names (a tied output layer): where each name is
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((module, name))
    model.to_empty(device=device)
    # to_empty gives a plain model's names new tensors: tie them again.
    for (first_module, first_name), *others in places.values():
        for module, name in others:
            if getattr(module, name) is not getattr(first_module, first_name):
                setattr(module, name, getattr(first_module, first_name))
    params = dict(model.named_parameters())
    wanted = {uid: name for name, uid in record.params.items()}
    last_write, last_use = {}, {}
    for i, op in enumerate(record.operations):
        last_use[op.uid] = i
        if op.overwrites:
            last_write[op.uid] = i
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    # uid -> the whole tensor's storage, as a flat CPU tensor, while it is being initialised
    whole = {}
    for i, op in enumerate(record.operations):
        seeded = torch.Tag.nondeterministic_seeded in op.func.tags
        # Overwritten later: only the random numbers it draws matter.
        if i < last_write.get(op.uid, -1):
            if seeded:
                run(op, torch.empty(op.numel, dtype=op.dtype))
            continue
        if op.uid not in whole:
            whole[op.uid] = run(op, None) if op.creates else torch.empty(op.numel, dtype=op.dtype)
        if not op.creates:
            run(op, whole[op.uid])
        if i == last_use[op.uid]:
            storage = whole.pop(op.uid)
            if op.uid in wanted:
                view = storage.as_strided(op.size, op.stride, op.offset)
                fill_piece(params[wanted[op.uid]], view)
    torch.set_rng_state(saved)
    return model


def run(op, storage):
    """Replay `op` on the CPU: into `storage` (a flat tensor viewed as the op's target), or creating
    a new tensor."""
    if op.creates:
        return op.func(*op.args, **{**op.kwargs, "device": torch.device("cpu")}).reshape(-1)
    return op.func(storage.as_strided(op.size, op.stride, op.offset), *op.args, **op.kwargs)


def fill_piece(param, full):
    """Copy this rank's piece of the whole tensor `full` into `param` (a DTensor sharded by FSDP, or
    a plain one)."""
    if not hasattr(param, "device_mesh"):
        param.copy_(full)
        return
    mesh, placements = param.device_mesh, param.placements
    if tuple(placements) == (Shard(0),):  # FSDP2 cuts dim 0 as torch.chunk does
        chunks = torch.chunk(full, mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        piece = chunks[rank] if rank < len(chunks) else full[:0]
    else:  # every rank holds the same whole tensor: no communication needed
        piece = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    param.to_local().copy_(piece)


# ----------------------------------------------------------------------------- saving and loading


def save_shards(model, optimizer, partial, group, async_save, tied=()):
    """Every rank writes its pieces of the weights and of the optimizer's state into
    `partial`/sharded; DCP's coordinator (rank 0) writes .metadata once all have written. Returns a
    Future to wait on when `async_save` (the state is copied to CPU memory before this returns, so
    training may go on), else None. `group`: a gloo group of the checkpoint's own, so that an async
    save's collectives never meet the training's. `tied`: second names of a tied weight, left out as
    model.pt leaves them out (a load puts them back where the model ties)."""
    weights = {name: tensor for name, tensor in get_model_state_dict(model).items()
               if name not in tied}
    state = {"model": weights, "optim": get_optimizer_state_dict(model, parts(optimizer))}
    where = os.path.join(partial, FOLDER)
    if async_save:
        return dcp.async_save(state, checkpoint_id=where, process_group=group)
    dcp.save(state, checkpoint_id=where, process_group=group)
    return None


DCP_ERRORS = (Exception, CheckpointException)  # what DCP raises: its own is a BaseException


class Shards:
    """FSDP's pieces of one checkpoint being written by every rank: `wait()` returns once all are on
    disk."""

    def __init__(self, future):
        # dcp.async_save's, or None when the pieces were written before it was made
        self.future = future

    def wait(self):
        if self.future is not None:
            self.future.result()


class ShardedCheckpoints:
    """How a sharded run (train.data_parallel=fsdp) saves, for checkpoint.py's Checkpointer, made
    once where train.py tests that setting: every rank writes the pieces it holds, through a gloo
    group of the checkpoints' own, so that an async save's collectives never meet the training's."""

    errors = DCP_ERRORS  # what a save raises, on every rank

    def __init__(self):
        self.group = dist.new_group(backend="gloo")

    def start(self, out_dir, step, model, optimizer, is_master, async_save, tied=()):
        """Every rank writes its pieces of the weights and optimizer state into
        step<N>.partial/sharded/; rank 0 first clears what a killed save left there. With
        async_save, they are written in the background. `tied`: second names of a tied weight, left
        out as model.pt leaves them out."""
        partial = os.path.join(out_dir, f"step{step}.partial")
        if is_master:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        dist.barrier(group=self.group)  # the folder is fresh before any rank writes into it
        return Shards(save_shards(model, optimizer, partial, self.group, async_save, tied))

    def whole_weights(self, model, tied=()):
        """The whole weights by name on rank 0's CPU, put together from every rank's pieces ({} on
        the other ranks): checkpoint.unsharded_interval's model.pt. `tied`: second names of a tied
        weight, left out as model.pt does."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {name: t for name, t in get_model_state_dict(model, options=options).items()
                if name not in tied}

    def why_not_saved(self, error):
        """Why DCP's save failed, in a few words, from its error, which gathers every rank's:
        {rank: (error, stack)}."""
        ranks = ", ".join(str(rank) for rank in sorted(error.failures))
        first = error.failures[min(error.failures)][0]
        text = getattr(first, "strerror", None) or (str(first).strip()
                                                    or type(first).__name__).splitlines()[0]
        if "unexpected pos" in text:  # torch.save's zip writer, when a write came up short
            text = "a file was cut short, as on a full disk"
        return f"rank(s) {ranks}: {text[:200]}"


def load_shards(path, model, optimizer, tied=None):
    """(model state, optimizer state or None) read from `path`/sharded into templates of this run's
    model and optimizer, each rank reading the pieces it holds (a plain model reads whole tensors):
    DCP reshards, so any world size reads any other's. Apply them with `apply`. `optimizer=None`
    leaves the optimizer alone. `tied`: {second name: first name} of the model's tied weights,
    stored once."""
    tied = tied or {}
    weights = {name: t for name, t in get_model_state_dict(model).items() if name not in tied}
    state = {"model": weights}
    if optimizer is not None:  # (the template creates AdamW's state, with step 0, for DCP to fill)
        state["optim"] = get_optimizer_state_dict(model, parts(optimizer))
    saved = tensor_shapes(os.path.join(path, FOLDER))  # DCP would cast another dtype in silence
    for name, tensor in state["model"].items():
        if name in saved and saved[name][1] != tensor.dtype:
            raise MetadataRefused(f"{path} holds {name} as {saved[name][1]} and this model as "
                                  f"{tensor.dtype}, which a load would cast in silence; give a "
                                  f"checkpoint this trainer saved.")
    read_into(state, os.path.join(path, FOLDER))
    for name, first in tied.items():
        state["model"][name] = state["model"][first]
    return state["model"], state.get("optim")


def parts(optimizer):
    """The torch optimizers DCP sees: MuonAdamW's two (their states keyed by parameter name, groups
    one after the other, as MuonAdamW.param_groups lists them), or the one optimizer."""
    return list(optimizer.optimizers.values()) if hasattr(optimizer, "optimizers") else optimizer


def full_into_sharded(model, optimizer, model_state, optim_state):
    """A DDP run's model.pt and optim.pt (whole tensors; each optimizer's state numbered in the
    order of its groups' parameters; MuonAdamW's, one such state per optimizer) as the states
    `apply(..., full=True)` puts into a sharded model, by parameter name."""
    if optim_state is None:
        return model_state, None
    names = {id(p): name for name, p in model.named_parameters()}
    by_name = {"state": {}, "param_groups": []}
    inner = optim_state if "param_groups" not in optim_state else {"": optim_state}
    optimizers = parts(optimizer) if hasattr(optimizer, "optimizers") else [optimizer]
    for part, saved in zip(optimizers, inner.values()):
        order = [names[id(p)] for group in part.param_groups for p in group["params"]]
        by_name["state"].update({order[int(i)]: moments for i, moments in saved["state"].items()})
        by_name["param_groups"] += [{**g, "params": [order[int(i)] for i in g["params"]]}
                                    for g in saved["param_groups"]]
    return model_state, by_name


def apply(model, optimizer, model_state, optim_state, full=False):
    """Put the states into the model (and optimizer). `full`: whole tensors, which each rank cuts to
    its pieces."""
    options = StateDictOptions(full_state_dict=full)
    set_model_state_dict(model, model_state, options=options)
    if optim_state is not None:
        set_optimizer_state_dict(model, parts(optimizer), optim_state, options=options)


# ------------------------------------------------------------------------- reading in one process


def tensor_shapes(folder, prefix="model."):
    """{name: (shape, dtype)} of the tensors under `prefix` in a sharded checkpoint folder, read
    from .metadata alone (no weights are read)."""
    metadata = read_metadata(folder).state_dict_metadata
    shapes = {key[len(prefix):]: (tuple(meta.size), meta.properties.dtype)
              for key, meta in metadata.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    # The trainer saves float weights; DCP would cast others in silence.
    for name, (_, dtype) in shapes.items():
        if prefix == "model." and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise MetadataRefused(f"{folder} holds the weight {name} as {dtype}, which this "
                                  f"trainer never saves, so it is not loaded: give a checkpoint "
                                  f"this trainer saved whole.")
    return shapes


def read_tensors(folder, prefix="model."):
    """{name: whole tensor on the CPU} of the tensors under `prefix` ("model.": the weights by name;
    "optim.state.": AdamW's moments as "<parameter>.<moment>"), put together from every rank's
    pieces in this one process (DCP without a process group)."""
    state = {prefix + name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in
             tensor_shapes(folder, prefix).items()}
    read_into(state, folder)
    return {key[len(prefix):]: tensor for key, tensor in state.items()}


def read_into(state, folder):
    """dcp.load: each rank's share of `state`'s tensors, or all of them in a process without a
    process group (which DCP announces in a warning that tells a user nothing here); pieces that
    cannot be read are one sentence."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # A piece that is no torch.save's.
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        try:
            dcp.load(state, storage_reader=Reader(folder), planner=Planner(),
                     no_dist=not torch.distributed.is_initialized())
        except DCP_ERRORS as error:  # a piece's bytes may make torch.load raise any kind
            failures = getattr(error, "failures", None)  # DCP's: {rank: (error, stack)}
            kind = type(failures[min(failures)][0] if failures else error).__name__
            raise MetadataRefused(f"the pieces in {folder} cannot be read ({kind}), so they are "
                                  f"not loaded: get the checkpoint again from where it was made, "
                                  f"or give another one.") from None


# ------------------------------------------------------------------- reading without running code

# What a .metadata may build: DCP's own metadata classes and the torch and standard types they are
# made of (read off the .metadata of a real 2-rank FSDP checkpoint of this trainer, torch 2.13:
# tests/test_fsdp.py makes one). A dtype is any torch.<dtype> (see allowed). Each of these only
# holds values: building one runs no code of the file's.
METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # which file, bytes hold a piece
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided by name (a lookup in torch's table)
    # StorageMeta.checkpoint_id: where it was saved
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class MetadataRefused(UserError):
    """A .metadata that is not DCP's metadata, or pieces it cannot be read from; the message says
    what the file holds instead."""


class MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that builds only METADATA_CLASSES (and torch dtypes): any other name a
    file asks for, such as os.system, is refused before it is looked up (the pickle docs'
    "Restricting Globals")."""

    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in METADATA_CLASSES or is_dtype:
            return super().find_class(module, name)
        raise MetadataRefused(f"it asks to run {module}.{name}")


def read_metadata(folder):
    """A sharded checkpoint folder's .metadata (DCP's Metadata), unpickled with DCP's own classes
    only; MetadataRefused (what the file holds instead) for anything else: another class, another
    object, bytes that are no pickle."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f).load()
        except MetadataRefused:
            raise
        except Exception as error:  # noqa: BLE001 - random bytes make pickle raise any kind
            raise MetadataRefused(f"it is no pickle DCP wrote ({type(error).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise MetadataRefused(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def check_metadata(path, files, marker):
    """`path`/sharded/.metadata unpickled with DCP's own classes only (read_metadata), and every
    piece file it names listed in `files`, the checkpoint's `marker` (checkpoint.py, which refuses
    links first): MetadataRefused, a sentence naming the file, otherwise."""
    folder = os.path.join(path, FOLDER)
    metadata_file = os.path.join(folder, ".metadata")
    if f"{FOLDER}/.metadata" not in files:
        raise MetadataRefused(f"{metadata_file} is not listed in {os.path.join(path, marker)}, so "
                              f"it is not read; give a checkpoint this trainer saved whole.")
    try:
        metadata = read_metadata(folder)
    except MetadataRefused as refused:
        raise MetadataRefused(f"{metadata_file} is not the metadata torch.distributed.checkpoint "
                              f"writes ({refused}), so it is not loaded: get the checkpoint again "
                              f"from where it was made, or give another one.") from None
    problem = piece_problem(metadata, folder)
    if problem:
        raise MetadataRefused(f"{metadata_file} {problem}, so it is not loaded: get the checkpoint "
                              f"again from where it was made, or give another one.")
    pieces = {info.relative_path for info in metadata.storage_data.values()}
    unlisted = sorted(str(name) for name in pieces if f"{FOLDER}/{name}" not in files)
    if unlisted:
        raise MetadataRefused(f"{metadata_file} names {unlisted[0]}, which "
                              f"{os.path.join(path, marker)} does not list (a piece deleted after "
                              f"the save); get the checkpoint again from where it was made, or "
                              f"give another one.")


def piece_problem(metadata, folder):
    """What in `metadata` would make DCP read outside `folder`'s own piece files or past their ends,
    or run a transform this trainer never writes (None when nothing does). DCP writes each piece
    file flat in the folder."""
    sizes = {}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        odd_name = not isinstance(name, str) or name in ("", ".", "..")
        if odd_name or os.path.basename(name) != name or "\\" in name:
            return f"names a piece file {name!r} outside {FOLDER}/"
        if not os.path.isfile(os.path.join(folder, name)):
            continue  # (check_metadata names it: unlisted)
        sizes.setdefault(name, os.path.getsize(os.path.join(folder, name)))
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0
                and offset + length <= sizes[name]):
            return (f"puts {index.fqn} at offset {offset!r}, length {length!r} of {name}, which "
                    f"holds {sizes[name]} bytes")
        if getattr(info, "transform_descriptors", None):
            transforms = list(info.transform_descriptors)
            return f"asks for transforms {transforms!r} on {index.fqn}, which it never writes"
    for key, meta in metadata.state_dict_metadata.items():
        is_tensor = isinstance(meta, TensorStorageMetadata)
        if is_tensor and not isinstance(meta.properties.dtype, torch.dtype):
            return f"gives {key} the dtype {meta.properties.dtype!r}"
    return None


class Reader(FileSystemReader):
    """DCP's file reader, with .metadata read by read_metadata instead of pickle.load (as
    FileSystemReader does otherwise: the storage_meta and load_id it sets are kept)."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's load planner, with the non-tensor values (the optimizer's lr, betas, group names) read
    by torch.load(weights_only=True), which builds only tensors and plain values, instead of
    weights_only=False."""

    def load_bytes(self, read_item, value):
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
