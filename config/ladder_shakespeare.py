# The CPU model ladder: four widths of a 2-layer GPT, 62x apart in non-embedding parameters from the
# smallest to the largest, each trained on 400K Shakespeare tokens with checkpoints after decays at
# 100K, 200K and 400K; a scaling law fitted to the three smaller sizes predicts the largest.
# About 25 minutes on 2 cores for run-all and fit (docs/measurements.md).
#   python ladder.py dry-run config/ladder_shakespeare.py
#   python ladder.py run-all config/ladder_shakespeare.py && python ladder.py fit config/ladder_shakespeare.py
# The rules that differ from the GPU ladder's (configurator/run.py) and the measurements behind them are
# in docs/ladder.md.
ladder.name = "shakespeare"
ladder.dir = "out/ladder_shakespeare"
# width doubling at depth 2: depth did not lower the loss at this scale (docs/ladder.md)
ladder.sizes = ["2x32", "2x64", "2x128", "2x256"]
ladder.max_devices = 1
ladder.device = "cpu"
ladder.batch_tokens = 512  # the same 8 sequences of 64 for every size: the same number of steps per token
ladder.duration_tokens = 200_000  # the duration unit: periods end at 0.5x, 1x, 2x of it
ladder.chinchilla_multiple = 2  # 3 post-decay checkpoints per size, at 100K, 200K and 400K tokens
ladder.warmup_tokens = 10_240  # 20 steps
ladder.decay_fraction = 0.2  # each period ends with a linear decay over its last 20%
ladder.lr_multiplier = 0.1  # Porian's N^(-1/3) rule scaled to the CPU sweep's best LRs (docs/ladder.md)
ladder.val_tokens = 32768  # the first 32K validation tokens, the same for every size

# What every size shares.
model.block_size = 64
data.dataset = "shakespeare"  # prepared automatically on first use
eval.sample_interval = 0  # no samples: the ladder is about the numbers
log.interval = 100
