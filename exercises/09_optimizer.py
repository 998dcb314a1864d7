"""Exercise 9: AdamW against Muon on the same tokens.

Goal: decide which parameters each optimizer owns. AdamW decays the matrices (weights of matmuls and
embeddings) but not biases or LayerNorm gains; optim.decay_embeddings=false also spares the
embeddings. With optim.name=muon, Muon takes the 2-D weights inside the transformer blocks and AdamW
keeps everything else: the embeddings (the token embedding is the output layer too), biases and gains.
In the project: optimizer.py, `param_groups` (the split) and `build_optimizer` (which builds the two
optimizers from it); the dry run prints the split (`python train.py --optim.name=muon --dry_run`).
Check: python exercises/check.py 9
(your split against the project's, parameter by parameter, on random model shapes and settings; then,
that split being the project's, two short training runs on the same tokens, one with AdamW and one with Muon)
"""


def param_groups(model, optim):
    """{group name: [parameters]} for a model.GPT and the `optim` config section (config.OptimConfig):
    "decay" (AdamW with weight decay), "no_decay" (AdamW without) and, only when optim.name is "muon",
    "muon". Every parameter of the model in exactly one group.
    """
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    block_matrices = {id(p) for block in model.transformer.h for p in block.parameters() if p.dim() == 2}
    groups = {"decay": [], "no_decay": []}
    if optim.name == "muon":
        groups["muon"] = []
    for p in model.parameters():
        if optim.name == "muon" and id(p) in block_matrices:
            groups["muon"].append(p)
        elif p.dim() == 2 and (optim.decay_embeddings or id(p) not in embeddings):
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    return groups
