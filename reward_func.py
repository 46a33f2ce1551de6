"""Reward functions for DAPO on GSM8K-style math.

Every reward has the signature `(prompts, responses, answers) -> list[float]` (one value per
response; `None` means "no opinion" and is ignored by the trainer). They form a curriculum
from soft to hard, so that a model gets a learning signal before it can solve anything:

    reward               max    kind           purpose
    correctness_reward   2.0    sparse, hard   the last number in <answer> equals the answer (as numbers)
    digit_reward         0.5    dense          the extracted answer is a plain integer
    hard_format_reward   0.5    sparse, hard   the whole response is <think>..</think><answer>..</answer>
    mark_reward          0.5    dense, soft    0.125 for each tag+newline that occurs exactly once
"""

from dapo_utils.answers import INTEGER_REGEX, STRICT_FORMAT_REGEX, extract_answer, is_correct

FORMAT_MARKS = ("<think>\n", "</think>\n", "<answer>\n", "</answer>\n")


def mark_num(text):
    """0.125 for each of the four tag+newline strings that occurs exactly once (max 0.5)."""
    return sum(0.125 for mark in FORMAT_MARKS if text.count(mark) == 1)


def correctness_reward(prompts, responses, answers, checker=None):
    """2.0 when the extracted answer equals the reference answer as a number (`is_correct`), else 0.0. checker:
    another AnswerChecker (--answer_checker=math_verify binds math_checker's: dapo_utils.rewards.reward_functions)."""
    correct = is_correct if checker is None else checker.is_correct
    return [2.0 if correct(response, answer) else 0.0 for response, answer in zip(responses, answers)]


def digit_reward(prompts, responses, answers):
    """0.5 when the extracted answer is a plain integer, else 0.0.

    A plain integer: digits, optionally a minus sign and thousands separators ("72", "-3",
    "1,234"); not "5.0", "3.75" or "3/4". The seed's `.isdigit()` saw "-3" as "3" and "1,234"
    as "234" (both 0.5), so the values equal the seed's for every response.
    """
    return [0.5 if INTEGER_REGEX.fullmatch(extract_answer(response)) else 0.0 for response in responses]


def hard_format_reward(prompts, responses, answers):
    """0.5 when the whole response matches the strict think/answer layout, else 0.0."""
    return [0.5 if STRICT_FORMAT_REGEX.match(response) else 0.0 for response in responses]


def mark_reward(prompts, responses, answers):
    """Soft format reward in [0, 0.5]: see `mark_num`."""
    return [mark_num(response) for response in responses]
