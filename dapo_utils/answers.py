"""Reading and comparing answers: the last number inside a response's <answer> tags (the seed's rule,
`extract_answer`), the final answer found anywhere (the lenient rule of evaluation.py), numbers compared as exact
values (`same_answer`), a data set's reference answer as the seed prints it (`normalize_answer`), and the layout
the system prompt asks for. An AnswerChecker bundles one way of reading and comparing: the seed's is
NUMBER_CHECKER; math_checker.MATH_VERIFY_CHECKER compares with math-verify. reward_func.py's rewards, the data
loading and the evaluation read answers through this module.
"""

import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

ANSWER_REGEX = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The seed's number regex was r"\d+\.\d+|\d+/\d+|\d+" (decimal | fraction | integer). It also
# reads a sign and thousands separators, so that "-3" is not "3" and "1,234" is not "234":
#   - a minus sign (ASCII "-", U+2212 "−", full-width "－") when it is not right after a digit,
#     a Latin letter or a closing bracket ("5-3" is a subtraction, "x-3" an expression: "3");
#   - ASCII commas between groups of exactly three digits, the first group of one to three
#     digits, optionally a decimal part: "1,234", "12,345.5". The group must be the whole run:
#     it does not start right after "digit," or "digit/" and is not followed by a digit,
#     ",digit", ".digit" or "/digit" ("3,4,567", "1,2345" and "1,234/5" read as the seed reads
#     them). The full-width comma "，" is not a separator: in Chinese text it separates clauses
#     and list items ("3，4" is two numbers), and models write thousands with an ASCII comma.
NUMBER_REGEX = re.compile(
    r"(?:(?<![0-9A-Za-z)\]])[-\u2212\uff0d])?"  # optional sign
    r"(?:(?<!\d[,/])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d|[,./]\d)"  # 1,234 or 1,234.5
    r"|\d+\.\d+|\d+/\d+|\d+)"  # the seed's decimal | fraction | integer, in that priority
)
INTEGER_REGEX = re.compile(r"[-\u2212\uff0d]?(?:\d{1,3}(?:,\d{3})+|\d+)")  # what digit_reward accepts
# Where a final answer is announced, for the lenient rule: Chinese (最终答案, 答案 with 是 / 为 / ：, 答： as a
# written solution ends), English ("the final answer is", "Answer:"), GSM8K's "####" and LaTeX's \boxed{.
ANSWER_PHRASE_REGEX = re.compile(
    r"最终答案|答案|答\s*[:：]|(?:the\s+)?(?:final\s+)?(?<![</])answer\b|####|\\boxed\{", re.IGNORECASE
)
STRICT_FORMAT_REGEX = re.compile(
    r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\n$", re.DOTALL
)  # the layout the prompt asks for


def extract_answer(text):
    """The last number inside the first <answer>...</answer> block, as written ("1,234", "-3",
    "5.0", "3/4"); "" if none. `parse_number` gives its value."""
    match = ANSWER_REGEX.search(text)
    if not match:
        return ""
    nums = NUMBER_REGEX.findall(match.group(1))
    return nums[-1].strip() if nums else ""


def parse_number(text):
    """The exact value of a number string as a Fraction, or None if it is not a number.

    Reads what `extract_answer` returns (sign, thousands separators, decimals, fractions a/b)
    and the reference answers' strings ("72", "72.0", "1e3"). Exact: "0.1" is 1/10, "5.0" is
    5, "3/4" is 0.75; a fraction with a zero denominator is None.
    """
    text = str(text).strip().replace("\u2212", "-").replace("\uff0d", "-")
    if INTEGER_REGEX.fullmatch(text) or NUMBER_REGEX.fullmatch(text):
        text = text.replace(",", "")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_answer(answer):
    """The reference answer as the seed's `str(ans.item())` prints an integer answer.

    A DataLoader turns the data set's int64 `answer_only` into a 0-d tensor; users also pass
    ints, integral floats (72.0) or strings ("72"). All of them become "72". The seed called
    `.item()` unconditionally and crashed on a str.
    """
    if hasattr(answer, "item"):  # torch / numpy scalar
        answer = answer.item()
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    if isinstance(answer, str):
        answer = answer.strip()
        try:
            as_float = float(answer)
        except ValueError:
            return answer
        return str(int(as_float)) if as_float.is_integer() else answer
    return str(answer)


def extract_answer_lenient(text):
    """The final answer found anywhere in the response (the lenient rule of evaluation.py), as written; "" if
    the response holds no number. In this order:

    1. the strict rule: the last number inside the first <answer>...</answer> block (`extract_answer`);
    2. after the last answer phrase that a number follows (ANSWER_PHRASE_REGEX: 最终答案, 答案是 / 答案为 /
       答案：, 答：, "the answer is", "final answer:", "Answer:", GSM8K's "####", \\boxed{...}): the first
       number after it, so that "the answer is 5. Check: 5 + 3 = 8" reads 5;
    3. the last number of the response ("Tom has 12 + 5 = 17 apples" reads 17).
    """
    strict = extract_answer(text)
    if strict:
        return strict
    for phrase in reversed(list(ANSWER_PHRASE_REGEX.finditer(text))):
        number = NUMBER_REGEX.search(text, phrase.end())  # the lookbehinds still see the text before
        if number:
            return number.group().strip()
    numbers = NUMBER_REGEX.findall(text)
    return numbers[-1].strip() if numbers else ""


def same_answer(extracted, answer):
    """Whether an extracted answer equals the reference answer, as numbers.

    Both sides go through `parse_number`, so "5.0", "5" and 5 agree, "1,234" equals 1234, and
    "0.75" equals "3/4" (exact rationals, no float tolerance). When either side is not a number,
    the strings are compared, as the seed compared them. An empty extraction is never correct.
    """
    if not extracted:
        return False
    reference = normalize_answer(answer)
    value, reference_value = parse_number(extracted), parse_number(reference)
    if value is None or reference_value is None:
        return extracted == reference
    return value == reference_value


def is_correct(response, answer):
    """Whether the number in the response's answer tags equals the reference answer (`same_answer`): the seed's
    rule, which `correctness_reward`, the trainer's evaluation and evaluation.py's strict accuracy use."""
    return same_answer(extract_answer(response), answer)


def is_correct_lenient(response, answer):
    """Whether the final answer found anywhere in the response (`extract_answer_lenient`) is right."""
    return same_answer(extract_answer_lenient(response), answer)


@dataclass(frozen=True)
class AnswerChecker:
    """How answers are read and compared (--answer_checker): `extract` is the strict rule (inside the answer tags),
    `extract_lenient` finds a final answer anywhere, `same(extracted, reference answer)` compares. The seed's is
    NUMBER_CHECKER; math_checker.MATH_VERIFY_CHECKER compares with math-verify. Strict and lenient accuracy and
    correctness_reward all use the run's one checker."""

    name: str
    extract: Callable[[str], str]
    extract_lenient: Callable[[str], str]
    same: Callable[[str, object], bool]

    def is_correct(self, response, answer):
        return self.same(self.extract(response), answer)


NUMBER_CHECKER = AnswerChecker("number", extract_answer, extract_answer_lenient, same_answer)

# Answer checks (math_checker's) that raised or ran past their limit in this process: {"raised": n, "timed_out": n}.
# rewards.reward_column counts the ones made during each reward function's call, per function, for metrics.jsonl.
CHECK_FAILURES = Counter()
