# config/ladder_shakespeare.py with Muon for the blocks' matrices (optimizer.py), for
#   python ladder.py compare config/ladder_shakespeare.py config/ladder_shakespeare_muon.py
# Three sizes: on a CPU without native bf16 (AVX2), torch.optim.Muon's Newton-Schulz steps run in bf16 at
# a 13th of float32's speed, and 2x256 would take 80 minutes (docs/measurements.md).
ladder.name = "shakespeare_muon"
ladder.dir = "out/ladder_shakespeare_muon"
ladder.optimizer = "muon"  # the same LR rule: RMS-matched Muon takes AdamW's LR (OLMo-core's muon ladder)
ladder.sizes = ["2x32", "2x64", "2x128"]
ladder.max_devices = 1
ladder.device = "cpu"
ladder.batch_tokens = 512  # as the AdamW ladder: the comparison is at equal tokens and steps
ladder.duration_tokens = 200_000
ladder.chinchilla_multiple = 2
ladder.warmup_tokens = 10_240
ladder.decay_fraction = 0.2
ladder.lr_multiplier = 0.1
ladder.val_tokens = 32768

model.block_size = 64
data.dataset = "shakespeare"
eval.sample_interval = 0
log.interval = 100
