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

Imported only by runs and tools that meet FSDP: `import train` does not load it.
"""

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
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
    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
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
        dcp.load(state, checkpoint_id=folder, no_dist=not torch.distributed.is_initialized())
