# A model ladder a laptop CPU trains in about 20 minutes: four sizes, 8x apart in non-embedding
# parameters, each to 2 Chinchilla durations, then a scaling-law fit that predicts the largest.
#   python ladder.py dry-run config/ladder_shakespeare.py
#   python ladder.py run-all config/ladder_shakespeare.py && python ladder.py fit config/ladder_shakespeare.py
ladder.name = "shakespeare"
ladder.dir = "out/ladder_shakespeare"
ladder.sizes = ["1x32", "2x32", "4x32", "8x32"]  # the CPU dial: width 32, depth doubling (configurator/model.py)
ladder.max_devices = 1
ladder.device = "cpu"
ladder.chinchilla_multiple = 2  # checkpoints after the decays at 0.5x, 1x and 2x Chinchilla: 3 points per size
ladder.val_tokens = 65536  # the first 64K validation tokens, the same for every size

# What every size shares.
model.block_size = 64
data.dataset = "shakespeare"  # prepared automatically on first use
eval.sample_interval = 0  # no samples: the ladder is about the numbers
log.interval = 100
