"""Exercise 14: which sequences each rank reads.

Goal: with data parallelism each of world_size ranks reads a different part of every global batch, and
together they read exactly the sequences one process would: none twice, none skipped. The loader
numbers the sequences of the training stream 0, 1, 2, ... and keeps a position (how many all ranks have
consumed so far). Write which sequence numbers a rank reads at its next micro-batch.
In the project: data.py, `TokenLoader.next_batch`.
Check: python exercises/check.py 14
(your indices against the loader's on random positions, batch sizes and world sizes; and one global
batch split over 1, 2, 4 and 8 ranks reads the same sequences)
"""


def rank_sequences(position, rank, world_size, batch_size):
    """The stream indices of the batch_size sequences that rank `rank` of `world_size` reads next, when all
    ranks together have consumed `position` sequences so far."""
    return [position + rank * batch_size + j for j in range(batch_size)]
