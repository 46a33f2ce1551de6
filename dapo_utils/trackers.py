"""Metrics: a micro-batch's loss diagnostics (loss_diagnostics), one record per optimizer step (step_record, with
percentile), written to metrics.jsonl by the trainer and, with report_to, to TensorBoard, Weights & Biases or
Trackio (make_tracker, scalars). Each package is imported only when named."""

import importlib
import math
import os
from statistics import fmean, stdev

import torch


def round_metrics(rewards, keep, responses, lengths, truncated):
    """A sampling round's numbers for the step log, one value per group or response: rewards [B, G] (totals), keep
    [B] (dynamic sampling's verdict), responses (B * G texts), lengths and truncated [B * G]."""
    G, reward_std = rewards.size(1), rewards.std(dim=1)  # [B]
    alike = [len(set(responses[g * G : (g + 1) * G])) == 1 for g in range(rewards.size(0))]  # [B]
    return {
        "reward": rewards.flatten().tolist(),
        "reward_std": reward_std.tolist(),
        "frac_reward_zero_std": (reward_std == 0).float().tolist(),
        "frac_groups_skipped": (~keep).float().tolist(),
        "frac_identical_groups": [float(a) for a in alike],  # a collapsed policy: guards.check_rounds
        "completions/length": lengths.tolist(),
        "completions/clipped_ratio": truncated.float().tolist(),
    }


def step_record(step, metrics):
    """One optimizer step's metrics ({name: values from every micro-step, group or response}) as one record:
    totals for times, loss, tokens, model FLOPs and failed answer checks; mean / min / max response length; mean and std per
    reward function (None rewards, NaN here, are not counted); the largest of the maxima; the mean of everything else.
    Per-token values (a list per micro-step: vllm_sampler.sampler_correction's) are reduced over the step's tokens: the
    gap's mean, median, 95th percentile and maximum (fresh and lagged groups apart), the weights' effective sample
    size, shares as token means; lagged groups are counted. A name with no value this step (no lagged group, a
    micro-batch whose tokens were all filtered out: None) keeps its keys, as None: every record has the same keys
    whichever groups happened to lag, and JSON writes them as null."""
    record = {"step": step}
    for key, values in metrics.items():
        if values and isinstance(values[0], list):  # per-token values, a list per micro-step: the step's tokens
            values = [value for part in values for value in part]
        values = [
            value for value in values if value is not None and not (key.startswith("rewards/") and math.isnan(value))
        ]
        record.update(reduce_metric(key, values))
    if record.get("time/sampling") and record.get("sampled_tokens") is not None:
        record["sampled_tokens_per_second"] = record["sampled_tokens"] / record["time/sampling"]
    if record.get("time/training") and record.get("num_tokens") is not None:
        record["train_tokens_per_second"] = record["num_tokens"] / record["time/training"]
    return record


def reduce_metric(key, values):
    """{record key: value} of one metric's values this step; each key None when there are none."""
    some = bool(values)
    if key.startswith(("time/", "reward_errors/", "reward_timeouts/")) or key in SUMMED:
        return {key: sum(values)}
    if key == "completions/length":
        keys = ("completions/mean_length", "completions/min_length", "completions/max_length", "sampled_tokens")
        return dict(zip(keys, (fmean(values), min(values), max(values), sum(values)) if some else (None,) * 4))
    if key.startswith("rewards/"):  # per reward function, as TRL names them
        spread = (stdev(values) if len(values) > 1 else 0.0) if some else None
        return {f"{key}/mean": fmean(values) if some else None, f"{key}/std": spread}
    if key in ("vllm/logprob_diff", "vllm/lag_logprob_diff"):  # |log pi_old - log pi_vLLM| per response token
        ranked = sorted(values)
        stats = (fmean(ranked), percentile(ranked, 0.5), percentile(ranked, 0.95), ranked[-1]) if some else (None,) * 4
        return {f"{key}_{name}": value for name, value in zip(("mean", "p50", "p95", "max"), stats)}
    if key == "vllm/is_weight":  # normalised effective sample size (sum w)^2 / (N sum w^2), 1 = all equal
        squares = sum(w * w for w in values)
        return {"vllm/is_ess": sum(values) ** 2 / (len(values) * squares) if squares else (0.0 if some else None)}
    if not some:
        return {key: None}
    return {key: max(values) if key.endswith("_max") else fmean(values)}


# step_record's totals (and time/*, reward_*/*); perf/sampling_bound is seconds, as time/* are
SUMMED = ("loss", "num_tokens", "vllm/lagged_groups", "perf/flops", "perf/sampling_bound")


@torch.no_grad()
def loss_diagnostics(ratio, advantages, entropy, kl, action_mask, clip_eps_low, clip_eps_high):
    """A micro-batch's diagnostics over its response tokens (each None if it has none: all filtered out, or --fsdp's
    placeholder micro-batch without rows): the share of tokens
    clipped below (A < 0) and above (A > 0) by Eq. (10), the entropy and, when kl is given, the k3 KL.
    ratio, entropy, kl, action_mask: [N, T]; advantages: [N]. One read from the device for all of them (on CUDA
    each read waits for the queued kernels)."""
    mask = action_mask.bool()
    A = advantages.unsqueeze(1).expand_as(ratio)
    low, high = (ratio < 1 - clip_eps_low) & (A < 0), (ratio > 1 + clip_eps_high) & (A > 0)
    values = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "entropy": entropy}
    values |= {} if kl is None else {"kl": kl}
    sums = [torch.where(mask, value, 0).sum(dtype=torch.float64) for value in values.values()]  # over the tokens
    *sums, count = torch.stack([*sums, mask.sum(dtype=torch.float64)]).tolist()
    return {name: total / count if count else None for name, total in zip(values, sums)}


def progress_postfix(record, accuracy):
    """The progress bar's numbers from a step's record and the last evaluation's strict accuracy."""
    shown = {key: math.nan if value is None else value for key, value in record.items()}
    postfix = dict(loss=f"{shown['loss']:.4f}", reward=f"{shown.get('reward', math.nan):.3f}")
    postfix.update(skipped=f"{shown.get('frac_groups_skipped', 0.0):.2f}", acc=f"{accuracy:.2f}")
    return postfix | {"tok/s": f"{shown['perf/throughput']:.0f}", "mfu": f"{shown['perf/mfu']:.2%}"}


def percentile(ranked, q):
    """The q-quantile of sorted values, interpolated linearly between the closest ranks (numpy's default)."""
    position = q * (len(ranked) - 1)
    low = int(position)
    high = min(low + 1, len(ranked) - 1)
    return ranked[low] + (ranked[high] - ranked[low]) * (position - low)


def make_tracker(report_to, output_dir, config):
    """A tracker with log(record) and close(); records are metrics.jsonl's dicts with a "step"."""
    if report_to == "tensorboard":
        return TensorBoard(os.path.join(output_dir, "runs"))
    if report_to in ("wandb", "trackio"):  # the same init / log / finish interface
        return RunTracker(importlib.import_module(report_to), config)
    return NoTracker()


def scalars(record):
    return {key: value for key, value in record.items() if key != "step" and isinstance(value, (int, float))}


class NoTracker:
    def log(self, record):
        pass

    def close(self):
        pass


class TensorBoard:
    def __init__(self, log_dir):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir)

    def log(self, record):
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self):
        self.writer.close()


class RunTracker:
    def __init__(self, module, config):
        self.module = module
        module.init(project="dapo", config=config)

    def log(self, record):
        self.module.log(scalars(record), step=record["step"])

    def close(self):
        self.module.finish()
