"""FSDP (train.data_parallel=fsdp): each rank holds 1/world_size of the weights, gradients and AdamW's state.

DDP keeps the whole model and optimizer on every GPU; FSDP cuts each tensor into one piece per rank, gathers a
block's weights just before the block runs and frees them after, and reduce-scatters the gradients so that each
rank keeps its own piece. PyTorch does the work (FSDP2's `fully_shard`, and torch.distributed.checkpoint, "DCP",
for checkpoints that each rank writes its own piece of); this file only calls it where the trainer needs it:

    shard(model, ...)         train.py's wrap_model: each block, then the whole model
    save_shards(...)          every rank writes its pieces into step<N>.partial/sharded/ (checkpoint.py)
    load_shards(...)          a checkpoint into this run's model and optimizer, whatever world size wrote it
    full_into_sharded(...)    model.pt/optim.pt (a DDP run's) into a sharded model: DDP runs resume as FSDP
    apply(...)                what was read, put into the model and optimizer
    read_tensors(folder)      a sharded checkpoint's tensors put together in one process (sample.py, export-hf,
                              debug.py compare-state)
    read_metadata(folder)     its .metadata, unpickled with DCP's own classes only: a checkpoint is data, never code

DCP reads `.metadata` with a plain pickle.load and the optimizer's small values (lr, betas, names) with
torch.load(weights_only=False): a checkpoint handed over by anyone could run any code it likes. Every read here goes
through `Reader` and `Planner` instead, which allow only the classes a real checkpoint holds.

Imported only by runs and tools that meet FSDP: `import train` does not load it.
"""

import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

FOLDER = "sharded"  # inside a checkpoint folder: DCP's .metadata and one __<rank>_0.distcp file per rank


def shard(model, bf16, compiled):
    """Shard `model` in place: each block is one FSDP unit (its weights are gathered for its forward and backward
    only), then the root takes the rest (embeddings, final norm, output layer). With bf16 (CUDA), the gathered
    weights are bf16 and gradients are reduced in fp32, while each rank's piece and AdamW stay fp32
    (torchtitan's default policy). With torch.compile, each block is compiled on its own, before it is sharded."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for block in model.blocks:
        if compiled:
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


# ----------------------------------------------------------------------------- saving and loading


def save_shards(model, optimizer, partial, group, async_save, tied=()):
    """Every rank writes its pieces of the weights and of the optimizer's state into `partial`/sharded; DCP's
    coordinator (rank 0) writes .metadata once all have written. Returns a Future to wait on when `async_save`
    (the state is copied to CPU memory before this returns, so training may go on), else None. `group`: a gloo
    group of the checkpoint's own, so that an async save's collectives never meet the training's. `tied`: second
    names of a tied weight, left out as model.pt leaves them out (a load puts them back where the model ties)."""
    weights = {name: tensor for name, tensor in get_model_state_dict(model).items() if name not in tied}
    state = {"model": weights, "optim": get_optimizer_state_dict(model, optimizer)}
    where = os.path.join(partial, FOLDER)
    if async_save:
        return dcp.async_save(state, checkpoint_id=where, process_group=group)
    dcp.save(state, checkpoint_id=where, process_group=group)
    return None


def load_shards(path, model, optimizer, tied=None):
    """(model state, optimizer state or None) read from `path`/sharded into templates of this run's model and
    optimizer, each rank reading the pieces it holds (a plain model reads whole tensors): DCP reshards, so any
    world size reads any other's. Apply them with `apply`. `optimizer=None` leaves the optimizer alone.
    `tied`: {second name: first name} of the model's tied weights, stored once."""
    tied = tied or {}
    state = {"model": {name: t for name, t in get_model_state_dict(model).items() if name not in tied}}
    if optimizer is not None:  # (the template creates AdamW's state, with step 0, for DCP to fill)
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    read_into(state, os.path.join(path, FOLDER))
    for name, first in tied.items():
        state["model"][name] = state["model"][first]
    return state["model"], state.get("optim")


def full_into_sharded(model, optimizer, model_state, optim_state):
    """A DDP run's model.pt and optim.pt (whole tensors; the optimizer's state numbered in the order of its
    groups' parameters) as the states `apply(..., full=True)` puts into a sharded model, by parameter name."""
    if optim_state is None:
        return model_state, None
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return model_state, {"state": {order[int(i)]: moments for i, moments in optim_state["state"].items()},
                         "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]}
                                          for g in optim_state["param_groups"]]}


def apply(model, optimizer, model_state, optim_state, full=False):
    """Put the states into the model (and optimizer). `full`: whole tensors, which each rank cuts to its pieces."""
    options = StateDictOptions(full_state_dict=full)
    set_model_state_dict(model, model_state, options=options)
    if optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)


# ----------------------------------------------------------------------------- reading in one process


def tensor_shapes(folder, prefix="model."):
    """{name: (shape, dtype)} of the tensors under `prefix` in a sharded checkpoint folder, read from .metadata
    alone (no weights are read)."""
    metadata = read_metadata(folder).state_dict_metadata
    return {key[len(prefix):]: (tuple(meta.size), meta.properties.dtype) for key, meta in metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}


def read_tensors(folder, prefix="model."):
    """{name: whole tensor on the CPU} of the tensors under `prefix` ("model.": the weights by name;
    "optim.state.": AdamW's moments as "<parameter>.<moment>"), put together from every rank's pieces in this
    one process (DCP without a process group)."""
    state = {prefix + name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in
             tensor_shapes(folder, prefix).items()}
    read_into(state, folder)
    return {key[len(prefix):]: tensor for key, tensor in state.items()}


def read_into(state, folder):
    """dcp.load: each rank's share of `state`'s tensors, or all of them in a process without a process group (which
    DCP announces in a warning that tells a user nothing here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=Reader(folder), planner=Planner(),
                 no_dist=not torch.distributed.is_initialized())


# ----------------------------------------------------------------------------- reading without running code

# What a .metadata may build: DCP's own metadata classes and the torch and standard types they are made of (read off
# the .metadata of a real 2-rank FSDP checkpoint of this trainer, torch 2.13: tests/test_fsdp.py makes one). A dtype
# is any torch.<dtype> (see allowed). Each of these only holds values: building one runs no code of the file's.
METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # which file and bytes hold each piece
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided by its name (a lookup in torch's own table)
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # StorageMeta.checkpoint_id: where it was saved
    ("collections", "OrderedDict"),
}


class MetadataRefused(ValueError):
    """A .metadata that is not DCP's metadata; the message says what it holds instead."""


class MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that builds only METADATA_CLASSES (and torch dtypes): any other name a file asks for, such
    as os.system, is refused before it is looked up (the pickle docs' "Restricting Globals")."""

    def find_class(self, module, name):
        if (module, name) in METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise MetadataRefused(f"it asks to run {module}.{name}")


def read_metadata(folder):
    """A sharded checkpoint folder's .metadata (DCP's Metadata), unpickled with DCP's own classes only; MetadataRefused
    (what the file holds instead) for anything else: another class, another object, bytes that are no pickle."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f).load()
        except MetadataRefused:
            raise
        except Exception as error:  # noqa: BLE001 - random bytes make pickle raise any of several kinds
            raise MetadataRefused(f"it is no pickle DCP wrote ({type(error).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise MetadataRefused(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class Reader(FileSystemReader):
    """DCP's file reader, with .metadata read by read_metadata instead of pickle.load (as FileSystemReader does
    otherwise: the storage_meta and load_id it sets are kept)."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's load planner, with the non-tensor values (the optimizer's lr, betas, group names) read by
    torch.load(weights_only=True), which builds only tensors and plain values, instead of weights_only=False."""

    def load_bytes(self, read_item, value):
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
