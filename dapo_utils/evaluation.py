"""Evaluation a user can trust: strict and lenient accuracy side by side, greedy or k samples per problem
(pass@k, maj@k), and `python train.py --eval_only [--compare=PATH]` on the test split.

The metrics (eval_results.json; during training evaluations.jsonl, metrics.jsonl and the trackers, as eval/NAME,
with the seed's eval/accuracy for accuracy_strict):

    num_problems           test problems evaluated (--eval_samples; 0 = the whole split)
    accuracy_strict        share of responses whose number inside <answer>...</answer> equals the reference
                           answer: the seed's rule (answers.is_correct, correctness_reward's), the number
                           in accuracy_losses.txt. With k responses per problem: over all of them (= pass@1)
    accuracy_lenient       the same for the final answer found anywhere (answers.extract_answer_lenient):
                           the answer tags if they hold a number, else after an answer phrase (答案是, "the
                           answer is", ...), else the last number of the response
    format_rate            share of responses in the strict <think>/<answer> layout (hard_format_reward's pattern)
    mean_response_length   response tokens, the EOS included, averaged over responses
    truncated_rate         share of responses that hit max_generate_length without an EOS
    pass@k_strict, pass@k_lenient   (k = eval_num_generations > 1) mean over problems of the unbiased estimator of
                           Chen et al. 2021, 1 - C(n - c, k) / C(n, k), from n = k samples of which c are right
    maj@k_strict, maj@k_lenient     share of problems whose most frequent extracted answer (compared as numbers;
                           a tie goes to the answer written first) is right
Answers are read and compared by the run's answer checker (--answer_checker): the rules above are the number
checker's, the seed's; with math_verify, math_checker.py's (the answer tags' text; math-verify's final answer).
"""

import dataclasses
import json
import math
import os
import sys
from collections import Counter

import torch
from torch.utils.data import DataLoader

from dapo_utils.answers import NUMBER_CHECKER, STRICT_FORMAT_REGEX, normalize_answer
from dapo_utils.checkpoints import non_finite_weights
from dapo_utils.curves import read_accuracies, unevaluated_steps
from dapo_utils.rewards import example_records
from dapo_utils.writes import WriteFailed, writing

RULES = ("strict", "lenient")  # the answer checker's extract and extract_lenient (answers.AnswerChecker)


def pass_at_k(n, c, k):
    """Chen et al. 2021 (Codex), Eq. 1 for one problem: the chance that k of n samples, c of them right, drawn
    without replacement, hold a right one: 1 - C(n - c, k) / C(n, k) (1 when n - c < k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_answer(extracted, same=NUMBER_CHECKER.same):
    """The most frequent of the extracted answers ("" skipped), equal answers counted together as the answer checker
    compares them (numbers as numbers: "5.0" is "5"); a tie goes to the answer written first. "" when none."""
    votes = Counter()  # first of its kind: votes, in first-seen order (most_common keeps it among ties)
    for answer in filter(None, extracted):
        votes[next((first for first in votes if same(first, answer)), answer)] += 1
    return votes.most_common(1)[0][0] if votes else ""


def problem_record(question, answer, responses, lengths, truncated, checker=NUMBER_CHECKER):
    """One problem for eval_samples.jsonl: the question, the reference answer, and each response with what each
    rule of the answer checker extracted and whether it is right, its layout, its length in tokens and whether
    it was cut off."""
    answer, extract = normalize_answer(answer), dict(zip(RULES, (checker.extract, checker.extract_lenient)))
    judged = []
    for response, length, cut in zip(responses, lengths, truncated):
        row = {"response": response}
        for rule in RULES:
            row[rule] = extract[rule](response)
            row[f"correct_{rule}"] = checker.same(row[rule], answer)
        row |= {"format": bool(STRICT_FORMAT_REGEX.match(response)), "length": int(length), "truncated": bool(cut)}
        judged.append(row)
    record = {"question": question, "answer": answer, "responses": judged}
    if len(judged) > 1:  # the majority vote of each rule
        for rule in RULES:
            vote = majority_answer([row[rule] for row in judged], checker.same)
            record |= {f"majority_{rule}": vote, f"majority_correct_{rule}": checker.same(vote, answer)}
    return record


def summarise(records, k):
    """The metrics of the module docstring from problem records (problem_record) with k responses each."""
    rows = [row for record in records for row in record["responses"]]
    mean = lambda values: sum(values) / len(values) if values else 0.0  # noqa: E731
    metrics = {"num_problems": len(records)}
    for rule in RULES:
        metrics[f"accuracy_{rule}"] = mean([row[f"correct_{rule}"] for row in rows])
    metrics["format_rate"] = mean([row["format"] for row in rows])
    metrics["mean_response_length"] = mean([row["length"] for row in rows])
    metrics["truncated_rate"] = mean([row["truncated"] for row in rows])
    if k > 1:
        for rule in RULES:
            right = [sum(row[f"correct_{rule}"] for row in record["responses"]) for record in records]
            metrics[f"pass@{k}_{rule}"] = mean([pass_at_k(k, c, k) for c in right])
            metrics[f"maj@{k}_{rule}"] = mean([record[f"majority_correct_{rule}"] for record in records])
    return metrics


LOGGED_EXAMPLES = 4  # evaluation problems a run writes to samples.jsonl at each evaluation


class EvaluationStopped(Exception):
    """Ctrl-C or SIGTERM during an evaluation of a training run: it ended at a batch boundary, torch's RNG back where
    the evaluation found it, so that a run resumed from the checkpoint that follows evaluates exactly as this one
    would have."""


@torch.no_grad()
def evaluate_model(trainer, num_samples, batch_size, num_examples=0):
    """k = eval_num_generations responses (trainer.respond: the trainer's sampling) to each of num_samples random
    test problems (0, or at least the split's size: all of them, in order). Returns (metrics, problem records in
    the problems' order, the first num_examples problems as samples.jsonl records of their first response). Under
    torchrun each rank answers every N-th problem and all ranks get every record. A stop requested before a batch
    (trainer.stop_requested, on any rank) raises EvaluationStopped."""
    world, dataset, k = trainer.world, trainer.eval_dataset, trainer.args.eval_num_generations
    device = trainer.args.device  # its generator draws the samples (checkpoints.save_checkpoint saves the same)
    rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.startswith("cuda") else None
    if 0 < num_samples < len(dataset):  # the seed's random subset, the same on every rank
        indices = world.from_rank_0(torch.randperm(len(dataset))[:num_samples].tolist())
        dataset = torch.utils.data.Subset(dataset, indices)
    trainer.model.eval()
    records, examples = [], []
    checked = -(-(len(dataset) // world.size) // batch_size)  # batches every rank has: where all ask together
    batches = DataLoader(world.share(dataset), batch_size=batch_size, shuffle=False)
    if trainer.vllm:  # vLLM holds the full weights: they follow the policy here, where every rank is (--fsdp gathers)
        trainer.vllm.follow(trainer.model, trainer.state.update_steps)
    else:
        batches = world.while_unsharded(trainer.model, batches)  # --fsdp: gathered once for all batches
    for number, batch in enumerate(batches):
        if number < checked and world.any(trainer.stop_requested):  # a stop need not wait for the whole evaluation
            getattr(batches, "close", lambda: None)()  # --fsdp: every rank re-shards here, together
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
            raise EvaluationStopped
        responses, lengths, truncated = trainer.respond(batch["prompt"], k)  # k rows per problem
        for i, (question, answer) in enumerate(zip(batch["prompt"], batch["answer"])):
            rows = slice(i * k, (i + 1) * k)
            judged = (responses[rows], lengths[rows], truncated[rows], trainer.checker)
            records.append(problem_record(question, answer, *judged))
        if len(examples) < num_examples:
            examples += describe_examples(trainer, batch, responses[::k])[: num_examples - len(examples)]
    trainer.model.train()
    records, examples = world.gather_eval(records, examples, num_examples)
    return summarise(records, k), records, examples


def describe_examples(trainer, batch, responses):
    """Evaluation examples as samples.jsonl records: prompt, response, answers and each reward."""
    prompts, answers = list(batch["prompt"]), list(batch["answer"])
    rewards = trainer.score_rewards(prompts, responses, answers)  # [N, F]
    return example_records(prompts, responses, answers, rewards, trainer.reward_names, trainer.checker.extract)


def logged_metrics(metrics):
    """An evaluation's metrics under the names of metrics.jsonl and the trackers: eval/NAME, accuracy_strict as
    the seed's eval/accuracy."""
    names = {"accuracy_strict": "accuracy"}
    return {f"eval/{names.get(key, key)}": value for key, value in metrics.items() if key != "num_problems"}


def accuracy_summary(output_dir):
    """One line: strict and lenient accuracy at the first and the last evaluation of the run in output_dir, saying
    which step was the last evaluated when the run trained past it."""
    strict, lenient = read_accuracies(output_dir)
    if not strict:
        return "no evaluation yet"
    first, last = min(strict), max(strict)
    both = lambda step: f"{strict[step]:.2f} / {lenient.get(step, math.nan):.2f}"  # noqa: E731
    line = f"held-out accuracy (strict / lenient)  step {first} {both(first)}"
    line += f"  ->  step {last} {both(last)}" if last != first else ""
    return line + unevaluated_steps(output_dir, last)


# ============================================================
# python train.py --eval_only [--compare=PATH]
# ============================================================
def use_greedy(trainer):
    """Greedy decoding from now on: temperature 0, which decoding.py and vLLM read as argmax."""
    trainer.args.temperature = 0.0  # what sample() and sample_with_vllm pass on


def comparison_table(results):
    """A row per metric, a column per model ({label: metrics}), and with two models the second minus the first."""
    labels = list(results)
    cell = lambda name, value, sign="": f"{value:{sign}{'d' if name == 'num_problems' else '.4f'}}"  # noqa: E731
    rows = [["metric", *labels] + (["difference"] if len(labels) == 2 else [])]
    for name in results[labels[0]]:
        values = [results[label][name] for label in labels]
        difference = [cell(name, values[1] - values[0], "+")] if len(values) == 2 else []
        rows.append([name, *(cell(name, value) for value in values), *difference])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [[row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])] for row in rows]
    return "\n".join("  ".join(line) for line in lines)


def run_eval(args, model_paths, build_trainer, temperature_given):
    """Evaluate each model (the first is model_path, a second --compare) on the same test problems, greedy unless
    a temperature was given or eval_num_generations > 1 (k greedy answers would be one); write
    output_dir/eval_results.json (the settings, each model's metrics, their difference) and eval_samples.jsonl
    (a record per model and problem); print the table. Returns {model path: metrics}."""
    greedy = not temperature_given and args.eval_num_generations == 1
    results, records, trainer = {}, [], None
    for path in model_paths:
        trainer = None  # one model in memory at a time
        trainer = build_trainer(dataclasses.replace(args, model_path=path), train=False)
        bad = non_finite_weights(trainer.model)
        if bad:  # its answers would be noise: an accuracy of 0.0000 that says nothing
            sys.exit(
                f"error: {path} has non-finite weights ({bad}): a diverged run's model? evaluate an earlier checkpoint"
            )
        if greedy:
            use_greedy(trainer)
        metrics, problems, _ = evaluate_model(trainer, args.eval_samples, args.eval_batch_size)
        results[path] = metrics
        records += [{"model": path, **problem} for problem in problems]
    if not trainer.world.is_main:
        return results
    decoding = "greedy" if greedy else f"temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}"
    settings = dict(
        data_path=args.data_path, split="test", decoding=decoding, max_generate_length=args.max_generate_length
    )
    settings["answer_checker"] = args.answer_checker
    settings |= dict(eval_samples=args.eval_samples, eval_num_generations=args.eval_num_generations, seed=args.seed)
    output = {"settings": settings, "models": results}
    if len(results) == 2:
        before, after = results.values()
        output["difference"] = {name: after[name] - before[name] for name in before}
    try:  # a full disk: one line
        with writing("the results", os.path.join(args.output_dir, "eval_results.json")):
            with open(os.path.join(args.output_dir, "eval_results.json"), "w", encoding="utf-8") as f:
                json.dump(output, f, indent=2, ensure_ascii=False)
            with open(os.path.join(args.output_dir, "eval_samples.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    except WriteFailed as error:
        sys.exit(f"error: {error}")
    print(f"{decoding} decoding, {args.eval_num_generations} response(s) per problem, test split of {args.data_path}:")
    print(comparison_table(results))
    print(f"wrote {args.output_dir}/eval_results.json and eval_samples.jsonl")
    return results
