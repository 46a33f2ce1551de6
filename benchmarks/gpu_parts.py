#!/usr/bin/env python
"""The Python parts of benchmarks/gpu_check.sh, one per call; each prints what it found.

    python benchmarks/gpu_parts.py env                          torch, CUDA, the GPU; each package's version or
                                                                "missing", and how to bring what is missing
    python benchmarks/gpu_parts.py resume --device cuda         a run stopped by SIGTERM with buffered groups and a
                                                                half-done rollout, resumed: against an uninterrupted run
    torchrun --standalone --nproc_per_node=1 benchmarks/gpu_parts.py fsdp --device cuda     the same with --fsdp
    python benchmarks/gpu_parts.py logprobs --device cuda       bf16 log-probs against float32 ones (1.5B's shape)
    python benchmarks/gpu_parts.py graphs --device cuda         the default sampler (CUDA graphs) against generate
    python benchmarks/gpu_parts.py vllm_call --device cuda      one vLLM call of 64 prompts x G 16: the sampler gap
    python benchmarks/gpu_parts.py sleep --device cuda          use_vllm with sleep mode: memory freed while training

Nothing is downloaded and `datasets` is not needed: the models are random (tiny_world's shape for the runs, Qwen2.5-
1.5B's with its 151,936-id vocabulary for the log-probs and vLLM; --shape small on a CPU), the problems are
tiny_world's, held in memory. Exit status: 0 ok, 1 a check did not hold, 77 skipped (the reason on the last line).
"""

import argparse
import contextlib
import importlib
import importlib.util
import io
import os
import signal
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
SKIPPED = 77
# What a bare GPU machine may lack, and the pinned version (requirements*.txt) to bring as wheels.
PACKAGES = {"transformers": "5.19.0", "datasets": "5.2.0", "peft": "0.21.2", "vllm": "0.32.0", "matplotlib": "3.11.2"}


def skip(reason):
    print(f"skipped: {reason}")
    sys.exit(SKIPPED)


def check(findings):
    """Print each (holds, what) line; exit 1 if one does not hold."""
    for holds, what in findings:
        print(f"  {'ok    ' if holds else 'FAILED'} {what}")
    if not all(holds for holds, _ in findings):
        sys.exit(1)


# ---------- env ----------
def environment(opts):
    cuda = torch.version.cuda or "none (a CPU build)"
    print(f"  python {sys.version.split()[0]}; torch {torch.__version__}, CUDA {cuda}")
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(
            f"  GPU {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
            f"{props.major}.{props.minor}"
        )
    if not torch.cuda.is_available():
        print("  GPU: none visible to torch")
    missing = []
    for name, tested in PACKAGES.items():
        try:
            print(f"  {name:<13}{importlib.import_module(name).__version__} (tested: {tested})")
        except Exception as error:  # noqa: BLE001 - absent, or present and broken: missing either way
            print(f"  {name:<13}missing ({type(error).__name__}: {str(error).splitlines()[0][:80]})")
            missing.append(f"{name}=={tested}")
    if missing:
        wanted = " ".join(missing)
        print("  to bring them without network here: on a machine with network, the same Python version and CPU")
        print(f"  architecture: pip download {wanted} -d wheels")
        print("  (it takes their dependencies too); copy wheels/ here, then:")
        print(f"  {sys.executable} -m pip install --no-index --find-links wheels {wanted}")
        print("  (vllm==0.32.0 brings torch 2.13 with it: install it in a virtual environment of its own)")


# ---------- resume and fsdp: a run on tiny_world's shape ----------
class Problems(torch.utils.data.Dataset):
    """tiny_world's problems as GSM8KDataset's items ({"prompt", "answer"}), held in memory: no `datasets`."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        from dapo_utils.data import ANSWER_COLUMN, QUESTION_COLUMN, read_answer

        row = self.rows[index]
        return {"prompt": row[QUESTION_COLUMN], "answer": read_answer(row[ANSWER_COLUMN], "number")}


def tiny_trainer(output_dir, **settings):
    """A DapoTrainer on a random 2-layer Qwen2 (tiny_world's shape, the same weights every time) and tiny_world's
    problems; settings override DapoArguments."""
    from dapo_utils.tiny_world import build_tiny_model, build_tokenizer, chatml_prompt, ideal_response, make_splits
    from reward_func import correctness_reward, digit_reward, hard_format_reward, mark_reward
    from train import SYSTEM_PROMPT, DapoArguments, DapoTrainer

    splits = make_splits(32, 8, seed=0)
    texts = [
        chatml_prompt(SYSTEM_PROMPT, r["question_zh-cn"]) + ideal_response(r) for rows in splits.values() for r in rows
    ]
    tokenizer = build_tokenizer(texts, vocab_size=120)
    args = DapoArguments(model_path="random", data_path="memory", output_dir=output_dir, **settings)
    rewards = [correctness_reward, digit_reward, hard_format_reward, mark_reward]
    model = build_tiny_model(tokenizer, seed=0)
    return DapoTrainer(model, rewards, args, Problems(splits["train"]), Problems(splits["test"]), tokenizer)


def resume_check(opts, fsdp=False):
    """A reference run of 2 steps; the same run stopped by SIGTERM in step 1 (its checkpoint holds buffered groups and
    a rollout with one of its two steps done); a new trainer resumes it: every restored tensor on the model's device,
    steps 1-2 logged once, the final weights against the reference's."""
    from dapo_utils.checkpoints import resume_run
    from dapo_utils.curves import read_jsonl
    from dapo_utils.options import run_command

    out = opts.out or tempfile.mkdtemp(prefix="gpu_check_resume_")
    settings = dict(device=opts.device, fsdp=fsdp, max_steps=2, steps_per_generation=2, generation_batch_size=6)
    settings |= dict(filter_metric="none", max_generate_length=16, lr=1e-4, eval_samples=4, save_steps=100)
    reference = tiny_trainer(os.path.join(out, "reference"), **settings)
    reference.train()
    final = {name: value.detach().float().cpu() for name, value in full_state(reference).items()}

    stopped = tiny_trainer(os.path.join(out, "stopped"), **settings)
    step = stopped.optimizer.step

    def step_with_sigterm(*args, **kwargs):  # what SLURM or Kubernetes sends before a kill, in step 1
        if stopped.state.update_steps == 0 and not stopped.stop_requested:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args, **kwargs)

    stopped.optimizer.step = step_with_sigterm
    printed = io.StringIO()  # the stop message, checked below
    try:
        with contextlib.redirect_stdout(printed):
            stopped.train()
    except KeyboardInterrupt:  # checkpoints.stop_if_requested: after its checkpoint
        pass
    print(printed.getvalue(), end="")
    checkpoint = os.path.join(out, "stopped", "checkpoint_1")
    resumed = tiny_trainer(os.path.join(out, "stopped"), **settings)
    resume_run(resumed, checkpoint)
    state = resumed.state
    restored = [
        t for item in [*state.buffer, *(state.rollout or [])] for t in vars(item).values() if torch.is_tensor(t)
    ]
    devices = sorted({str(t.device) for t in restored})
    model_device = str(next(resumed.model.parameters()).device)
    held = f"{len(state.buffer)} buffered groups, a rollout with {state.updates_done} of its 2 steps done"
    half_done = os.path.isdir(checkpoint) and len(state.buffer) > 0 and state.updates_done == 1
    resumed.train()
    steps = [r["step"] for r in read_jsonl(os.path.join(out, "stopped", "metrics.jsonl"))]
    gap = max((final[k] - v.detach().float().cpu()).abs().max().item() for k, v in full_state(resumed).items())
    print(f"  checkpoint_1 after SIGTERM in step 1: {held}; restored on {devices}, the model on {model_device}")
    print(f"  the resumed run's final weights against the uninterrupted run's: max |difference| {gap:.3g}")
    hint = f"{run_command(1, fsdp)} --resume="  # this interpreter (with torch's launcher under --fsdp)
    check([
        (hint in printed.getvalue(), f"the stop message's command: {hint}..."),
        (half_done, "a checkpoint with buffered groups and a half-done rollout"),
        (bool(restored) and devices == [model_device], "every restored tensor on the model's device"),
        (steps == [1, 2], f"steps logged once each: {steps}"),
        (resumed.state.update_steps == 2 and gap == gap, "the resumed run finished step 2 with finite weights"),
    ])  # fmt: skip


def full_state(trainer):
    state = trainer.world.full_model_state(trainer.model)  # --fsdp: gathered; else None
    return trainer.model.state_dict() if state is None else state


# ---------- bf16 log-probs against float32 ----------
def logprobs_check(opts):
    """log pi of random tokens from a random model of Qwen2.5-1.5B's shape (--shape small on a CPU) through the
    trainer's path (kernels.output_layer_scores), in float32 and under bf16 autocast, at temperatures 1 and 0.7:
    float32 against the plain log_softmax of the logits (the kernel itself), bf16 against float32 (the learner's own
    bf16 error, which the sampler/learner gap guard must leave room for)."""
    from bench import build_model
    from dapo_utils.kernels import output_layer_scores
    from dapo_utils.trackers import percentile
    from train import DapoArguments

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32
    tokenizer = tiny_tokenizer()
    model = build_model(opts.shape, tokenizer, opts.device, seed=0).eval()
    rows, length = (4, 512) if opts.device.startswith("cuda") else (2, 64)
    ids = torch.randint(model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(opts.device)
    labels = ids[:, 1:]
    findings = []
    for temperature in (1.0, 0.7):
        results = {}
        for name, dtype in (("float32", None), ("bf16", torch.bfloat16)):
            with torch.no_grad(), torch.autocast(opts.device.split(":")[0], dtype=dtype, enabled=dtype is not None):
                with output_layer_scores(model, labels, temperature):
                    results[name] = model(ids[:, :-1]).logits[..., 0].float()  # [N, T]
        with torch.no_grad():
            plain = (
                (model(ids[:, :-1]).logits.float() / temperature).log_softmax(-1).gather(-1, labels[..., None])[..., 0]
            )
        kernel = (results["float32"] - plain).abs().max().item()
        ranked = sorted((results["bf16"] - results["float32"]).abs().flatten().tolist())
        mean = sum(ranked) / len(ranked)
        print(f"  T {temperature}: |bf16 - float32| per token over {len(ranked)} tokens: mean {mean:.2e}, p50 "
              f"{percentile(ranked, 0.5):.2e}, p95 {percentile(ranked, 0.95):.2e}, max {ranked[-1]:.2e}; float32 "
              "kernel "
              f"against log_softmax(logits): max {kernel:.1e}")  # fmt: skip
        threshold = DapoArguments.vllm_logprob_diff_threshold
        findings += [(kernel < 1e-3, f"T {temperature}: the float32 kernel computes log_softmax(logits / T)")]
        findings += [
            (mean < threshold / 2, f"T {temperature}: the bf16 error leaves room under the guard's {threshold}")
        ]
    check(findings)


def tiny_tokenizer():
    from dapo_utils.tiny_world import build_tokenizer, chatml_prompt, make_problems
    from train import SYSTEM_PROMPT

    return build_tokenizer([chatml_prompt(SYSTEM_PROMPT, r["question_zh-cn"]) for r in make_problems(64, 0)], 120)


# ---------- the default sampler: CUDA graphs ----------
def graphs_check(opts):
    """The default sampler on this device against plain generate, on a random model of Qwen2.5-1.5B's shape (--shape
    small on a CPU) under the trainer's autocast: 8 rows (2 prompts x G 4), 128 new tokens (16 on a CPU), greedy (top-k 1) so that
    the paths can be compared token for token. On CUDA the default is decoding.generate_with_graphs (a static cache;
    generate compiles its decode step to CUDA graphs: the first call pays the compilation, timed apart); the CPU runs
    it eagerly, its default being decoding.decode. Prints each path's seconds per call and tokens per second."""
    from bench import build_model
    from dapo_utils.decoding import Sampling, decode, generate, generate_with_graphs

    cuda = opts.device.startswith("cuda")
    model = build_model(opts.shape, tiny_tokenizer(), opts.device, seed=0).eval()
    rows = torch.randint(model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    ids = rows.repeat_interleave(4, dim=0).to(opts.device)  # [8, 64]
    mask = torch.ones_like(ids)
    tokens = 128 if cuda else 16
    settings = Sampling(tokens, [], 0, 0.9, 1, 1.0)  # no EOS id: every row runs to the budget
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def timed(sampler):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            out = sampler(model, ids, mask, settings)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    first, _ = timed(generate_with_graphs)  # compiles on CUDA
    results = {name: min(timed(f) for _ in range(2)) for name, f in (
        ("generate_with_graphs", generate_with_graphs), ("generate (plain)", generate), ("decode", decode))}  # fmt: skip
    print(f"  generate_with_graphs' first call (compilation on CUDA): {first:.2f} s")
    for name, (seconds, _) in results.items():
        print(f"  {name:<22} {seconds:6.3f} s a call, {8 * tokens / seconds:7.0f} tokens/s")
    graphs, plain = results["generate_with_graphs"], results["generate (plain)"]
    agree = (graphs[1] == plain[1]).float().mean().item()
    print(f"  tokens equal to plain generate's: {agree:.1%} (bf16 kernels may round differently once compiled)")
    findings = [(agree > 0.9, "generate_with_graphs draws what plain generate draws (greedy)")]
    if cuda:
        findings += [(graphs[0] < plain[0], "CUDA graphs decode faster than plain generate")]
    check(findings)


# ---------- vLLM ----------
def vllm_call(opts):
    """One large vLLM call as a rollout makes it: 64 prompts x G 16 (1,024 rows, past vLLM's batched-token budget:
    chunked prefill on CUDA); the policy scores the same tokens (bf16 autocast on CUDA, as the trainer does): the
    sampler/learner gap's percentiles against the stale-weight guard; the same seeds again give the same tokens."""
    import random

    from bench import build_model
    from dapo_utils.tiny_world import chatml_prompt, make_problems
    from dapo_utils.trackers import percentile
    from dapo_utils.vllm_sampler import VllmSampler
    from train import SYSTEM_PROMPT, DapoArguments

    cuda = opts.device.startswith("cuda")
    prompts = [chatml_prompt(SYSTEM_PROMPT, row["question_zh-cn"]) for row in make_problems(64, seed=0)]
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "left"
    model = build_model(opts.shape, tokenizer, opts.device, seed=0).eval()
    dtype, max_tokens = (torch.bfloat16, 64) if cuda else (torch.float32, 8)
    sampler = VllmSampler(model, opts.device, dtype, 512, opts.vllm_gpu_memory_utilization, seed=0)
    batch = tokenizer([p for p in prompts for _ in range(16)], return_tensors="pt", padding=True).to(opts.device)
    ids, mask = batch["input_ids"], batch["attention_mask"]  # [1024, P]
    runs = []
    for _ in range(2):
        sampler.rng = random.Random(0)  # the same per-request seeds
        sampler.llm.reset_prefix_cache()  # and the same prefill, not the first call's cached blocks
        start = time.perf_counter()
        runs.append(sampler.sample(ids, mask, tokenizer.pad_token_id, 1.0, 1.0, 0, max_tokens, []))
        seconds = time.perf_counter() - start
    responses, vllm_log_probs = runs[0][0][:, ids.size(1) :], runs[0][1]  # [1024, T] each
    gaps = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
        for rows in torch.arange(len(ids)).split(64):
            sequence = torch.cat([ids[rows], responses[rows]], dim=1)
            attention = torch.cat([mask[rows], torch.ones_like(responses[rows])], dim=1)
            position_ids = (attention.cumsum(dim=-1) - 1).clamp(min=0)
            keep = responses.size(1) + 1  # the logits that predict the response tokens (and one past them)
            inputs = dict(attention_mask=attention, position_ids=position_ids, logits_to_keep=keep)
            logits = model(sequence, **inputs).logits[:, :-1]
            log_probs = logits.float().log_softmax(dim=-1).gather(-1, responses[rows, :, None])[..., 0]
            gaps += (log_probs - vllm_log_probs[rows]).abs().flatten().tolist()
    ranked, threshold = sorted(gaps), DapoArguments.vllm_logprob_diff_threshold
    mean, same = sum(ranked) / len(ranked), torch.equal(runs[0][0], runs[1][0])
    print(f"  {len(ids)} rows, {int(mask.sum())} prompt tokens, {responses.size(1)} tokens each, {seconds:.1f} s")
    print(f"  |policy - vLLM| log-prob over {len(ranked)} tokens ({dtype}): mean {mean:.2e}, p50 "
          f"{percentile(ranked, 0.5):.2e}, p95 {percentile(ranked, 0.95):.2e}, max {ranked[-1]:.2e}")  # fmt: skip
    check(
        [
            (mean < threshold, f"the gap's mean under the guard's threshold {threshold}"),
            (same, "same seeds, same tokens"),
        ]
    )


def sleep_check(opts):
    """use_vllm with vllm_enable_sleep_mode on the tiny run: 3 steps and an evaluation; the free GPU memory while the
    policy trains against while vLLM generates (vLLM's share must come back), and the gap guard never stops it."""
    if not opts.device.startswith("cuda"):
        skip("sleep mode frees GPU memory: it needs CUDA")
    out = opts.out or tempfile.mkdtemp(prefix="gpu_check_sleep_")
    settings = dict(device=opts.device, use_vllm=True, vllm_enable_sleep_mode=True, max_steps=3, eval_steps=2)
    trainer = tiny_trainer(out, filter_metric="none", max_generate_length=16, eval_samples=8, **settings)
    free = {"training": [], "sampling": []}
    train_step, sample = trainer.train_step, trainer.vllm.generate

    def measured_train_step(*args, **kwargs):
        free["training"].append(torch.cuda.mem_get_info()[0])
        return train_step(*args, **kwargs)

    def measured_generate(*args, **kwargs):
        free["sampling"].append(torch.cuda.mem_get_info()[0])
        return sample(*args, **kwargs)

    trainer.train_step, trainer.vllm.generate = measured_train_step, measured_generate
    trainer.train()
    freed = (min(free["training"]) - max(free["sampling"])) / 2**30
    gap = max(r.get("vllm/logprob_diff_max") or 0.0 for r in trainer.history)  # null: no fresh token
    print(
        f"  free GPU memory: {min(free['training']) / 2**30:.2f} GiB or more while training, "
        f"{max(free['sampling']) / 2**30:.2f} GiB or less while vLLM generates; largest gap per token {gap:.2e}"
    )
    check([(trainer.state.update_steps == 3, "3 steps and 2 evaluations, every sync and wake in order"),
           (freed > 0, f"sleep mode gives back {freed:.2f} GiB while the policy trains")])  # fmt: skip


PARTS = dict(env=environment, resume=resume_check, fsdp=lambda opts: resume_check(opts, fsdp=True))
PARTS |= dict(logprobs=logprobs_check, graphs=graphs_check, vllm_call=vllm_call, sleep=sleep_check)
NEEDS = dict(vllm_call="vllm", sleep="vllm")  # a part -> the package it cannot run without


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default=None, help="bench.py's model shape (default: qwen2.5-1.5b on CUDA)")
    parser.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3)
    parser.add_argument("--out", default=None, help="where the runs write (default: a temporary folder)")
    opts = parser.parse_args(argv)
    opts.shape = opts.shape or ("qwen2.5-1.5b" if opts.device.startswith("cuda") else "small")
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        skip("no CUDA device visible to torch (gpu_check.sh --cpu runs the CPU dry run)")
    if opts.part in NEEDS and importlib.util.find_spec(NEEDS[opts.part]) is None:
        skip(f"needs {NEEDS[opts.part]} (gpu_parts.py env says how to bring it)")
    PARTS[opts.part](opts)


if __name__ == "__main__":
    main()
