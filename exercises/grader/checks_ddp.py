"""The checks of data parallelism, run for real: torchrun starts two gloo processes that run the student's
function (grading.py's `ranks=2`), and the gradients every rank ends with come back. The truth is one process
that computes the gradient of the whole batch, here: 15 averaging the gradients by hand, 20 DDP's own
all-reduce with `no_sync` during accumulation, as train.py's `train_step` does it.

For 20 the grading side also keeps what DDP's all-reduce did (AllReduceCounter): each bucket's values go through
this process, which holds them and decides on them alone, against what it computes itself: the bucket layout DDP
makes (`ddp_buckets`: one bucket at step 1, the rebuilt ones after), the rank's own gradient in those buckets,
and the rank's final gradients against the means it sent back. Nothing in the answer's process (feed_ddp.py)
takes part in the verdict: the answer can rebind anything there. An answer that rebuilt DDP's bucketing by hand
and sent exactly DDP's buckets, its own gradients in them, would pass: that is DDP's work done again, which no
check outside the process tells apart.
"""

import os
import random
import socket
import tempfile
import threading

import torch

from exercises.grader.checking import ExerciseFailed, compared, gradients, is_close, shown, tiny_gpt
from exercises.grader.feed_ddp import (BUCKET_CAP_MB, HALF, averaging_answers, batch, no_sync_answers,
                                       no_sync_batches, receive_frame, send_frame)


def whole_batch_gradient(seed, x, y):
    """What one process computes: the mean loss over every sequence, and its gradient."""
    model = tiny_gpt(seed)
    loss = model(x, y)
    loss.backward()
    return gradients(model), loss.item()


def agree(grads):
    return all(torch.equal(grads[0][n], other[n]) for other in grads[1:] for n in grads[0] if grads[0][n] is not None)


def equal(mine, want):
    return all(m is not None and torch.allclose(m, w, rtol=1e-4, atol=1e-7) for m, w in zip(mine.values(),
                                                                                            want.values()))


def scaled(grads, factor):
    return {name: g * factor for name, g in grads.items()}


# ----------------------------------------------------------------------------- 15. averaging by hand


def check_ddp(answers):
    seed = random.randrange(2**31)
    running = answers.start(averaging_answers, seed, ranks=2)
    x, y = batch(seed, 2 * HALF)
    want, _ = whole_batch_gradient(seed, x, y)
    halves = [whole_batch_gradient(seed, x[r * HALF:(r + 1) * HALF], y[r * HALF:(r + 1) * HALF])[0] for r in (0, 1)]
    ranks = running.result()
    if not agree(ranks):
        advice = ("each rank kept the gradient of its own half: all-reduce them, so every rank holds the same"
                  if all(equal(mine, half) for mine, half in zip(ranks, halves)) else
                  "all-reduce the gradients so every rank holds the same")
        raise ExerciseFailed(f"after your averaging the 2 ranks hold different gradients: {advice}.")
    if not equal(ranks[0], want):
        if equal(ranks[0], scaled(want, 2)):
            advice = "the ranks agree on the sum of their gradients: divide it by world_size (the mean, not the sum)"
        elif equal(ranks[0], halves[0]) or equal(ranks[0], halves[1]):
            advice = ("every rank holds one rank's gradient (a broadcast), which saw half the batch: sum all the "
                      "ranks' gradients (all_reduce) and divide by world_size, so every rank holds the mean")
        else:
            advice = "every rank must hold the mean of all the ranks' gradients"
        raise ExerciseFailed(f"the 2 ranks agree, but not with one process that saw the whole batch: {advice}.")
    return "torchrun ran 2 gloo processes with your averaging, and every rank holds one process's gradient."


# ----------------------------------------------------------------------------- 20. DDP with no_sync


class AllReduceCounter:
    """Where DDP's all-reduces of exercise 20 happen, counted: a Unix socket in the answers' folder (`folder`, which
    the sandbox shares) to which each rank's communication hook (feed_ddp.all_reduce_by_the_grader, registered
    before the answer gets the model) sends the values of every bucket DDP all-reduces. Threads of this process,
    which loads no answer, average the two ranks' k-th buckets, send the mean back to both, and keep per rank and
    step each bucket received and each mean sent: what the verdict reads. An answer that skips DDP's all-reduce
    (no_sync throughout, then dist.all_reduce by hand) leaves nothing here, and nothing in the answer's process
    holds this count."""

    def __init__(self, folder):
        self.folder = tempfile.TemporaryDirectory(prefix="exercise-all-reduce-", dir=folder)
        os.chmod(self.folder.name, 0o711)  # the answer's user reaches the socket, and lists nothing
        self.address = os.path.join(self.folder.name, "socket")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.address)
        os.chmod(self.address, 0o666)
        self.server.listen()
        # rank: [[each bucket it sent] of each step], and [[the mean sent back for each] of each step]
        self.buckets, self.means = {0: [[]], 1: [[]]}, {0: [[]], 1: [[]]}
        self.waiting, self.lock = {}, threading.Lock()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        ranks = []
        while len(ranks) < 2:
            try:
                connection, _ = self.server.accept()
                header, _ = receive_frame(connection)
            except (OSError, ValueError):
                return
            if header.get("rank") in (0, 1) and header["rank"] not in ranks:
                ranks.append(header["rank"])
                threading.Thread(target=self.serve_rank, args=(connection, header["rank"]), daemon=True).start()

    def serve_rank(self, connection, rank):
        """Average this rank's buckets, the k-th with the other rank's k-th, until it hangs up."""
        count = 0
        try:
            while True:
                header, bucket = receive_frame(connection)
                if bucket is None:  # the end of a step, or nothing this process reads
                    if "step_done" in header:
                        self.buckets[rank].append([])
                        self.means[rank].append([])
                    continue
                self.buckets[rank][-1].append(bucket)
                means = self.means[rank][-1]
                with self.lock:
                    other = self.waiting.pop(count, None)
                    if other is None:
                        self.waiting[count] = (connection, bucket, means)
                count += 1
                if other is not None:
                    other_connection, other_bucket, other_means = other
                    if other_bucket.numel() != bucket.numel():  # the ranks disagree on DDP's buckets: no mean
                        other_connection.close()
                        break
                    mean = (bucket + other_bucket) / 2
                    means.append(mean)
                    other_means.append(mean)
                    send_frame(connection, {}, mean)
                    send_frame(other_connection, {}, mean)
        except (OSError, ValueError):
            pass
        finally:
            connection.close()

    def step(self, kept, rank, step):
        """What `kept` (self.buckets or self.means) holds for `rank` at `step` (1 or 2)."""
        return kept[rank][step - 1] if step <= len(kept[rank]) else []

    def close(self):
        self.server.close()
        self.folder.cleanup()


def flat(grads, places):
    """The gradients at `places` (of {name: gradient}, in the model's order) flattened into one bucket, as DDP
    lays them out."""
    grads = list(grads.values())
    return torch.cat([grads[i].flatten() for i in places])


def held_its_own(buckets, local, layout):
    """Whether the buckets one rank sent hold exactly that rank's own gradient `local` ({name: gradient},
    computed here), laid out in DDP's buckets `layout` (the places of each bucket's parameters): what DDP
    all-reduces, before the mean."""
    return len(buckets) == len(layout) and all(
        bucket.shape == want.shape and torch.allclose(bucket, want, rtol=1e-4, atol=1e-7)
        for bucket, want in zip(buckets, (flat(local, places) for places in layout)))


def ddp_buckets(seed, x, y):
    """[the places of each bucket's parameters, in order] that DDP all-reduces at step 1 and at step 2 of
    exercise 20, computed here as DDP computes them: before its first backward, one bucket of every parameter;
    from then on the buckets it rebuilds from the order in which the first backward made the gradients ready,
    cut at BUCKET_CAP_MB (torch's own bucketing, the function DDP calls). `x`, `y`: a micro-batch."""
    import torch.distributed as dist

    model = tiny_gpt(seed)
    params = list(model.parameters())
    place, ready = {id(p): i for i, p in enumerate(params)}, []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: ready.append(place[id(p)]))  # when DDP's hook fires
    model(x, y).backward()
    cap = int(BUCKET_CAP_MB * 2**20)
    rebuilt, _ = dist._compute_bucket_assignment_by_size([params[i] for i in ready], [cap, cap],
                                                         [False] * len(ready), ready)
    return [[list(range(len(params)))], [list(bucket) for bucket in rebuilt]]


def came_from_the_all_reduce(grads, layout, means):
    """Whether one rank's gradients ({name: gradient}) are, bucket by bucket of DDP's `layout`, the means this
    process sent back (`means`: the mean sent for each bucket)."""
    try:
        return len(means) == len(layout) and all(
            torch.allclose(flat(grads, places), mean, rtol=1e-6, atol=1e-9) for places, mean in zip(layout, means))
    except (TypeError, IndexError, RuntimeError, AttributeError):
        return False


def check_no_sync(answers):
    seed, micro_steps = random.randrange(2**31), 3
    counter = AllReduceCounter(answers.shared_folder())
    try:
        running = answers.start(no_sync_answers, {"seed": seed, "micro_steps": micro_steps,
                                                  "counter": counter.address}, ranks=2)
        layouts = ddp_buckets(seed, *no_sync_batches(seed, micro_steps, 0, 1)[-1])
        wants, locals_ = [], []
        for step in (1, 2):
            batches = [b for rank in (0, 1) for b in no_sync_batches(seed, micro_steps, rank, step)]
            want, _ = whole_batch_gradient(seed, torch.cat([x for x, _ in batches]),
                                           torch.cat([y for _, y in batches]))
            ranks_own = [batches[r * micro_steps:(r + 1) * micro_steps] for r in (0, 1)]
            locals_.append([whole_batch_gradient(seed, torch.cat([x for x, _ in own]),
                                                 torch.cat([y for _, y in own]))[0]
                            for own in ranks_own])
            with torch.no_grad():  # rank 0's micro-batches are of one size: the mean of their means is their mean
                rank0_loss = tiny_gpt(seed)(torch.cat([x for x, _ in batches[:micro_steps]]),
                                            torch.cat([y for _, y in batches[:micro_steps]])).item()
            wants.append((want, rank0_loss))
        ranks = running.result()
    finally:
        counter.close()
    for step, (want, rank0_loss) in enumerate(wants, 1):
        mine = [rank[step - 1] for rank in ranks]
        layout = layouts[step - 1]
        all_reduces = counter.step(counter.buckets, 0, step)
        grads = [m["grads"] for m in mine]
        missing = next((name for name, grad in grads[0].items() if grad is None), None)
        if missing:
            raise ExerciseFailed(f"at step {step}, after accumulate_with_ddp, {missing} has no gradient: call "
                                 f"backward() on every micro-step's loss.")
        if not agree(grads):
            advice = ("no all-reduce ran: run the last micro-step outside model.no_sync(), where DDP all-reduces what "
                      "the micro-steps accumulated" if not all_reduces else
                      "every rank must end with the same gradient, DDP's all-reduce on the last micro-step")
            raise ExerciseFailed(f"at step {step} the 2 ranks hold different gradients: {advice}.")
        if not equal(grads[0], want):
            if equal(grads[0], scaled(want, micro_steps)):
                advice = "divide each micro-step's loss by the number of micro-steps before backward()"
            elif equal(grads[0], scaled(want, 0.5)):
                advice = "DDP already averages over the ranks: divide by the number of micro-steps only"
            else:
                advice = "each micro-step adds loss / micro-steps into .grad, and DDP averages over the ranks"
            raise ExerciseFailed(f"at step {step} the ranks agree, but not with one process over all {2 * micro_steps} "
                                 f"micro-batches: {advice}.")
        if not all_reduces:  # the ranks agree only because the answer all-reduced by hand: DDP's work, done twice
            raise ExerciseFailed(f"at step {step} DDP itself all-reduced nothing (the gradients agree, so they were "
                                 f"reduced by hand): run the last micro-step outside model.no_sync(), where DDP "
                                 f"all-reduces each bucket once, overlapping backward; no all-reduce of your own.")
        for rank in (0, 1):
            held = counter.step(counter.buckets, rank, step)
            if len(held) > len(layout):
                raise ExerciseFailed(f"at step {step} DDP all-reduced {len(held)} buckets of rank {rank} where its "
                                     f"{len(layout)} bucket(s) need one all-reduce each, on the last micro-step: "
                                     f"run every micro-step but the last inside model.no_sync(), so the gradients "
                                     f"cross the network once per optimizer step.")
            sizes = [flat(locals_[step - 1][rank], places).numel() for places in layout]
            if [bucket.numel() for bucket in held] != sizes:
                when = ("before its first backward" if step == 1 else
                        "once it has rebuilt them in the order backward made the gradients ready")
                raise ExerciseFailed(f"at step {step} rank {rank} all-reduced {len(held)} bucket(s) where DDP, "
                                     f"{when}, all-reduces {len(layout)} of other sizes: these are not DDP's "
                                     f"buckets, so let DDP all-reduce the gradients itself, on the last "
                                     f"micro-step (a bucket sent by your own code is not DDP's).")
            if not held_its_own(held, locals_[step - 1][rank], layout):
                raise ExerciseFailed(f"at step {step} what reached DDP's all-reduce from rank {rank} is not the "
                                     f"gradient that rank accumulated over its micro-steps: let DDP all-reduce, on "
                                     f"the last micro-step, what backward() accumulated (a hook called by your own "
                                     f"code is not DDP's).")
            if not came_from_the_all_reduce(mine[rank]["grads"], layout, counter.step(counter.means, rank, step)):
                raise ExerciseFailed(f"at step {step} rank {rank}'s gradients are not what DDP's all-reduce gave "
                                     f"back: let DDP write the mean of the ranks' gradients into .grad, and leave "
                                     f"it there.")
        loss = mine[0]["loss"]
        if mine[0]["keeps_graph"]:
            raise ExerciseFailed("the loss you return still holds its graph (requires_grad): return it detached.")
        if not (torch.is_tensor(loss) and loss.numel() == 1 and is_close(loss.item(), rank0_loss, rel=1e-5)):
            raise ExerciseFailed(f"at step {step} rank 0 returned the loss {shown(loss)}, "
                                 f"{compared(loss, rank0_loss)} the mean of its micro-steps' losses: return that, as a "
                                 f"one-number tensor.")
    counts = [len(counter.step(counter.buckets, 0, step)) for step in (1, 2)]
    return (f"on 2 gloo ranks with {micro_steps} micro-steps each, DDP all-reduced each bucket of your gradients once "
            f"per step, through a hook whose count the grader keeps (step 1 in {counts[0]} bucket, step 2 in "
            f"{counts[1]} once DDP rebuilt its buckets of 0.05 MB), and both ranks hold one process's gradient over "
            f"all {2 * micro_steps} micro-batches.")
