"""Dataset mixtures (data.mix, stage2.mix): several datasets read at fixed shares, as one loader.

Each step's global batch is handed out one sequence at a time to the source furthest below its share
(`allocate`), so after every step each source is within one sequence of its share. The plan depends only on
the counts so far, never on the world size or the micro-batch split, and the counts are the loader's whole
state: a checkpoint resumes it exactly, and a stage that changes the mixture carries each source's position
over by name. data.build_loaders makes one only for a run of several datasets.
"""

import numpy as np


def allocate(counts, start_counts, shares, n):
    """Hand out n sequences one at a time to the source with the largest deficit (share x handed out
    since start_counts, minus what it got). Returns (plan [(source, index in its stream)], new counts)."""
    counts = list(counts)
    handed = sum(counts) - sum(start_counts)
    plan = []
    for _ in range(n):
        handed += 1
        deficits = [share * handed - (c - s) for share, c, s in zip(shares, counts, start_counts)]
        source = int(np.argmax(deficits))  # ties go to the first source
        plan.append((source, counts[source]))
        counts[source] += 1
    return plan, counts


class MixtureLoader:
    """Drop-in for TokenLoader's training use (next_batch, skip_batches, state) over several sources."""

    def __init__(self, mix, sources, *, sequences_per_step, batch_size, rank=0, world_size=1):
        self.names = [name for name, _ in mix]
        self.shares = [share for _, share in mix]
        self.sources = sources  # a TokenLoader of batch_size 1 per source, in mix's order (data.build_loaders)
        self.num_sequences = sum(s.num_sequences for s in self.sources)  # one epoch of every source
        self.sequences_per_step = sequences_per_step
        self.batch_size, self.rank, self.world_size, self.device = batch_size, rank, world_size, sources[0].device
        self.counts = [0] * len(self.names)  # sequences taken from each source, at a step boundary
        self.start_counts = [0] * len(self.names)  # the counts when this mixture began
        self.skipped = [0] * len(self.names)  # of those, sequences passed over by train.steps_to_skip
        self.slot, self.plan, self.next_counts = 0, None, None

    def next_batch(self):
        first = self._take_slots()
        return self.sources[0].to_batch([self.sources[s].sequence(i)
                                         for s, i in self.plan[first : first + self.batch_size]])

    def skip_batches(self, n):
        """train.steps_to_skip: move past n micro-batches (a whole step) unread; they are counted as skipped."""
        before = list(self.counts)
        for _ in range(n):
            self._take_slots()
        self.skipped = [s + after - b for s, after, b in zip(self.skipped, self.counts, before)]

    def _take_slots(self):
        """This rank's first slot in the current global batch (planned on its first micro-batch); moves on."""
        if self.slot == 0:
            self.plan, self.next_counts = allocate(self.counts, self.start_counts, self.shares, self.sequences_per_step)
        first = self.slot + self.rank * self.batch_size
        self.slot += self.world_size * self.batch_size
        if self.slot >= self.sequences_per_step:
            self.counts, self.slot = self.next_counts, 0
        return first

    def metrics(self):
        """data/<source>/sequences: sequences trained on from each source so far, and data/epoch: the pass over all
        the sources' sequences under way, counted from 1 (host numbers: no sync)."""
        return {**{f"data/{name}/sequences": count - skipped
                   for name, count, skipped in zip(self.names, self.counts, self.skipped)},
                "data/epoch": sum(self.counts) // self.num_sequences + 1}

    def state_dict(self):
        return {"mix": self.names, "counts": list(self.counts), "start_counts": list(self.start_counts),
                "skipped": list(self.skipped), "epoch": sum(self.counts) // self.num_sequences}

    def load_state_dict(self, state):
        """Restore every source's position by name. A source new to this run starts at 0, and a changed
        mixture starts its accounting afresh from the restored positions."""
        saved = dict(zip(state.get("mix", []), state.get("counts", [])))
        self.counts = [saved.get(name, 0) for name in self.names]
        skipped = dict(zip(state.get("mix", []), state.get("skipped", [])))
        self.skipped = [skipped.get(name, 0) for name in self.names]
        same_mix = state.get("mix") == self.names
        self.start_counts = list(state["start_counts"]) if same_mix else list(self.counts)
        self.slot = 0
