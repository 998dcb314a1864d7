"""GPT-2 weights in and out of the Hugging Face format.

Import: OpenAI's GPT-2 (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`, from the HF hub) or any
local folder written by `GPT2LMHeadModel.save_pretrained`, mapped into our `GPT`. Export: a `GPT` to
a folder that `GPT2LMHeadModel.from_pretrained` and `GPT2TokenizerFast.from_pretrained` load.

HF's GPT-2 stores its linear layers as `Conv1D`, whose weight is the transpose of `nn.Linear`'s;
that is the only difference in layout. Both ways go by weight name, so a fork of model.py maps where
GPT-2 can hold it: an untied output layer exports as GPT-2 with `tie_word_embeddings=False`, a model
without a position table (NoPE) or without biases as GPT-2 with those weights zero (the same
logits). An export is checked by its result: the folder GPT-2 loads must give the model's own
logits, or it is refused in one sentence and not written (a fork that computes something else: RoPE,
a soft-cap, RMSNorm); so is a weight GPT-2 has no place for, or of another shape. `transformers` is
optional: only these paths need it.
"""

import dataclasses
import json
import os
import re
import shutil
import tempfile

from config import UserError
from data import EOT_TOKEN, GPT2_VOCAB_SIZE, gpt2_tokenizer_files
from model import GPT, GPTConfig, output_parameters

OPENAI_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                   "mlp.c_proj.weight")
# What save_pretrained writes the weights as: one file, or an index of shards (large models).
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                   "pytorch_model.bin.index.json")


class WeightsError(UserError):
    """Weights that cannot be loaded or written; the message says what to do."""


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise WeightsError("loading or writing Hugging Face GPT-2 weights needs the transformers "
                           "package; install it with `pip install transformers`.") from None
    return transformers


def read_json(path):
    """The JSON object in the file at `path`, or None when there is none (missing, cut off, not an
    object)."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):  # ValueError: not JSON, or not text
        return None
    return value if isinstance(value, dict) else None


def is_hf_folder(path):
    """Whether `path` is a Hugging Face model folder: a config.json naming a model_type, beside
    weights. This project's run folders hold a config.json too (the run's settings) but no such
    weights, and must load even when their config.json is damaged: an unreadable one is "not a HF
    folder"."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in HF_WEIGHT_FILES):
        return False
    config = read_json(os.path.join(path, "config.json"))
    return config is not None and "model_type" in config


# What model.py computes, as GPT-2's config.json says it; a folder that asks for anything else would
# load without an error and give other logits (a ReLU MLP, another LayerNorm epsilon), so it is
# refused.
WHAT_MODEL_PY_COMPUTES = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"),
                          "layer_norm_epsilon": (1e-5,),
                          "scale_attn_weights": (True,),
                          "scale_attn_by_inverse_layer_idx": (False,),
                          "reorder_and_upcast_attn": (False,), "add_cross_attention": (False,)}


def check_gpt2_config(source, hf_config):
    """One sentence unless the config.json of a local folder is a GPT-2 that model.py computes
    exactly."""
    if hf_config is None:
        raise WeightsError(f"{source}/config.json is missing or not valid JSON; write the folder "
                           "again with save_pretrained.")
    if hf_config.get("model_type") != "gpt2":
        raise WeightsError(f"{source} holds a {hf_config.get('model_type')} model, not a GPT-2; "
                           "give a GPT-2 folder.")
    for name, allowed in WHAT_MODEL_PY_COMPUTES.items():
        if name in hf_config and hf_config[name] not in allowed:
            raise WeightsError(f"{source}/config.json sets {name}={hf_config[name]!r}, which "
                               f"model.py does not compute (it computes {allowed[0]!r}), so its "
                               "logits would be wrong; give a GPT-2 with GPT-2's settings.")
    if hf_config.get("n_inner") not in (None, 4 * hf_config.get("n_embd", 0)):
        raise WeightsError(f"{source}/config.json sets n_inner={hf_config['n_inner']}, and "
                           "model.py's MLP is 4 x n_embd wide; give a GPT-2 with GPT-2's settings.")


def hf_gpt2(source):
    """GPT2LMHeadModel from an OpenAI GPT-2 name or a local HF GPT-2 folder, its sizes checked
    against its config."""
    transformers = require_transformers()
    if os.path.isdir(source):
        check_gpt2_config(source, read_json(os.path.join(source, "config.json")))
    # A local folder loads in a moment: no progress bar, so a refusal after it stays one line (a
    # download keeps its bar)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    if os.path.isdir(source):
        transformers.utils.logging.disable_progress_bar()
    try:
        # Sizes that disagree with config.json come back in `info` instead of raising (or, in
        # transformers 5, of being silently initialized at random): check_weights_match_config words
        # them.
        hf_model, info = transformers.GPT2LMHeadModel.from_pretrained(
            source, output_loading_info=True, ignore_mismatched_sizes=True)
    except OSError as error:
        raise WeightsError(f"could not load {source!r} from the Hugging Face hub or disk "
                           f"({error.__class__.__name__}); when offline, give a local folder "
                           "written by save_pretrained.") from None
    # a cut-off weights file (SafetensorError), n_head not dividing n_embd, ...
    except Exception as error:
        reason = (str(error).splitlines() or [""])[0].rstrip(".")
        raise WeightsError(f"{source} is not a loadable GPT-2 ({type(error).__name__}: {reason}); "
                           "write it again with save_pretrained, or download it again.") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    check_weights_match_config(source, hf_model, info)
    # transformers 5 keeps a folder's own dtype (fp16 here would put 1e-3 between its logits and
    # ours): the model is compared, and loaded, in float32, as this trainer holds weights
    return hf_model.float()


def import_hf(source, gpt=GPT):
    """A GPT of class `gpt` (model.py's, as edited, or that of the file train.model_module names:
    checkpoint.gpt_class) with the weights of an OpenAI GPT-2 name or a local HF GPT-2 folder,
    refused in one sentence unless it gives transformers' GPT-2 logits on a few tokens: a fork that
    computes otherwise would sample and score another model under GPT-2's name."""
    hf_model = hf_gpt2(source)
    c = hf_model.config
    # Keep GPT-2's own 50,257-token vocabulary: padding rows would change the softmax and the loss.
    config = GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer,
                       n_head=c.n_head, n_embd=c.n_embd, dropout=0.0, bias=True)
    model = gpt(config)
    gpt2_weights_into(model, hf_model, source)
    difference = logits_difference(model, hf_model, length=32)
    if difference is not None:
        raise WeightsError(f"{source}'s weights give other logits in this model than in GPT-2 (up "
                           f"to {difference:.3g} apart on a few tokens), so the model code "
                           "computes something else (a fork of its layers, attention or logits); "
                           "load GPT-2 with GPT-2's model.py.")
    return model


def logits_use_the_embedding(model, state):
    """Whether `model`'s logits multiply by its token embedding (GPT-2's tie), asked of the model,
    not read from a name: a fork may have no lm_head at all. `state`: its state_dict."""
    embedding = state.get("transformer.wte.weight")
    return embedding is not None and any(p.data_ptr() == embedding.data_ptr()
                                         for p in output_parameters(model))


def gpt2_weights_into(model, hf_model, source):
    """GPT-2's weights (Hugging Face's names and Conv1D layout) into `model` by name, the position
    table cropped to its block_size (nanoGPT's crop_block_size). A weight one side has and the other
    has not, or of another shape, is one sentence: a fork that drops the position table or adds a
    gain cannot take GPT-2's weights. GPT-2's lm_head.weight is its token embedding: a model whose
    `logits` multiply by the token embedding has it already."""
    import torch

    # (older transformers saved attention masks too)
    buffers = {name for name, _ in hf_model.named_buffers()}
    hf_state = {key: value for key, value in hf_model.state_dict().items() if key not in buffers}
    ours = model.state_dict()
    tied = logits_use_the_embedding(model, ours)
    their_embedding = hf_state["transformer.wte.weight"]
    their_output = hf_state.get("lm_head.weight", their_embedding)
    if (tied and their_output.data_ptr() != their_embedding.data_ptr()
            and not torch.equal(their_output, their_embedding)):
        raise WeightsError(f"{source} has an output layer of its own (tie_word_embeddings=false), "
                           "and this model's logits multiply by its token embedding; untie them in "
                           "model.py to load it.")
    theirs = {key: value for key, value in hf_state.items()
              if key in ours or not (key == "lm_head.weight" and tied)}
    unplaced = [key for key in theirs if key not in ours]
    unplaced += [key for key in ours if key not in theirs]
    if unplaced:
        raise WeightsError(f"GPT-2's weights and this model's differ at {unplaced[0]} (one side "
                           f"has it, the other has not), so {source} cannot be loaded into it; "
                           "fine-tune model.py's GPT-2, or train this model from scratch.")
    for key, value in theirs.items():
        value = value.t() if key.endswith(CONV1D_SUFFIXES) else value
        value = value[: model.config.block_size] if key == "transformer.wpe.weight" else value
        if value.shape != ours[key].shape:
            raise WeightsError(f"GPT-2's {key} is {tuple(value.shape)} and this model's is "
                               f"{tuple(ours[key].shape)}, so {source} cannot be loaded into it; "
                               "fine-tune model.py's GPT-2, or train this model from scratch.")
        ours[key].copy_(value)


def is_gpt2_source(source):
    """An OpenAI GPT-2 name or a local Hugging Face folder: weights to start from, not a checkpoint
    of ours."""
    return bool(source) and (source in OPENAI_MODELS or is_hf_folder(source))


def gpt2_shape(source):
    """The model fields of a GPT-2 source, from its config.json alone (for a name, the hub's:
    downloaded once, then read from the Hugging Face cache)."""
    transformers = require_transformers()
    if os.path.isdir(source):
        check_gpt2_config(source, read_json(os.path.join(source, "config.json")))
    try:
        c = transformers.GPT2Config.from_pretrained(source)
    except OSError as error:
        raise WeightsError(f"could not read the config of {source!r} from the Hugging Face hub or "
                           f"disk ({error.__class__.__name__}); when offline, give a local folder "
                           "written by save_pretrained.") from None
    return {"block_size": c.n_positions, "vocab_size": c.vocab_size, "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_embd": c.n_embd, "bias": True}


def check_weights_match_config(source, hf_model, info):
    """A WeightsError naming what of config.json disagrees with the weights, when loading reported
    tensors the config asks for and the weights lack, tensors it has no place for, or other sizes.
    """
    # A tied output layer is the token embedding: a weights file need not hold it twice (an untied
    # one, it must).
    missing = set(info["missing_keys"])
    if hf_model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    unexpected = set(info["unexpected_keys"])
    mismatched = {key: saved for key, saved, _ in info["mismatched_keys"]}
    if not (missing or unexpected or mismatched):
        return
    # The shape of every tensor in the weights (None: one the model has no place for), and what they
    # imply.
    shapes = {key: value.shape for key,
              value in hf_model.state_dict().items() if key not in missing}
    shapes |= {key: None for key in unexpected} | mismatched
    wte = next((shape for key, shape in shapes.items() if key.endswith("wte.weight") and shape),
               (None, None))
    wpe = next((shape for key, shape in shapes.items() if key.endswith("wpe.weight") and shape),
               (None, None))
    layers = {match.group(1) for key in shapes if (match := re.search(r"(?:^|\.)h\.(\d+)\.", key))}
    c = hf_model.config
    for name, in_weights in (("n_layer", len(layers)), ("vocab_size", wte[0]), ("n_embd", wte[1]),
                             ("n_positions", wpe[0])):
        if in_weights is not None and in_weights != getattr(c, name):
            raise WeightsError(f"{source}/config.json says {name}={getattr(c, name)} but its "
                               f"weights are for {name}={in_weights}; fix config.json or write the "
                               "folder again with save_pretrained.")
    key = sorted(missing | unexpected | set(mismatched))[0]
    if key in missing:
        why = "missing"
    elif key in unexpected:
        why = "unexpected"
    else:
        why = "another size"
    raise WeightsError(f"{source}/config.json does not match the weights at {key} ({why}); fix "
                       "config.json or write the folder again with save_pretrained.")


def check_export_target(out_dir):
    if not out_dir:  # "" is no folder: os.makedirs would fail only after the (slow) load
        raise WeightsError("the output folder is an empty name; give a new folder to export into.")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise WeightsError(f"{out_dir} is not empty (or not a folder); give a new folder to export "
                           "into.")


def export_hf(model, out_dir):
    """Write `model` (a GPT on the CPU) as a Hugging Face GPT-2 folder (weights, config, tokenizer),
    checked by its result: the folder is written beside `out_dir` under a temporary name, loaded
    back with `transformers`, and renamed to `out_dir` only when its logits are the model's own
    (`model.logits`) on a fixed batch. A fork GPT-2 cannot compute (RoPE, a soft-cap, RMSNorm,
    another MLP) is refused in one sentence, and nothing is left behind."""
    transformers = require_transformers()
    check_export_target(out_dir)
    c = model.config
    ours = model.state_dict()
    tied = logits_use_the_embedding(model, ours)
    hf_config = transformers.GPT2Config(vocab_size=GPT2_VOCAB_SIZE, n_positions=c.block_size,
                                        n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
                                        activation_function="gelu_new",
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        bos_token_id=EOT_TOKEN, eos_token_id=EOT_TOKEN,
                                        tie_word_embeddings=tied)
    hf_model = transformers.GPT2LMHeadModel(hf_config)
    hf_state = hf_model.state_dict()
    gpt2_form = {key: gpt2_form_of(key, value) for key, value in ours.items()}
    for key, value in gpt2_form.items():
        if key not in hf_state:
            raise WeightsError("this model has a weight a Hugging Face GPT-2 has no place for "
                               f"({key}, {tuple(value.shape)}); export-hf writes GPT-2's layout, "
                               "so keep the checkpoint as it is, or teach hf.export_hf where it "
                               "goes.")
        if value.shape != hf_state[key].shape:  # (both said in this model's orientation)
            theirs = hf_state[key].t() if key.endswith(CONV1D_SUFFIXES) else hf_state[key]
            raise WeightsError(f"this model's {key} is {tuple(ours[key].shape)} where a Hugging "
                               f"Face GPT-2's is {tuple(theirs.shape)}, so GPT-2 cannot hold it; "
                               "keep the checkpoint as it is, or teach hf.export_hf where it goes.")
        hf_state[key].copy_(value)
    for key in hf_state.keys() - gpt2_form.keys() - {"lm_head.weight"}:
        # Without biases (model.bias=False) or a position table (NoPE), GPT-2 adding zeros computes
        # the same; anything else missing is left to the check below.
        if key.endswith(".bias") or key == "transformer.wpe.weight":
            hf_state[key].zero_()
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.", dir=parent)
    try:
        hf_model.save_pretrained(staging)
        check_same_logits(model, transformers.GPT2LMHeadModel.from_pretrained(staging))
        # GPT-2's tokenizer files under the names HF expects (vocab.json = encoder.json, merges.txt
        # = vocab.bpe).
        data = gpt2_tokenizer_files()
        shutil.copyfile(os.path.join(data, "encoder.json"), os.path.join(staging, "vocab.json"))
        shutil.copyfile(os.path.join(data, "vocab.bpe"), os.path.join(staging, "merges.txt"))
        # Loading from the folder (the same call in transformers 4 and 5) and saving adds
        # tokenizer.json and tokenizer_config.json, so AutoTokenizer finds everything.
        transformers.AutoTokenizer.from_pretrained(staging).save_pretrained(staging)
        # onto a missing or empty folder (check_export_target): all of it, or nothing
        os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote a Hugging Face GPT-2 model to {out_dir} (its logits checked against the model's)")


def gpt2_form_of(key, value):
    """One of our weights as GPT-2 stores it: Conv1D's transpose, and GPT-2's 50,257 vocabulary
    rows."""
    if key in ("transformer.wte.weight", "lm_head.weight"):
        value = value[:GPT2_VOCAB_SIZE]  # drop the rows that only pad the vocabulary
    return value.t() if key.endswith(CONV1D_SUFFIXES) and value.dim() == 2 else value


def check_same_logits(model, hf_model):
    """One sentence unless GPT-2 in transformers gives `model`'s logits (logits_difference) on rows
    as long as the model reads: a fork that differs only past some position, a sliding window, is
    seen."""
    difference = logits_difference(model, hf_model, model.config.block_size)
    if difference is not None:
        raise WeightsError("the exported GPT-2 gives other logits than this model (they differ by "
                           f"up to {difference:.3g} on a fixed batch), so GPT-2 does not compute "
                           "what it computes (a fork of its layers, attention or logits); nothing "
                           "was written, and the checkpoint serves as it is.")


def logits_difference(model, hf_model, length, tolerance=1e-4):
    """None when GPT-2 in transformers gives `model`'s logits over GPT-2's vocabulary within
    float32's tolerance on a fixed batch, else the largest difference: two rows of random tokens
    `length` long (at most block_size), the second with <|endoftext|> every 16 tokens from the 8th
    (a fork that treats document boundaries otherwise is seen too). A row at a time: at 1,024
    positions its logits are 200 MB."""
    import torch

    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, GPT2_VOCAB_SIZE, (2, min(length, model.config.block_size)),
                         generator=generator)
    rows[1, min(7, rows.size(1) - 1)::16] = EOT_TOKEN
    was_training = model.training
    model.eval()
    differences, largest = [], []
    device = next(model.parameters()).device
    with torch.no_grad():
        for idx in rows.split(1):
            # through its `logits`
            ours = model(idx.to(device))[..., :GPT2_VOCAB_SIZE].float().cpu()
            theirs = hf_model.eval()(idx).logits.float()
            differences.append((ours - theirs).abs().max())
            largest.append(ours.abs().max())
    model.train(was_training)
    difference = torch.stack(differences).max().item()  # (a NaN in either row is the maximum)
    if difference <= tolerance * max(1.0, torch.stack(largest).max().item()):  # NaN fails too
        return None
    return difference


# -------------------------------------------------------- fine-tuning: GPT-2's weights as a start


def load_gpt2_weights(model, source):
    """GPT-2's weights (a name or a HF folder) into `model`, whose shape came from the source
    (use_source_shape). A model that computes otherwise than GPT-2 with them (a fork being
    fine-tuned from GPT-2) is said in a note."""
    import torch.distributed as dist

    hf_model = hf_gpt2(source)
    gpt2_weights_into(model, hf_model, source)
    difference = logits_difference(model, hf_model, length=32)
    if difference is not None and not (dist.is_initialized() and dist.get_rank() != 0):
        print(f"note: {source}'s weights give other logits in this model than in GPT-2 (up to "
              f"{difference:.3g} apart on a few tokens): the model code computes otherwise, so the "
              "run fine-tunes them as another model", flush=True)


SHAPE_FIELDS = [f.name for f in dataclasses.fields(GPTConfig) if f.metadata["role"] == "identity"]


def use_source_shape(shape, model_config, source, what, default_config=False,
                     key="checkpoint.load_path"):
    """Fine-tuning GPT-2: the model's shape comes from `shape` (the source's, or the fine-tune's own
    checkpoint's), set into `model_config`. A field the config set to another value is refused,
    naming it; model.block_size may shrink (never grow). A value at its dataclass default counts as
    unset."""
    default = dataclasses.asdict(type(model_config)())
    # (a field edited into GPTConfig keeps its own)
    for name in (name for name in SHAPE_FIELDS if name in shape):
        value, mine = shape[name], getattr(model_config, name)
        if mine == default[name]:
            setattr(model_config, name, value)
        elif mine != value and not (name == "block_size" and mine < value):
            grow = ""
            if name == "block_size":
                grow = " (it may shrink, to crop the position embeddings, never grow)"
            where = " (in config/shakespeare.py, the default config file)" if default_config else ""
            raise WeightsError(f"{key}={source} is {what} with model.{name}={value}, and this run "
                               f"sets model.{name}={mine}{where}{grow}; the shape comes from the "
                               "weights, so leave it out, as `python train.py "
                               f"config/finetune_shakespeare.py --{key}={source}` does.")
