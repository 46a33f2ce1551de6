#!/usr/bin/env python
"""Peak memory and time of one micro-step (forward + backward of the loss) by response length, side by side.

    python benchmarks/log_probs.py [--lengths 512,2048,8192,16384] [--runners seed,trl,ours,ours+gc]
                                   [--fit 128,256] [--max_gb 10] [--rows 2] [--prompt 64] [--threads 2] [--stage]

Runners: "seed" = the seed's log-probs (seed_paths.full_log_softmax: logits at every position and a float32
log-softmax over them); "trl" = TRL 1.16's GRPOTrainer(loss_type="dapo", its default settings).compute_loss (pip
install trl==1.16.0); "ours" = DapoTrainer.compute_loss (log-probs from the hidden states); "ours+gc" = the same
with gradient_checkpointing. Each micro-step runs in a fresh process on a random 2-layer Qwen2 with Qwen2.5-1.5B's
hidden size (1,536, intermediate 8,960) and Qwen2.5's 151,936 ids, tied embeddings, float32 on the CPU: rows x
(prompt + length) tokens, all of them real, after a 16-token micro-step that allocates the gradients. Peak: the
kernel's peak RSS (VmHWM, reset before the micro-step) over the RSS before it (weights and gradients are in the RSS
before), under glibc's own heap policy for every runner (train.py's CPU setting kernels.reuse_freed_memory keeps
freed memory in the process: +0.5 GiB of RSS that is not live tensors); with --device cuda, max_memory_allocated
over memory_allocated, under bf16 autocast as train.py runs it. Time: CPU seconds of the micro-step (process_time,
all threads; CUDA: wall seconds).

--stage: the loss stage alone, from the last hidden states to the loss (the output layer, the log-probs, the DAPO
loss, forward + backward), for "seed" and "ours": the same trainer code, with a model that is nothing but its
output layer over hidden states given as a leaf [rows, prompt + length, hidden]; what the decoder holds is left out.

Peak memory is linear in the length at fixed rows, so each runner is measured at the --fit lengths, a line
a + b * length fitted to them, and a length of the table is measured only when the line puts its peak under
--max_gb; the others are computed from the line (marked "~"). "trains on 24 GB" (--budget_gb): the memory
before the micro-step (weights, gradients, the process), Adam's two moments (8 bytes per parameter) and the
micro-step's peak under 24 GiB; the longest such length is computed from the line.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

RUNNERS = ("seed", "trl", "ours", "ours+gc")
SHAPE = dict(num_hidden_layers=2, hidden_size=1536, intermediate_size=8960, num_attention_heads=12)
SHAPE |= dict(num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
GIB = 2**30


def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS (Linux >= 4.0)


class OutputLayerOnly(torch.nn.Module):
    """A causal LM with nothing before its output layer: hidden [N, W, H] (a leaf) stands for the last hidden
    states; forward returns the output layer's logits at logits_to_keep (an index tensor) or at every position."""

    def __init__(self, hidden, lm_head):
        super().__init__()
        self.hidden, self.lm_head = hidden, lm_head

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, logits_to_keep=0, **kwargs):
        hidden = self.hidden if isinstance(logits_to_keep, int) else self.hidden[:, logits_to_keep]
        return types.SimpleNamespace(logits=self.lm_head(hidden))


def ours(model, tokenizer_dir, rows, checkpointing, seed_path, device, stage=False):
    """micro_step(ids [N, P+T], T): DapoTrainer.compute_loss(...).backward() on one micro-batch; stage: on an
    OutputLayerOnly of the model's output layer over random hidden states (the loss stage alone)."""
    from seed_paths import keep_glibc_heap_policy, use_seed_paths
    from transformers import AutoTokenizer

    from train import DapoArguments, DapoTrainer, MicroBatch

    keep_glibc_heap_policy()  # as for TRL: RSS then counts live tensors, not the heap train.py keeps for sampling

    args = DapoArguments(device=device, output_dir=tempfile.mkdtemp(), num_generations=rows)  # CUDA: bf16 autocast
    args.gradient_checkpointing = checkpointing
    zero = [lambda prompts, responses, answers: [0.0] * len(responses)]
    trainer = DapoTrainer(
        model=model, reward_funcs=zero, args=args, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir)
    )
    if seed_path:
        use_seed_paths(trainer, "full_log_softmax")

    def micro_step(ids, T):
        advantages = torch.linspace(-1, 1, len(ids), device=ids.device)  # [N]
        inputs = MicroBatch(ids, torch.ones_like(ids), action_mask=torch.ones_like(ids[:, -T:]), advantages=advantages)
        policy = trainer.model
        if stage:
            hidden = torch.randn(*ids.shape, model.config.hidden_size, device=ids.device, requires_grad=True)
            policy = OutputLayerOnly(hidden, model.get_output_embeddings())  # [N, P+T, H] -> the loss
        trainer.compute_loss(policy, inputs).backward()

    return micro_step


def trl(model, tokenizer_dir, rows, device):
    """micro_step(ids, T): TRL's GRPOTrainer(loss_type="dapo").compute_loss(...).backward(), default settings."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cuda = device.startswith("cuda")
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=not cuda, bf16=cuda, loss_type="dapo", num_generations=rows
    )
    config.per_device_train_batch_size, config.report_to = rows, []
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["1 + 1 ="] * rows}),
        processing_class=AutoTokenizer.from_pretrained(tokenizer_dir),
    )

    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps  # set by TRL's training loop

    def micro_step(ids, T):
        prompt, completion = ids[:, :-T], ids[:, -T:]
        inputs = dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion)
        inputs |= dict(completion_mask=torch.ones_like(completion), advantages=torch.linspace(-1, 1, len(ids)))
        inputs["num_items_in_batch"] = torch.tensor(float(completion.numel()))
        trainer.compute_loss(trainer.model, inputs).backward()

    return micro_step


def worker(runner, length, opts):
    """One micro-step of `runner` at `length` in this process: prints a JSON line."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(opts.threads)
    torch.manual_seed(0)
    cuda = opts.device.startswith("cuda")
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE | dict(num_hidden_layers=opts.layers))).to(opts.device)
    if runner == "trl":
        micro_step = trl(model, opts.tokenizer_dir, opts.rows, opts.device)
    else:
        gc, seed_path = runner == "ours+gc", runner == "seed"
        micro_step = ours(model, opts.tokenizer_dir, opts.rows, gc, seed_path, opts.device, opts.stage)
    model.train()
    ids = torch.randint(0, SHAPE["vocab_size"], (opts.rows, opts.prompt + length), device=opts.device)
    micro_step(ids[:, -24:], 16)  # gradients allocated, lazy initialisation done
    for p in model.parameters():
        if p.grad is not None:  # --stage: the output layer's alone
            p.grad.zero_()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = rss()
        reset_peak_rss()
    cpu, wall = time.process_time(), time.perf_counter()
    micro_step(ids, length)
    if cuda:
        torch.cuda.synchronize()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss()
    params = sum(p.numel() for p in model.parameters())
    seconds = wall if cuda else cpu  # a shared CPU: CPU seconds are steadier than wall seconds
    print(json.dumps(dict(peak=peak - base, base=base, cpu=cpu, wall=wall, seconds=seconds, params=params)))


def measure(runner, length, opts):
    command = [sys.executable, __file__, "--worker", runner, "--lengths", str(length), "--rows", str(opts.rows)]
    command += ["--prompt", str(opts.prompt), "--threads", str(opts.threads), "--tokenizer_dir", opts.tokenizer_dir]
    command += ["--device", opts.device, "--layers", str(opts.layers)] + ["--stage"] * opts.stage
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{runner} at {length}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit(points):
    """Least-squares line (a, b) through [(length, value), ...]."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,2048,8192,16384", help="response lengths of the table")
    parser.add_argument("--runners", default=",".join(RUNNERS), help=f"some of {','.join(RUNNERS)}")
    parser.add_argument("--fit", default="128,256", help="lengths always measured, for each runner's line")
    parser.add_argument("--max_gb", type=float, default=10.0, help="measure a length only under this peak (GiB)")
    parser.add_argument("--rows", type=int, default=2, help="responses in the micro-batch")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--device", default="cpu", help="cuda: peak is max_memory_allocated, bf16 autocast (as train.py)"
    )
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen2.5-1.5B: 28)")
    parser.add_argument("--budget_gb", type=float, default=24.0, help="memory the longest trainable length must fit")
    parser.add_argument("--stage", action="store_true", help="the loss stage alone (runners seed and ours)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer_dir", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    lengths, fit_lengths = [int(x) for x in opts.lengths.split(",")], [int(x) for x in opts.fit.split(",")]
    runners = opts.runners.split(",")
    if opts.worker:
        return worker(opts.worker, lengths[0], opts)
    if unknown := set(runners) - set(RUNNERS):
        parser.error(f"unknown runner(s) {', '.join(sorted(unknown))}; choose from {','.join(RUNNERS)}")
    if len(set(fit_lengths)) < 2:
        parser.error(f"--fit={opts.fit}: a line needs two lengths or more, e.g. --fit 512,2048")
    if opts.stage and set(runners) - {"seed", "ours"}:
        parser.error("--stage measures the runners seed and ours: --runners seed,ours")
    if "trl" in runners and importlib.util.find_spec("trl") is None:
        parser.error("the trl runner needs TRL: pip install trl==1.16.0 (or leave it out: --runners seed,ours,ours+gc)")
    from dapo_utils.tiny_world import build_tiny_world
    from train import SYSTEM_PROMPT

    root = tempfile.mkdtemp()
    opts.tokenizer_dir = build_tiny_world(root, SYSTEM_PROMPT, num_train=4, num_test=1, seed=0)[0]
    results = {}
    for runner in runners:
        points = {n: measure(runner, n, opts) for n in fit_lengths}
        a, b = fit([(n, r["peak"]) for n, r in points.items()])
        for n in lengths:
            if n not in points and a + b * n <= opts.max_gb * GIB:
                points[n] = measure(runner, n, opts)
        a, b = fit([(n, r["peak"]) for n, r in points.items()])  # every measured length
        tc, tb = fit([(n, r["seconds"]) for n, r in points.items()])
        static = 8 * points[fit_lengths[0]]["params"] + min(r["base"] for r in points.values())  # + Adam m, v
        longest = (opts.budget_gb * GIB - static - a) / b
        results[runner] = dict(points=points, line=(a, b), time_line=(tc, tb), longest=longest)
        line = f"peak = {a / GIB:.3f} GiB + {b / 2**20:.3f} MiB x length (measured at {sorted(points)})"
        print(f"{runner}: {line}; s = {tc:.2f} + {tb * 1000:.2f} ms x length; budget: ~{longest:,.0f}", flush=True)
    setting = f"{opts.rows} rows x ({opts.prompt} + length) tokens, {opts.threads} threads"
    what = "The loss stage alone" if opts.stage else "One micro-step"
    print(f"\n{what}, {setting}. Peak over weights+gradients (GiB) / seconds; ~ = computed, not measured")
    print(f"{'length':>8}" + "".join(f"{r:>22}" for r in runners))
    for n in lengths:
        cells = []
        for runner in runners:
            res = results[runner]
            if n in res["points"]:
                cells.append(f"{res['points'][n]['peak'] / GIB:.2f} / {res['points'][n]['seconds']:.1f} s")
            else:
                (a, b), (tc, tb) = res["line"], res["time_line"]
                cells.append(f"~{(a + b * n) / GIB:.2f} / ~{tc + tb * n:.0f} s")
        print(f"{n:>8}" + "".join(f"{c:>22}" for c in cells))
    if not opts.stage:  # the decoder's share decides what fits
        longest = [f"~{results[r]['longest']:,.0f} tokens" for r in runners]
        print(f"{f'{opts.budget_gb:g} GB':>8}" + "".join(f"{c:>22}" for c in longest))


if __name__ == "__main__":
    main()
