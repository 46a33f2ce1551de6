"""Your own rewards: --reward_funcs names reward_func.py's functions or `module:function` import paths of your own,
--answer_checker picks how answers are compared, and --check_rewards scores every reference answer as a perfect
response before a run, so that answers the rewards cannot read show at once rather than as a run of zeros.

A reward function takes (prompts, responses, answers) as keywords and returns one float per response (None: no
opinion), as reward_func.py's do. my_rewards.py, in a folder on sys.path (the working directory, or PYTHONPATH):

    def brevity(prompts, responses, answers):
        return [0.5 if len(response) < 400 else 0.0 for response in responses]

    python train.py --reward_funcs=correctness_reward,my_rewards:brevity --reward_weights=1,0.5
"""

import functools
import importlib
import inspect
import math

import reward_func
from data import GSM8KDataset
from reward_func import NUMBER_CHECKER, normalize_answer, reward_column, reward_func_name

SEED_REWARDS = ("correctness_reward", "digit_reward", "hard_format_reward", "mark_reward")  # reward_func.py's
SHOWN_FAILURES = 5  # rows that --check_rewards prints of those short of full marks
CHUNK = 256  # responses per reward call in --check_rewards


def answer_checker(name):
    """The AnswerChecker of --answer_checker: the seed's number rule, or math-verify's (imported only then)."""
    if name == "math_verify":
        from math_checker import MATH_VERIFY_CHECKER

        return MATH_VERIFY_CHECKER
    return NUMBER_CHECKER


def reward_functions(args, trial=None):
    """The functions of args.reward_funcs (comma-separated names), each resolved and checked (resolve); with
    --answer_checker=math_verify, correctness_reward compares with it. trial: a data set whose first two rows
    each function scores as perfect responses, so that one returning the wrong count, a NaN or infinite value, or
    running past reward_timeout is refused before training. Errors: ValueError, one line naming the function."""
    checker = answer_checker(args.answer_checker)
    names = [name.strip() for name in args.reward_funcs.split(",") if name.strip()]
    if not names:
        raise ValueError(f"reward_funcs names no function: give some of {', '.join(SEED_REWARDS)} or module:function")
    funcs = [resolve(name) for name in names]
    if checker is not NUMBER_CHECKER:  # the seed's function, with another way to compare answers
        bind = lambda f: functools.update_wrapper(functools.partial(f, checker=checker), f)  # noqa: E731
        funcs = [bind(f) if f is reward_func.correctness_reward else f for f in funcs]
    if trial is not None:
        rows = [trial[i] for i in range(min(2, len(trial)))]
        prompts, answers = [row["prompt"] for row in rows], [row["answer"] for row in rows]
        for func in funcs:
            name, responses = reward_func_name(func), [perfect_response(answer) for answer in answers]
            reward_column(name, func, None, prompts, responses, answers, "cpu", args.reward_timeout)
    return funcs


def resolve(name):
    """A reward function by its name in reward_func.py or its `module:function` path, checked to be a function of
    (prompts, responses, answers)."""
    module_name, _, attribute = name.rpartition(":")
    own = f"give your own as module:function (its module on sys.path), or one of {', '.join(SEED_REWARDS)}"
    try:
        module = importlib.import_module(module_name or "reward_func")
    except Exception as error:  # noqa: BLE001 - not found, or the module's own error: one line either way
        raise ValueError(f"reward function {name!r}: cannot import {module_name!r} ({error}); {own}") from None
    func = getattr(module, attribute, None)
    if not callable(func):
        raise ValueError(f"reward function {name!r}: {module.__name__} has no function {attribute!r}; {own}")
    try:
        inspect.signature(func).bind(prompts=[], responses=[], answers=[])
    except TypeError:
        raise ValueError(
            f"reward function {name!r} takes {inspect.signature(func)}; a reward function takes (prompts, responses, "
            "answers) and returns one float per response (None: no opinion)"
        ) from None
    return func


def perfect_response(answer):
    """A response in the format the system prompt asks for, with the reference answer as its answer."""
    return f"<think>\n...\n</think>\n<answer>\n{normalize_answer(answer)}\n</answer>\n"


def check_rewards(args, reward_funcs):
    """--check_rewards: every reference answer of the train and test splits, written as a perfect response, scored
    by each reward function and the answer checker. Prints how many get full marks (the checker's "correct" and
    every function at the best value it gave any row) and the first rows that fall short. Returns the exit status:
    0 when every row gets full marks, else 1."""
    checker, names = answer_checker(args.answer_checker), [reward_func_name(f) for f in reward_funcs]
    rows = reference_rows(args)  # (split, row in the split, question, answer)
    answers = [answer for *_, answer in rows]
    responses = [perfect_response(answer) for answer in answers]
    scores = perfect_scores(names, reward_funcs, rows, responses, args.reward_timeout)  # {name: [value per row]}
    correct = [checker.is_correct(response, answer) for response, answer in zip(responses, answers)]
    seen = {name: [v for v in values if not math.isnan(v)] or [math.nan] for name, values in scores.items()}
    best, low = {n: max(values) for n, values in seen.items()}, {n: min(values) for n, values in seen.items()}
    short = [[name for name in names if scores[name][i] != best[name]] for i in range(len(rows))]  # None: short
    failures = [i for i in range(len(rows)) if short[i] or not correct[i]]
    splits = ", ".join(f"{sum(row[0] == split for row in rows)} {split}" for split in ("train", "test"))
    print(f"check_rewards: {splits} reference answers of {args.data_path!r}, each as the perfect response")
    print(f"  {responses[0]!r}")
    print(f"  answer checker {checker.name}: {sum(correct)} of {len(rows)} correct")
    for name in names:
        at_best = sum(value == best[name] for value in scores[name])
        zero = "  (0 for every perfect response: does it read these answers?)" if best[name] == low[name] == 0 else ""
        print(f"  {name}: {at_best} of {len(rows)} at its best, {best[name]:g} (lowest {low[name]:g}){zero}")
    print(f"full marks: {len(rows) - len(failures)} of {len(rows)}")
    for i in failures[:SHOWN_FAILURES]:
        split, row, question, answer = rows[i]
        why = ([] if correct[i] else ["the answer checker says wrong"]) + [
            f"{name} {scores[name][i]:g} of {best[name]:g}" for name in short[i]
        ]
        print(f"  {split} row {row}: answer {normalize_answer(answer)!r} ({question[:40]!r}...): {'; '.join(why)}")
    return 1 if failures else 0


def reference_rows(args):
    """(split, row in the split, question, reference answer) of the train and test splits, read as training reads
    them (the held-out rule included)."""
    reading = dict(columns=(args.question_column, args.answer_column), answer_format=args.answer_format)
    rows = []
    for split in ("train", "test"):
        data = GSM8KDataset(args.data_path, None, split, **reading)
        rows += [(split, i, item["prompt"], item["answer"]) for i, item in enumerate(data)]
    return rows


def perfect_scores(names, reward_funcs, rows, responses, timeout):
    """{name: [its value for each row's perfect response]} (NaN for None), CHUNK responses per call."""
    scores = {name: [] for name in names}
    prompts, answers = [row[2] for row in rows], [row[3] for row in rows]
    for start in range(0, len(rows), CHUNK):
        part = slice(start, start + CHUNK)
        for name, func in zip(names, reward_funcs):
            values = reward_column(name, func, None, prompts[part], responses[part], answers[part], "cpu", timeout)
            scores[name] += values.tolist()
    return scores
