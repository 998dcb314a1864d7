# The GPT-2 model ladder on FineWeb-Edu, for a node of 8 GPUs: five sizes up to GPT-2 (124M), each to
# 4 Chinchilla durations. Prepare the data once: python prepare_data.py fineweb-edu --name sample-10BT
#   python ladder.py dry-run config/ladder_gpt2.py
#   python ladder.py run-all config/ladder_gpt2.py     (each size starts torchrun with its planned GPUs)
#   python ladder.py fit config/ladder_gpt2.py
ladder.name = "gpt2"
ladder.dir = "out/ladder_gpt2"
ladder.sizes = ["4x256", "6x384", "8x512", "10x640", "12x768"]  # GPT-2's aspect ratio; 12x768 is GPT-2 (124M)
ladder.max_devices = 8
ladder.device = "H100"
ladder.chinchilla_multiple = 4  # checkpoints after the decays at 0.5x, 1x, 2x and 4x Chinchilla
ladder.val_tokens = 10 * 2**20  # 10M validation tokens, as config/gpt2.py

# What every size shares.
model.block_size = 1024
data.dataset = "fineweb-edu"
train.dtype = "bfloat16"
train.compile = "true"
eval.sample_interval = 0
eval.tasks = ["hellaswag", "arc_easy"]  # scored at every named checkpoint (the ladder sets eval.fixed_steps)
# `fit` predicts their accuracy at 12x768 in two steps (Bhagia et al. 2024)
ladder.fit_tasks = ["hellaswag", "arc_easy"]
log.interval = 10
