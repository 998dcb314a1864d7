"""Exercise 23: a loss spike in a real run's metrics, and what to do about it.

Goal: long runs sometimes spike: the loss jumps far above where it was, from an update too large (a learning
rate too high for the moment, a bad batch, a numerically unstable layer) that throws the weights somewhere
worse. Find the spikes in a run's losses as the trainer flags them (a loss more than `threshold` nats above the
mean of the previous `window` finite losses, once there are at least 10 of them; a non-finite loss is flagged
by nothing here and joins no mean), then choose the checkpoint to rewind to: the latest one saved before the
update that may have caused the spike. Mind what a step's loss measures: the loss logged at step n is computed
in step n's forward pass, with the weights that step n - 1's update left.
In the project: metrics.py, `LossSpikeDetector` (train.loss_spike_threshold; flagged rows hold
`train/loss_spike`); `--checkpoint.resume_step=N` rewinds a run to its step-N checkpoint
(docs/checkpoints-and-reliability.md, "Rewinding in place"); OLMo rewinds, then changes what caused the spike
(the data order, the learning rate) so it does not happen again.
Check: python exercises/check.py 23
(a real run of a small GPT whose learning rate surges for one step; your spikes against the trainer's flags in
its metrics.jsonl; then the check rewinds that run to the checkpoint you choose, without the surge, and the
spike must be gone)
"""


def find_spikes(losses, threshold, window=50):
    """The steps (counting from 1) whose loss is a spike: `losses` is the loss of each step, in order."""
    spikes, recent = [], []
    for step, loss in enumerate(losses, 1):
        previous = recent[-window:]
        if len(previous) >= 10 and loss > sum(previous) / len(previous) + threshold:
            spikes.append(step)
        if loss == loss and abs(loss) != float("inf"):
            recent.append(loss)
    return spikes


def rewind_step(spike_step, checkpoint_steps):
    """The step of the checkpoint to rewind to after a spike first flagged at `spike_step`, among the steps
    `checkpoint_steps` at which the run saved checkpoints; None when none is early enough."""
    early_enough = [step for step in checkpoint_steps if step <= spike_step - 2]
    return max(early_enough, default=None)
