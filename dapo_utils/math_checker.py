"""--answer_checker=math_verify: answers compared as mathematics by Hugging Face's math-verify (an optional extra:
pip install -r requirements/math.txt), so that \\frac{3}{4}, 0.75 and 3/4 agree, 2\\sqrt{3} is not 2, and
intervals, sets and \\boxed{} answers are read (the number checker compares the last number of each side).

    strict   the text inside the first <answer>...</answer> block
    lenient  that text if math-verify reads a value in it; else the final answer math-verify finds anywhere in the
             response (\\boxed{...}, "the final answer is ...", else the last expression)
A bare answer ("2\\sqrt{3}": an answer column's, the inside of the answer tags) is read as one formula, $...$;
text with delimiters of its own ($, \\(, \\[, \\boxed) as math-verify finds it. The reference is the gold side of
math-verify's verify (it is not symmetric).

Time limits. math-verify's own timeouts arm signal.alarm inside parse and verify: only the main thread may, and its
alarm would replace reward_timeout's (time_limits.time_limit). So they are off (parsing_timeout=None and
timeout_seconds=None) and each parse and each comparison runs under time_limit(CHECK_SECONDS) instead: in the
main thread, where the trainer scores and evaluates, a check past it is "not correct" and counts in metrics.jsonl
as reward_timeouts/NAME of the reward function that made it; in other threads it runs without a limit. A check
that raises is "not correct" too and counts as reward_errors/NAME.
"""

import logging

from math_verify import parse, verify

from dapo_utils.answers import ANSWER_REGEX, CHECK_FAILURES, AnswerChecker, normalize_answer
from dapo_utils.time_limits import TimeLimitExpired, time_limit

CHECK_SECONDS = 5  # per parse and per comparison: math-verify's own default
DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
# math-verify warns once that its timeouts are off and the caller must limit its calls: time_limit does.
for logger in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(logger).setLevel(logging.ERROR)


class CheckExpired(TimeLimitExpired):
    """One parse or comparison ran past CHECK_SECONDS."""


def checked(function, *args, **kwargs):
    """function(*args, **kwargs) within CHECK_SECONDS; None when it raised or ran past them (CHECK_FAILURES)."""
    try:
        with time_limit(CHECK_SECONDS, CheckExpired):
            return function(*args, **kwargs)
    except CheckExpired:
        CHECK_FAILURES["timed_out"] += 1
    except Exception:  # noqa: BLE001 - sympy's errors on odd input: not correct, and counted
        CHECK_FAILURES["raised"] += 1
    return None


def read_math(text, whole_response=False):
    """math-verify's reading of text: [value, the text it read], [] if none. A bare answer is one formula."""
    text = str(text).strip()
    if text and not whole_response and not any(mark in text for mark in DELIMITERS):
        text = f"${text}$"
    return (checked(parse, text, parsing_timeout=None, raise_on_error=True) or []) if text else []


def answer_in_tags(response):
    """The strict rule: the text inside the first <answer>...</answer> block, "" if none."""
    match = ANSWER_REGEX.search(response)
    return match.group(1).strip() if match else ""


def final_answer(response):
    """The lenient rule: the answer tags' text if math-verify reads it, else what it reads in the whole response."""
    strict = answer_in_tags(response)
    if read_math(strict):
        return strict
    found = read_math(response, whole_response=True)
    return str(found[-1]) if found else ""


def same_math(extracted, answer):
    """Whether the extracted answer equals the reference answer as mathematics (math-verify's verify)."""
    gold, target = read_math(normalize_answer(answer)), read_math(extracted)
    return bool(gold and target and checked(verify, gold, target, timeout_seconds=None, raise_on_error=True))


MATH_VERIFY_CHECKER = AnswerChecker("math_verify", answer_in_tags, final_answer, same_math)
