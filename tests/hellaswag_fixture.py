"""Small files in the HellaSwag jsonl format, and a tiny model to score them with."""

import json

import torch

from model import GPT, GPTConfig

CONTEXTS = [
    ("A man is sitting on a roof. He", ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                                        "is holding a rubik's cube.", "starts pulling up roofing on a roof."], 3),
    ("A woman is outside with a bucket and a dog. The dog is running around trying to avoid a bath. She",
     ["rinses the bucket off with soap and blow dry the dog's head.", "uses a hose to keep it from getting soapy.",
      "gets the dog wet, then it runs away again.", "gets into a bath tub with the dog."], 2),
    ("Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes "
     "smiles. Then", [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift, while "
                      "two men supporting the head of the person wearing winter clothes snow as the we girls sled.",
                      ", the man puts on a christmas coat, knitted with netting.", ", the man continues removing "
                      "the snow on his car."], 3),
]


def write_hellaswag(path, copies=4):
    """copies x 3 examples with every field the real file has (ctx, endings, label, ...)."""
    with open(path, "w") as f:
        for i in range(copies):
            for j, (ctx, endings, label) in enumerate(CONTEXTS):
                row = {"ind": 3 * i + j, "activity_label": "test", "ctx_a": ctx, "ctx_b": "", "ctx": ctx,
                       "split": "val", "split_type": "indomain", "label": (label + i) % 4,
                       "endings": endings[i % 4:] + endings[: i % 4], "source_id": "test"}
                f.write(json.dumps(row) + "\n")
    return path


def tiny_model(block_size=64, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size)).eval()
