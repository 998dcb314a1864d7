"""Answers that try to pass without a correct answer, as a student who games the grader would write
them: each fails, in one sentence whose advice fits what it tried. Patching what feeds the check,
hard-coding the cases it draws, reaching past the answer's sandbox (tests/test_exercise_sandbox.py
holds the sandbox's own walls), or borrowing the project's code where the exercise is to write it.
"""

import pytest
import torch  # noqa: F401 - (the cheats are copied into answer files, which import it)

from conftest import ROOT
from test_exercises import answer_folder, failed_with
from test_exercise_mistakes_run import ddp, ddp_all_in_no_sync_reduced_by_hand


class Bucket:
    """A bucket made by hand, with what DDP's GradBucket offers a hook."""

    def __init__(self, flat, params):
        self.flat, self.params = flat, params

    def index(self):
        return 0

    def buffer(self):
        return self.flat

    def parameters(self):
        return self.params


def ddp_by_hand_then_a_bucket_of_its_own(model, micro_batches):
    """Reduced by hand, then DDP's hook (the grader's counter) called with a bucket of its own: one
    bucket of every parameter, as DDP's first step makes, holding the gradients already averaged."""
    total = ddp_all_in_no_sync_reduced_by_hand(model, micro_batches)
    params = list(model.parameters())
    hook, state = model._comm_hooks[0]
    hook(state, Bucket(torch.cat([p.grad.reshape(-1) for p in params]), params)).wait()
    return total


def ddp_in_no_sync_then_one_bucket_of_its_own(model, micro_batches):
    """DDP's all-reduce skipped (every micro-step in no_sync), then the rank's own gradient handed to
    DDP's hook in one bucket of its own, and the mean it gives back written into .grad: the grader's
    counter sees one all-reduce of the right values, at step 2 too."""
    total = ddp(model, micro_batches, sync="never")
    params = list(model.parameters())
    hook, state = model._comm_hooks[0]
    mean = hook(state, Bucket(torch.cat([p.grad.reshape(-1) for p in params]), params)).wait()
    torch.nn.utils.vector_to_parameters(mean, [p.grad for p in params])
    return total


def ddp_in_no_sync_then_one_bucket_down_the_hooks_socket(model, micro_batches):
    """As above, the bucket sent down the socket the hook holds (read from its closure) in the
    grader's own wire format, past the hook."""
    import sys

    feed = sys.modules["exercises.grader.feed_ddp"]
    total = ddp(model, micro_batches, sync="never")
    params = list(model.parameters())
    hook, _ = model._comm_hooks[0]
    cells = dict(zip(hook.__code__.co_freevars, (c.cell_contents for c in hook.__closure__)))
    feed.send_frame(cells["connection"], {}, torch.cat([p.grad.reshape(-1) for p in params]))
    _, mean = feed.receive_frame(cells["connection"])
    torch.nn.utils.vector_to_parameters(mean, [p.grad for p in params])
    return total


def ddp_on_every_micro_step_counted_once_past_a_rebound_wire(model, micro_batches):
    """DDP all-reduces on every micro-step (no no_sync), and the wire the hook reads from the grader's
    module (feed_ddp.send_frame, receive_frame) is rebound in the answer's process: the buckets of
    every micro-step but the last are averaged by hand and never reach the grader, whose count then
    reads one all-reduce per bucket, of the buckets DDP rebuilt after the first micro-step."""
    import sys

    import torch.distributed as dist

    feed = sys.modules["exercises.grader.feed_ddp"]
    send, receive, by_hand = feed.send_frame, feed.receive_frame, []

    def send_frame(connection, header, tensor=None):
        if quiet[0] and tensor is not None:
            by_hand.append(tensor.clone())
            dist.all_reduce(by_hand[-1])
            return None
        return send(connection, header, tensor)

    def receive_frame(connection):
        return ({}, by_hand.pop() / dist.get_world_size()) if quiet[0] else receive(connection)

    feed.send_frame, feed.receive_frame, quiet = send_frame, receive_frame, [True]
    total = torch.zeros(())
    for i, (x, y) in enumerate(micro_batches):
        quiet[0] = i < len(micro_batches) - 1
        loss = model(x, y)
        (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    quiet[0] = False
    return total


def generate_recomputed_past_the_counters(model, idx, max_new_tokens, temperature=1.0, top_k=None,
                                          generator=None):
    """No cache at all: a cached generate run for the counters alone, then the whole window
    recomputed for every token through model.Block.forward (not the counting blocks') and
    wte.weight[idx] (not an embedding call)."""
    import model as project
    import sample

    sample.generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k)
    for _ in range(max_new_tokens):
        window = idx[:, -model.config.block_size:]
        x = model.transformer.wte.weight[window] + model.transformer.wpe.weight[:window.size(1)]
        for block in model.transformer.h:
            x = project.Block.forward(block, x)
        logits = filter_logits(model.logits(model.transformer.ln_f(x))[:, -1, :], top_k=top_k)
        if temperature == 0:
            new = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = F.softmax(logits / temperature, dim=-1)
            new = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat([idx, new], dim=1)
    return idx


def generate_with_work_in_children_nobody_waits_for(model, idx, max_new_tokens, temperature=1.0,
                                                   top_k=None, generator=None):
    """The work done in a forked child with SIGCHLD ignored: the kernel reaps it at once, so its CPU
    reaches no parent's account, and it ends before a look at the live processes finds it."""
    import os
    import signal

    import sample

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    if os.fork() == 0:
        model(idx[:, -model.config.block_size:])  # (the whole window again: what the cache saves)
        os._exit(0)
    return sample.generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k,
                           generator=generator)


# (exercise, {answer function: the cheat; "_name": a helper it calls}, words of the failure)
GUARDS = [
    (20, {"accumulate_with_ddp": ddp_by_hand_then_a_bucket_of_its_own, "_Bucket": Bucket, "_ddp": ddp,
          "ddp_all_in_no_sync_reduced_by_hand": ddp_all_in_no_sync_reduced_by_hand},
     "is not the gradient that rank accumulated over its micro-steps"),
    (20, {"accumulate_with_ddp": ddp_in_no_sync_then_one_bucket_of_its_own, "_Bucket": Bucket, "_ddp": ddp},
     "these are not DDP's buckets"),
    (20, {"accumulate_with_ddp": ddp_in_no_sync_then_one_bucket_down_the_hooks_socket, "_ddp": ddp},
     "these are not DDP's buckets"),
    (20, {"accumulate_with_ddp": ddp_on_every_micro_step_counted_once_past_a_rebound_wire},
     "bucket(s) need one all-reduce each, on the last micro-step"),
    (21, {"generate": generate_with_work_in_children_nobody_waits_for},
     "your answer tried to start another process or thread"),
    (21, {"generate": generate_recomputed_past_the_counters},
     "with the cache each new token is one position through the model"),
]


@pytest.mark.parametrize("number,cheat,words", GUARDS, ids=[f"{n}-{'-'.join(c)}" for n, c, _ in GUARDS])
def test_an_answer_that_rewrites_what_counts_in_its_own_process_fails_on_what_the_grader_measures(
        number, cheat, words, data_root, tmp_path):
    failed_with(number, answer_folder(tmp_path, number, cheat), words, data_root)


# The capstone on one import line: model.py's modules instead of the student's, taken whole or
# inherited.
BORROWED = [  # (code, words of the failure)
    ("from model import CausalSelfAttention, MLP, Block, GPT  # noqa\n",
     "the capstone is yours to write: exercises/16_gpt.py uses model.py's"),
    ("class GPT(model.GPT):\n    pass\n", "your GPT derives from model.py's GPT"),
    # model.py's GPT extended with the student's own methods, as a class statement and made by type()
    ("model.GPT.__init__ = nn.Module.__init__\n_Mine = GPT\n\n\nclass GPT(_Mine, model.GPT):\n    pass\n",
     "your GPT derives from model.py's GPT"),
    ("getattr(model, 'G' + 'PT').__init__ = nn.Module.__init__\n"
     "GPT = type('GPT', (GPT, getattr(model, 'G' + 'PT')), {})\n",
     "your GPT's GPT derives from model.py's GPT"),
    # torch's attention where the student's is asked
    ("def attention(q, k, v, allowed=None, dropout=0.0):\n"
     "    Tq, Tk = q.size(-2), k.size(-2)\n"
     "    if allowed is None:\n"
     "        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)\n"
     "    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,\n"
     "                                                            dropout_p=dropout)\n",
     "yet your answer called torch's scaled_dot_product_attention"),
    # model.py's MLP pasted: the student's mlp of exercise 10 never runs
    ("MLP.forward = lambda self, x: self.dropout(self.c_proj(self.gelu(self.c_fc(x))))\n",
     "your GPT never calls your mlp of exercise 10"),
    # model.py saved beside the answers under an answer file's name, and re-exported
    ("_project = answers_of(99, __file__)\n"
     "CausalSelfAttention, MLP, Block = _project.CausalSelfAttention, _project.MLP, _project.Block\n",
     "no exercise 99 beside 16_gpt.py"),
]


@pytest.mark.parametrize("code,words", BORROWED, ids=["imported", "inherited", "extended", "made by type",
                                                      "torch's attention", "pasted mlp", "beside"])
def test_a_capstone_borrowed_from_model_py_fails_saying_it_is_the_students_to_write(
        code, words, data_root, tmp_path):
    folder = answer_folder(tmp_path, 16, code=code)
    (folder / "99_model.py").write_text((ROOT / "model.py").read_text())
    failed_with(16, folder, words, data_root)

PATCHES = [  # (exercise, code that patches what feeds the check, words of the failure)
    # the answer's process patches the check's helper so that train.py's run logs no loss
    (16, "import exercises.grader.feed_capstone as _check\n_check.run_training = lambda args: []\n",
     "your run logged 0 losses where model.py's logs 6"),
    # ... or trains model.py's GPT instead of the answer's, which has no dropout on its attention
    # weights
    (16, "import exercises.grader.feed_capstone as _check\n_train = _check.run_training\n"
         "_check.run_training = lambda args: _train([a for a in args if 'model_module' not in a])\n"
         "_attention = attention\n"
         "attention = lambda q, k, v, allowed=None, dropout=0.0: _attention(q, k, v, allowed)\n",
     "the attention weights"),
    (21, "KVCache.length = property(lambda self: 0)  # a cache that never says how far it got\n",
     "your cache's length is 0, smaller than what sample.py's says"),
]


@pytest.mark.parametrize("number,code,words", PATCHES, ids=[str(n) for n, _, _ in PATCHES])
def test_an_answer_that_patches_what_feeds_its_check_fails_in_one_sentence(number, code, words,
                                                                            data_root, tmp_path):
    failed_with(number, answer_folder(tmp_path, number, code=code), words, data_root)


# Answers that read the one case a fixed check would give: each fails on at least 9 of 10 gradings,
# and a failure names its seed, which draws the same cases, and the same sentence, again.
HARD_CODED = [
    (22, "def suggest_lr(lrs, losses):\n    return lrs[42] / 10\n", 10),
    # the real run's step of the lowest loss, or the step before a jump (no smoothing, no rule)
    (22, "def suggest_lr(lrs, losses):\n"
         "    jump = next((i for i in range(1, 40) if losses[i] > 3 * losses[i - 1]), None)\n"
         "    return lrs[42 if jump is None else jump - 1] / 10\n", 10),
    (23, "def find_spikes(losses, threshold, window=50):\n    return list(range(41, 61))\n", 10),
    # the rule without its window and without waiting for 10 losses
    (23, "def find_spikes(losses, threshold, window=50):\n    found, previous = [], []\n"
         "    for step, loss in enumerate(losses, 1):\n"
         "        if previous and loss > sum(previous) / len(previous) + threshold:\n"
         "            found.append(step)\n"
         "        if loss == loss:\n            previous.append(loss)\n    return found\n", 10),
    (23, "def rewind_step(spike_step, checkpoint_steps):\n    return 38\n", 10),
    # the 19 names of one 2-layer GPT; the check draws two depths, so it always fails
    (17, "NAMES = sorted(bf16_modules(model.GPT(model.GPTConfig(n_layer=2, n_head=2, n_embd=32, "
         "block_size=16, vocab_size=512))))\ndef bf16_modules(gpt):\n    return set(NAMES)\n", 3),
]


def test_hard_coded_answers_fail_on_nine_gradings_of_ten_and_a_seed_replays_the_failure(data_root,
                                                                                        tmp_path):
    from exercises.check import grade

    for i, (number, code, gradings) in enumerate(HARD_CODED):
        (tmp_path / str(i)).mkdir()
        folder = answer_folder(tmp_path / str(i), number, code=code)
        lines = [grade(number, folder, data_root, seed)[1] for seed in range(gradings)]
        failed = sum(line.startswith(f"exercise {number} failed") for line in lines)
        assert failed >= 0.9 * gradings, lines
        failing = next(seed for seed, line in enumerate(lines) if "failed" in line)
        assert f"--seed={failing} draws these cases again" in lines[failing]
        assert grade(number, folder, data_root, failing)[1] == lines[failing]
