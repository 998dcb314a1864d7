# Fine-tune OpenAI's GPT-2 on Shakespeare: nanoGPT's config/finetune_shakespeare.py, for a GPU.
#   python train.py config/finetune_shakespeare.py
# The model's shape comes from the weights (this file sets none); the vocabulary stays GPT-2's 50,257.
# A laptop CPU runs the small GPT-2 for a few steps instead (README.md, "Fine-tuning").
checkpoint.load_path = "gpt2-xl"  # nanoGPT's init_from: gpt2, gpt2-medium, gpt2-large, gpt2-xl or a HF folder
train.out_dir = "out/finetune_shakespeare"

data.dataset = "shakespeare"
model.dropout = 0.0  # as nanoGPT's fine-tuning run (its train.py default); try 0.1 against overfitting

# nanoGPT: batch_size 1 x gradient_accumulation_steps 32 x block_size 1024 = 32,768 tokens per step
data.batch_size = 1
train.total_batch_size = 32 * 1024
train.max_steps = 20  # as nanoGPT; 655K tokens, about half of our 38 plays (nanoGPT has ~300K: 2 epochs)

# a small constant learning rate (nanoGPT: learning_rate 3e-5, decay_lr False)
optim.lr = 3e-5
optim.min_lr = 3e-5
optim.schedule = "constant"
optim.warmup_steps = 0

eval.interval = 5
eval.val_steps = 2  # 2 x 32,768 tokens: about nanoGPT's eval_iters 40 x 1,024
eval.fixed_steps = [0]  # the val loss of GPT-2 itself, before any fine-tuning
eval.sample_interval = 20
checkpoint.interval = 0  # only the final checkpoint (nanoGPT keeps one)
log.interval = 1
