# GPT-2 (124M) on FineWeb-Edu 10B tokens: the build-nanogpt reproduction.
# Prepare the data once: python prepare_data.py fineweb-edu --name sample-10BT
# Run: torchrun --nproc-per-node=8 train.py config/gpt2.py
model.n_layer = 12
model.n_head = 12
model.n_embd = 768
model.block_size = 1024
model.vocab_size = 50304

data.dataset = "fineweb-edu"
data.batch_size = 64  # 64 x 1024 tokens per GPU per micro-step fits an 80 GB GPU
train.total_batch_size = 524288  # 2**19 tokens, ~0.5M as in GPT-3's 125M model
train.max_steps = 19073  # 10B tokens / 524,288 tokens per step
train.dtype = "bfloat16"
train.compile = "true"
train.out_dir = "out/gpt2"

optim.lr = 6e-4  # GPT-3 paper, table 2.1, 125M model
optim.min_lr = 6e-5
optim.warmup_steps = 715  # 375M tokens, as GPT-3
optim.weight_decay = 0.1
optim.beta1 = 0.9
optim.beta2 = 0.95
optim.eps = 1e-8
optim.grad_clip = 1.0

eval.interval = 250
eval.val_steps = 20  # 20 x 524,288 = 10M validation tokens each time
eval.sample_interval = 1000
eval.tasks = ["hellaswag"]  # all 10,042 examples, split across the GPUs: eval/hellaswag/acc_norm
eval.tasks_interval = 250
log.interval = 10

checkpoint.interval = 1000
checkpoint.keep_last = 3
checkpoint.ephemeral_interval = 250  # lose at most 250 steps to a crash without a SIGTERM
checkpoint.async_save = True  # the GPU keeps training while rank 0 writes ~1.5 GB
