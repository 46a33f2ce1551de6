#!/usr/bin/env python
"""Memory of full fine-tuning against LoRA (lora_r > 0): measured on the demo's model, computed for Qwen2.5-1.5B/7B.

    python train.py --demo                      # once: builds the demo's world in ./output/demo
    python benchmarks/lora_memory.py [--model_path output/demo/tiny-qwen2 --data_path output/demo/gsm8k_tiny]

Measured (CPU, the demo's settings, no evaluation): per configuration a fresh process builds the DapoTrainer,
takes one warm-up optimizer step and two measured ones. Training state: the bytes of the parameters, of the
gradients (one per trainable parameter, float32) and of Adam's moments, read from the tensors. Peak: the
kernel's peak RSS (VmHWM, reset after the warm-up) above the RSS before the measured steps.

Computed (from the shapes, nothing allocated: the models are built on the meta device and peft adds its adapters
there): the training state of Qwen2.5-1.5B and 7B on CUDA, as train.py holds it. Full fine-tuning: float32
weights, gradients and Adam's two moments (16 bytes a parameter), plus with beta > 0 a bf16 reference copy (2).
LoRA: the frozen base in bf16 (2 bytes a parameter), the adapters in float32 with their gradients and moments
(16), no reference copy (pi_ref is the base). Activations come on top of both, about equal.
"""

import argparse
import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Qwen2.5's published configs (config.json of Qwen/Qwen2.5-1.5B-Instruct and Qwen/Qwen2.5-7B-Instruct).
QWEN = {
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
GB = 1e9


def measure(config, model_path, data_path, lora_r):
    """One configuration in this process: {parameters, trainable, state bytes, peak bytes over the start}."""
    from bench import peak_rss_bytes, reset_peak_rss, rss_bytes
    from dapo_utils.tiny_world import DEMO_ARGS
    from train import DapoArguments, build_trainer

    settings = {**DEMO_ARGS, "model_path": model_path, "data_path": data_path, "output_dir": f"/tmp/lora_mem_{config}"}
    settings |= dict(max_steps=3, eval_steps=10**9, save_steps=10**9, lora_r=lora_r, overwrite_output_dir=True)
    trainer = build_trainer(DapoArguments(**settings))  # train.py's own: tokenizer, both splits, the seed's rewards
    trainer.evaluate_and_log = lambda: None
    trainer.args.max_steps = 1  # the warm-up step
    trainer.train()
    start = rss_bytes()
    reset_peak_rss()
    trainer.args.max_steps = 3
    trainer.train()
    peak = peak_rss_bytes() - start
    params = list(trainer.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    moments = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    state = sum(p.numel() * p.element_size() for p in params) + sum(p.numel() * 4 for p in trainable)
    state += sum(t.numel() * t.element_size() for t in moments)
    return dict(parameters=sum(p.numel() for p in params), trainable=sum(p.numel() for p in trainable),
                state=state, peak=peak)  # fmt: skip


def computed(name, lora_r):
    """(parameters, adapter parameters) of a Qwen2.5 shape with LoRA on every linear layer of the decoder."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN[name]))
        base = sum(p.numel() for p in model.parameters())
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=16, target_modules="all-linear"))
    return base, sum(p.numel() for p in model.parameters() if p.requires_grad)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_path", default=os.path.join("output", "demo", "tiny-qwen2"))
    parser.add_argument("--data_path", default=os.path.join("output", "demo", "gsm8k_tiny"))
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        lora_r = opts.lora_r if opts.worker == "lora" else 0
        return print(json.dumps(measure(opts.worker, opts.model_path, opts.data_path, lora_r)))
    for path in (opts.model_path, opts.data_path):
        if not os.path.isdir(os.path.join(REPO, path)):
            sys.exit(
                f"error: {path!r} not found: run `python train.py --demo` (or `make demo`) first, or give its path"
            )
    print(
        f"demo model, measured (CPU; float32; the demo's settings; peak RSS over the start of 2 steps), r={opts.lora_r}:"
    )
    print(f"{'':6} {'parameters':>10} {'trainable':>10} {'state kB':>9} {'peak MB':>8}")
    for config in ("full", "lora"):
        command = [sys.executable, __file__, f"--worker={config}", f"--model_path={opts.model_path}"]
        command += [f"--data_path={opts.data_path}", f"--lora_r={opts.lora_r}"]
        done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"{config:6} {r['parameters']:>10,} {r['trainable']:>10,} {r['state'] / 1e3:>9.0f} {r['peak'] / 1e6:>8.1f}"
        )
    print("\ncomputed from the shapes (CUDA; GB = 1e9 bytes), LoRA on every linear layer of the decoder:")
    print(f"{'model':13} {'parameters':>11} {'r':>3} {'adapters':>10} {'full':>6} {'full+ref':>8} {'LoRA':>6}")
    for name in QWEN:
        for lora_r in (16, 32):
            n, a = computed(name, lora_r)
            full, ref, lora = 16 * n / GB, 18 * n / GB, (2 * n + 16 * a) / GB
            print(f"{name:13} {n:>11,} {lora_r:>3} {a:>10,} {full:>6.1f} {ref:>8.1f} {lora:>6.1f}")


if __name__ == "__main__":
    main()
