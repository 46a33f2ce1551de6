#!/usr/bin/env python
"""Peak host memory (RSS) of each rank while 2 CPU processes resume a --fsdp checkpoint.

    python benchmarks/fsdp_resume_memory.py [--hidden_size=768 --layers=6 --beta=0.04]

What it runs: a random Qwen2 of the given shape (float32, the tiny world's tokenizer and data) trains one step
under `torchrun --nproc_per_node=2 train.py --fsdp=true` and writes checkpoint_1 (weights, and Adam's two moments
in trainer_state.pt: three times the weights' bytes in all). Then 2 fresh gloo processes (this script under
torchrun) each build the trainer as train.py does (build_trainer: the model loaded, sharded) and resume the
checkpoint (resume_run). Per rank it prints the kernel's peak RSS (VmHWM) after building the trainer ("load",
train.py's initial model load), the RSS just before the resume, and the peak during the resume (VmHWM, reset
before it), all in MB. With --beta > 0 the reference model is built (a copy of the policy) and sharded too.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MB = 1e6
# The training run that writes the checkpoint: one short step, nothing else.
RUN = dict(device="cpu", num_threads=1, max_generate_length=4, num_generations=2, batch_size=1, lr=1e-3)
RUN |= dict(filter_metric="none", eval_steps=10**6, save_steps=1, max_steps=1, eval_samples=1)


def build_world(root, hidden_size, layers):
    """(model_dir, data_dir): the tiny world's data and tokenizer, its model replaced by a random Qwen2 of the
    given shape (float32). Returns the parameter count too."""
    import torch
    import transformers

    from dapo_utils.tiny_world import build_tiny_world
    from train import SYSTEM_PROMPT

    model_dir, data_dir = build_tiny_world(root, SYSTEM_PROMPT, num_train=16, num_test=4, seed=0)
    tiny = transformers.AutoConfig.from_pretrained(model_dir).to_dict()
    tiny.pop("layer_types")  # one per layer: made anew for the new number
    shape = dict(hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3, num_hidden_layers=layers)
    shape |= dict(num_attention_heads=hidden_size // 64, num_key_value_heads=2, head_dim=64)
    config = transformers.Qwen2Config(**tiny | shape)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(model_dir)
    return model_dir, data_dir, sum(p.numel() for p in model.parameters())


def torchrun(*argv):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *argv]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"error: {' '.join(argv[:2])} ended with {done.returncode}:\n{done.stderr[-4000:]}")


def settings(model_dir, data_dir, out, beta):
    return RUN | dict(model_path=model_dir, data_path=data_dir, output_dir=out, fsdp=True, beta=beta)


def worker(report, model_dir, data_dir, out, beta):
    """One rank: build the trainer, resume the checkpoint, write its numbers to report_RANK.json."""
    from bench import peak_rss_bytes, reset_peak_rss, rss_bytes
    from dapo_utils import distributed
    from dapo_utils.checkpoints import resume_run
    from train import DapoArguments, build_trainer

    args = DapoArguments(**settings(model_dir, data_dir, out, float(beta)))
    trainer = build_trainer(args)
    numbers = {"load": peak_rss_bytes() / MB, "before": rss_bytes() / MB}
    if not reset_peak_rss():
        sys.exit("error: /proc/self/clear_refs is not writable here: the peak cannot be reset")
    resume_run(trainer, os.path.join(args.output_dir, "checkpoint_1"))
    numbers["resume"] = peak_rss_bytes() / MB
    with open(f"{report}_{trainer.world.rank}.json", "w") as f:
        json.dump(numbers, f)
    trainer.world.from_rank_0(None)  # both have written
    distributed.end_of_run()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden_size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--beta", type=float, default=0.0, help="> 0: with a reference model")
    # this process is one rank: REPORT MODEL_DIR DATA_DIR OUTPUT_DIR BETA
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        return worker(*options.worker)
    with tempfile.TemporaryDirectory() as root:
        model_dir, data_dir, parameters = build_world(root, options.hidden_size, options.layers)
        out, report = os.path.join(root, "run"), os.path.join(root, "report")
        run = settings(model_dir, data_dir, out, options.beta)
        torchrun("train.py", *[f"--{key}={value}" for key, value in run.items()])
        torchrun(os.path.abspath(__file__), "--worker", report, model_dir, data_dir, out, str(options.beta))
        ranks = [json.load(open(f"{report}_{rank}.json")) for rank in (0, 1)]
        weights = os.path.getsize(os.path.join(out, "checkpoint_1", "model.safetensors")) / MB
        state = os.path.getsize(os.path.join(out, "checkpoint_1", "trainer_state.pt")) / MB
    print(f"model: {parameters:,} parameters; checkpoint: weights {weights:.0f} MB, trainer state {state:.0f} MB")
    print(f"{'rank':<6}{'load peak':>12}{'before resume':>16}{'resume peak':>14}{'resume added':>14}  (MB)")
    for rank, r in enumerate(ranks):
        print(f"{rank:<6}{r['load']:>12.0f}{r['before']:>16.0f}{r['resume']:>14.0f}{r['resume'] - r['before']:>14.0f}")


if __name__ == "__main__":
    main()
