"""LoRA (lora_r > 0, lora.py): the adapters alone train, pi_ref is the base model, vLLM samples from the merged
weights, checkpoints hold the adapters and resume exactly, the final adapter folder (and --merge_lora's model)
loads for --eval_only, data-parallel over 2 gloo processes, and bad settings stop in one line before loading."""

import importlib.util
import json
import os

import pytest
import torch
from peft.tuners.lora import LoraLayer
from test_distributed import worker
from test_vllm_trainer import SYNC_TOLERANCE, vllm_world
from transformers import AutoModelForCausalLM

from conftest import make_batch
from dapo_utils import checkpoints
from dapo_utils.lora import AdaptersOff, add_adapters
from train import DapoArguments, DapoTrainer, main

R = 4


def adapters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def base_weights(model):
    """The frozen base of a peft model under its checkpoint names."""
    base = model.get_base_model().named_parameters()
    return {name.replace(".base_layer.", "."): p.detach() for name, p in base if "lora_" not in name}


def run_args(world, out, *extra):
    model_dir, data_dir = world
    return [f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={out}", "--device=cpu",
            "--max_generate_length=8", "--eval_samples=4", "--eval_batch_size=4", "--lr=1e-2", *extra]  # fmt: skip


def test_adapters_alone_train_and_pi_ref_is_the_base_model(make_trainer, world):
    trainer = make_trainer(lora_r=R, lora_alpha=8, beta=0.1, lr=1e-2, max_steps=1, eval_steps=100, filter_metric="none")
    trainable = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    # Per layer (hidden 64, MLP 128): q, k, v, o are 64 -> 64, r (64 + 64) each; gate, up, down r (64 + 128) each.
    assert sum(p.numel() for p in trainable.values()) == 2 * (4 * R * 128 + 3 * R * 192) == 8704
    assert all("lora_A" in name or "lora_B" in name for name in trainable)
    assert [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == [id(p) for p in trainable.values()]
    assert isinstance(trainer.ref_model, AdaptersOff) and trainer.ref_model.policy is trainer.model  # no copy
    trainer.train()
    assert len(trainer.optimizer.state) == len(trainable)  # Adam's moments: of the adapters alone
    base = AutoModelForCausalLM.from_pretrained(world[0], dtype=torch.float32)
    frozen = base_weights(trainer.model)
    assert frozen.keys() == dict(base.named_parameters()).keys()
    assert all(torch.equal(frozen[name], p) for name, p in base.named_parameters())  # the base never moved
    assert all(p.abs().max() > 0 for name, p in adapters(trainer.model).items() if "lora_B" in name)  # B left 0

    groups, _ = trainer.generate_experiences(make_batch(trainer, n=4))
    micro_batch = trainer.make_micro_batches(groups)[0]
    inputs, mask = trainer.model_inputs(micro_batch), micro_batch.action_mask.bool()
    with torch.no_grad():
        expected = trainer.get_action_log_probs(base, *inputs)
        policy = trainer.get_action_log_probs(trainer.model, *inputs)
    assert torch.equal(micro_batch.ref_action_log_probs, expected)  # pi_ref: the base model, to the bit
    assert (policy - expected)[mask].abs().max() > 1e-2  # ... while the adapters moved the policy


def test_checkpoints_resume_exactly_and_the_adapter_folder_evaluates(world, tmp_path):
    out, settings = tmp_path / "out", ("--lora_r=4", "--lora_alpha=8", "--eval_steps=100", "--filter_metric=none")
    whole = main(run_args(world, tmp_path / "whole", *settings, "--max_steps=2"))
    main(run_args(world, out, *settings, "--max_steps=1", "--save_steps=1", "--merge_lora=true"))
    checkpoint = out / "checkpoint_1"  # the adapters (35 kB of float32) and the trainer state, no base weights
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= set(os.listdir(checkpoint))
    assert not (checkpoint / "model.safetensors").exists()
    assert os.path.getsize(checkpoint / "adapter_model.safetensors") < 40_000
    resumed = main([f"--resume={checkpoint}", "--max_steps=2"])
    assert resumed.update_steps == 2 and adapters(whole.model).keys() == adapters(resumed.model).keys()
    assert all(torch.equal(p, adapters(resumed.model)[name]) for name, p in adapters(whole.model).items())
    assert json.loads((out / "adapter_config.json").read_text())["r"] == R  # output_dir: the final adapter folder

    # --merge_lora: a plain model in output_dir/merged that loads alone and computes what the policy computes.
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    assert not hasattr(merged, "peft_config") and not any(isinstance(m, LoraLayer) for m in merged.modules())
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, resumed.model(ids).logits, rtol=0, atol=1e-5)
    # --eval_only accepts the adapter folder (its base with the adapters merged): the same answers as merged/.
    evaluation = [f"--data_path={world[1]}", f"--output_dir={tmp_path / 'eval'}", "--device=cpu", "--eval_samples=0"]
    results = main(["--eval_only", f"--model_path={out}", f"--compare={out / 'merged'}", *evaluation])
    assert results[str(out)] == results[str(out / "merged")] and results[str(out)]["num_problems"] == 8


def test_bad_lora_settings_stop_in_one_line_before_loading(world, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="lora_r must be >= 0"):
        DapoArguments(lora_r=-1)
    with pytest.raises(ValueError, match="merge_lora merges LoRA adapters: it needs lora_r > 0"):
        DapoArguments(merge_lora=True)
    with pytest.raises(ValueError, match="vllm_sync_adapters needs lora_r and use_vllm"):
        DapoArguments(lora_r=8, vllm_sync_adapters=True)
    find_spec = importlib.util.find_spec
    with monkeypatch.context() as patch:
        patch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
        with pytest.raises(ValueError, match=r"lora_r > 0 needs peft: pip install -r requirements/lora.txt"):
            DapoArguments(lora_r=8)
    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match="fsdp with lora_r > 0 is not supported"):
            DapoArguments(lora_r=8, fsdp=True)

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(checkpoints, "load_causal_lm", no_loading)
    with pytest.raises(SystemExit, match=r"lora_target_modules \['qkv_proj'\] match no module of .*: name its layers"):
        main(run_args(world, tmp_path / "out", "--lora_r=8", "--lora_target_modules=q_proj,qkv_proj"))


def test_vllm_samples_from_the_merged_weights(tmp_path):
    """2 steps with use_vllm and LoRA: vLLM's log-probs stay as close to pi_old's as without LoRA, while the adapters
    move the policy far from the base (a vLLM left on the base would show); the training model stays unmerged."""
    model_dir, data_dir = vllm_world(str(tmp_path / "world"))
    micro_batches, train_step = [], DapoTrainer.train_step

    def recording_train_step(self, model, inputs, normaliser=None):
        micro_batches.append(inputs)
        return train_step(self, model, inputs, normaliser)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DapoTrainer, "train_step", recording_train_step)
        trainer = main([
            f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={tmp_path / 'out'}", "--device=cpu",
            "--use_vllm=true", "--lora_r=8", "--lr=3e-2", "--max_steps=2", "--filter_metric=none", "--batch_size=1",
            "--num_generations=4", "--max_generate_length=12", "--eval_samples=4", "--eval_batch_size=4",
            "--eval_steps=100",
        ])  # fmt: skip
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(records) == 2 and all(r["vllm/logprob_diff_max"] < SYNC_TOLERANCE for r in records), records
    assert not any(m.merged for m in trainer.model.modules() if isinstance(m, LoraLayer))
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert all(torch.equal(base_weights(trainer.model)[name], p) for name, p in base.named_parameters())
    last = micro_batches[-1]
    with torch.no_grad():
        stale = trainer.get_action_log_probs(base, *trainer.model_inputs(last))
    assert (stale - last.sampler_log_probs)[last.action_mask.bool()].abs().max() > 10 * SYNC_TOLERANCE


def test_vllm_applies_the_adapters_alone_after_each_sync(tmp_path):
    """vllm_sync_adapters: vLLM keeps the base and reloads the adapters in place at each sync; its greedy log-probs
    follow the policy's (adapters and all) through two adapter changes."""
    from dapo_utils.vllm_sampler import VllmSampler

    model_dir, _ = vllm_world(str(tmp_path / "world"))
    args = DapoArguments(model_path=model_dir, device="cpu", lora_r=8, use_vllm=True, vllm_sync_adapters=True)
    model = add_adapters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args)
    sampler = VllmSampler.for_trainer(model, args)
    prompts = torch.randint(5, 100, (128, 24))  # [128, 24]: one call of 128 prompts
    answers = []
    for scale in (0.05, 0.1):  # a step, then another: B moves
        with torch.no_grad():
            for p in (p for name, p in model.named_parameters() if "lora_B" in name):
                p.add_(torch.randn_like(p) * scale)
        sampler.load_weights(model)
        ids, log_probs = sampler.sample(prompts, torch.ones_like(prompts), 0, 0.0, 1.0, 0, 8, [])  # greedy
        ids = ids[:, prompts.size(1) :]  # [128, 8] the responses (sample returns prompt and response)
        with torch.no_grad():
            logits = model(torch.cat([prompts, ids], dim=1)).logits[:, prompts.size(1) - 1 : -1]  # [128, 8, V]
        mine = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        assert (mine - log_probs).abs().max() < SYNC_TOLERANCE
        answers.append(ids)
    assert not torch.equal(*answers)  # the second adapters answered differently: vLLM reloaded them


def test_two_processes_train_the_adapters_as_one(world, tmp_path):
    """DDP with LoRA: batch_size 1 on each of 2 gloo ranks takes the one-process step of batch_size 2 (adapters only)."""
    lora = dict(lora_r=R, lora_alpha=8, modes=["token-mean"])
    single, single_result = worker("equivalence", world, tmp_path / "one", batch_size=2, **lora)
    double, double_result = worker("equivalence", world, tmp_path / "two", nproc=2, batch_size=1, **lora)
    assert double[0] == double[1] == single[0]  # the step's token count, gathered from both ranks
    one, two = torch.load(single_result)["token-mean"], torch.load(double_result)["token-mean"]
    initial = torch.load(single_result)["initial"]
    moved = [name for name in one if "lora_B" in name and (one[name] - initial[name]).abs().max() > 0]
    assert len(moved) == 2 * 7  # every adapter's B left 0 in one SGD step at lr 1
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, atol=1e-5, rtol=0, msg=name)
        if "lora_" not in name and name != "grad_norm":
            assert torch.equal(value, initial[name]), name  # the base is frozen
