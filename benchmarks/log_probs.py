#!/usr/bin/env python
"""train.py's hand-written SelectiveLogSoftmax against two plain log-prob paths, side by side.

    python benchmarks/log_probs.py [--rounds 3] [--rows 4] [--prompt 120] [--response 128] [--dtype float32]

On bench.py's "small" random Qwen2 (real vocabulary, 151,936 ids): forward + backward of
DapoTrainer.get_action_log_probs (with the entropy) for rows x (prompt + response) tokens, with each
candidate in place of train.selective_log_softmax, in rounds A B C A B C ... in one process. Also
the candidate alone on fixed [rows, response, V] logits. Peak memory: the kernel's peak RSS (VmHWM,
reset before each call) over the RSS before it. --dtype bfloat16 casts the logits first, as bf16
autocast makes them on CUDA (CPU times are then not representative, memory is).
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import build_model, load_tokenizer, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

import train  # noqa: E402

HAND_WRITTEN = train.selective_log_softmax


def full_log_softmax(logits, labels):
    """(a) One float32 log-softmax over [N, T, V], then gather; the entropy from it, without a gradient."""
    all_log_probs = logits.float().log_softmax(dim=-1)
    log_probs = all_log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(all_log_probs.exp() * all_log_probs).sum(dim=-1)
    return log_probs, entropy


def row_logsumexp(logits, labels):
    """(b) TRL's selective_log_softmax: gather - per-row logsumexp; the entropy per row, without a gradient."""
    lse = torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])  # [N, T]
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float() - lse
    with torch.no_grad():
        entropy = torch.stack([l - (r.float() - l.unsqueeze(-1)).exp().mul_(r).sum(-1) for r, l in zip(logits, lse)])
    return log_probs, entropy


CANDIDATES = {
    "hand-written (train.py)": HAND_WRITTEN,
    "(a) float log_softmax + gather": full_log_softmax,
    "(b) per-row logsumexp (TRL)": row_logsumexp,
}


def measure(fn):
    """Seconds and peak RSS above the level before, of fn()."""
    base, exact = rss_bytes(), reset_peak_rss()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, peak_rss_bytes() - base, exact


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=120)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=0)
    opts = parser.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)

    from tiny_world import build_tiny_world

    with tempfile.TemporaryDirectory() as root:
        model_dir, _ = build_tiny_world(root, train.SYSTEM_PROMPT, num_train=4, num_test=1, seed=0)
        tokenizer = load_tokenizer(model_dir)
        model = build_model("small", tokenizer, "cpu", 0)
        args = train.DapoArguments(device="cpu", output_dir=os.path.join(root, "out"))
        trainer = train.DapoTrainer(
            model=model,
            reward_funcs=[lambda prompts, responses, answers: [0.0] * len(responses)],
            args=args,
            tokenizer=tokenizer,
        )
    N, T, V = opts.rows, opts.response, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (N, opts.prompt + T), generator=g)
    mask = torch.ones_like(ids)
    mask[:, : opts.prompt // 4] = 0  # some left padding
    weights = torch.randn(N, T, generator=g)
    logits = torch.randn(N, T, V, generator=g).to(dtype)
    labels = ids[:, -T:]

    def whole(fn):  # get_action_log_probs forward + backward, with fn as its log-softmax
        def run():
            train.selective_log_softmax = lambda x, y: fn(x.to(dtype), y)
            log_probs, entropy = trainer.get_action_log_probs(model, ids, mask, T, with_entropy=True)
            (log_probs * weights).sum().backward()
            model.zero_grad(set_to_none=True)
            return log_probs.detach(), entropy

        return run

    def alone(fn):  # the log-softmax by itself on fixed logits
        def run():
            x = logits.detach().requires_grad_()
            log_probs, entropy = fn(x, labels)
            (log_probs * weights).sum().backward()
            return log_probs.detach(), entropy, x.grad

        return run

    # Same values first.
    ref = alone(HAND_WRITTEN)()
    for name, fn in CANDIDATES.items():
        out = alone(fn)()
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref)]
        print(f"{name:<32} max |d log p| {diffs[0]:.1e}  |d entropy| {diffs[1]:.1e}  |d grad| {diffs[2]:.1e}")
    for kind, wrap in (("get_action_log_probs fwd+bwd", whole), ("log-softmax alone fwd+bwd", alone)):
        wrap(HAND_WRITTEN)()  # warm-up
        times, peaks = {n: [] for n in CANDIDATES}, {n: [] for n in CANDIDATES}
        for r in range(opts.rounds):  # A B C, C B A, ...
            for name in list(CANDIDATES)[:: 1 if r % 2 == 0 else -1]:
                seconds, peak, exact = measure(wrap(CANDIDATES[name]))
                times[name].append(seconds)
                peaks[name].append(peak)
        print(
            f"\n{kind}: {N} rows x ({opts.prompt} + {T}) tokens, V={V}, {opts.dtype} logits, {torch.get_num_threads()} threads, "
            f"{opts.rounds} rounds (VmHWM reset: {exact})"
        )
        base = min(times["hand-written (train.py)"])
        for name in CANDIDATES:
            print(
                f"  {name:<32} best {min(times[name]):6.3f} s  median {sorted(times[name])[len(times[name]) // 2]:6.3f} s"
                f"  x hand {min(times[name]) / base:5.2f}  peak +{max(peaks[name]) / 2**20:6.0f} MiB"
            )
    train.selective_log_softmax = HAND_WRITTEN


if __name__ == "__main__":
    main()
