"""The exercise checks draw their cases at random (so an answer cannot be hard-coded), and some advice holds only
because every draw has a property: these tests draw many times and check it, in-process, in well under a second.
Without the property a wrong answer gets another mistake's advice, or a right answer fails, about 1 run in 30 to
1 in 60,000."""

import random

import torch

from exercises.grader.checks_capstone import attention_cases
from exercises.grader.checks_core import clipping_cases


def test_exercise_13s_cases_above_the_limit_hold_a_tensor_over_it_by_itself():
    # else clipping each tensor on its own leaves them all as they were, with one factor, and is told the other advice
    for draw in range(200):
        for i, case in enumerate(clipping_cases(random.Random(draw))):
            norms = [g.norm().item() for g in case["grads"]]
            total = torch.linalg.vector_norm(torch.tensor(norms)).item()
            if i % 2 == 0:
                assert max(norms) > case["limit"] and total > case["limit"]
            else:
                assert total < case["limit"]


def test_exercise_16s_masked_attention_lets_every_query_see_itself_and_the_first_key():
    # a query that sees itself alone gives q no gradient: torch's attention gives float noise there, a right answer
    # zeros, and with too many such queries the right answer failed
    torch.manual_seed(0)
    for draw in range(200):
        for case in attention_cases(random.Random(draw)):
            if case["kind"] == "mask":
                allowed, (Tq, Tk) = case["allowed"], case["allowed"].shape[-2:]
                assert allowed[..., 0].all() and allowed[..., torch.eye(Tq, Tk, dtype=torch.bool)].all()
