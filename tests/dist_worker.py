"""Run by tests/test_distributed.py and tests/test_vllm_trainer.py, under `python` (one process) or
`torch.distributed.run` (several):

    dist_worker.py SCENARIO MODEL_DIR DATA_DIR OUT_DIR [JSON overrides]

Generation is scripted (fixed responses per prompt, and in "sampling_order" per optimizer step), so that one process
and several see the same groups; the "main" scenario runs train.main({"argv": [...]}) as train.py does, with vLLM
sampling, recording each rank's rollouts.
Rank 0 writes OUT_DIR/result.pt; every rank writes OUT_DIR/rank_R.json.
"""

import contextlib
import json
import os
import signal
import sys
import zlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from conftest import recording_generate_samples  # noqa: E402
from dapo_utils import checkpoints, distributed  # noqa: E402
from dapo_utils.checkpoints import resume_run  # noqa: E402
from reward_func import correctness_reward, digit_reward, hard_format_reward, mark_reward  # noqa: E402
from train import DapoArguments, DapoTrainer, GSM8KDataset  # noqa: E402

scenario, model_dir, data_dir, out = sys.argv[1:5]
overrides = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
rank = int(os.environ.get("RANK", "0"))
FAST = dict(device="cpu", max_generate_length=12, eval_samples=2, eval_batch_size=2, num_generations=4)
FAST |= dict(eval_steps=1000, save_steps=1000, gradient_accumulation_steps=2, filter_metric="none")


def with_responses(tok, input_ids, texts):
    """input_ids [N, P] with each row's response text after it, ended by EOS and right-padded: what generate returns."""
    rows = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for text in texts]
    width = max(map(len, rows))
    rows = [r + [tok.pad_token_id] * (width - len(r)) for r in rows]
    return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)


def scripted_sampler(trainer, skip_on_rank=None):
    """Each row's response depends only on its prompt and its place in the group (rows repeat each prompt G
    times, evaluation rows once); on rank skip_on_rank all responses are the same (groups skipped)."""
    tok, G = trainer.tokenizer, trainer.args.num_generations

    def sample(input_ids, attention_mask):
        texts = []
        for i, (ids, mask) in enumerate(zip(input_ids, attention_mask)):
            h = zlib.crc32(tok.decode(ids[mask.bool()]).encode())
            j = 0 if rank == skip_on_rank else i % G
            answer = (h + 3 * j) % 7
            text = (
                f"<think>\n{str((h + j) % 10) * (1 + h % 9)}\n</think>\n<answer>\n{answer}\n</answer>"
                if j % 2 == 0
                else str(answer)
            )
            texts.append(text)
        return with_responses(tok, input_ids, texts), None

    trainer.sample = sample


def step_dependent_sampler(trainer):
    """Responses that depend on the prompt, the optimizer step and their place in the group alone, whichever rank
    samples them (so a prompt sampled at another step than one process samples it draws other responses). By a
    hash of (prompt, step) a group is: all G alike (1 in 5: every filter skips it), half right (3 in 5: every
    filter keeps it), or all wrong in formats that score differently (1 in 5: the seed's filter keeps it, the
    paper's correctness skips it)."""
    tok, G = trainer.tokenizer, trainer.args.num_generations
    answers = {row["prompt"]: row["answer"] for row in trainer.train_dataset}

    def sample(input_ids, attention_mask):
        texts = []
        for i, (ids, mask) in enumerate(zip(input_ids, attention_mask)):
            question = tok.decode(ids[mask.bool()]).split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
            h, j = zlib.crc32(f"{question}|{trainer.state.update_steps}".encode()), i % G
            kind, right = h % 5, answers.get(question, 0)  # 0: alike, 4: all wrong, else half right
            answer = right if 0 < kind < 4 and j % 2 == 0 else right + 1 + (j if kind else 0)
            think = str(h % 10) * (1 + (h + (j if kind else 0)) % 5)
            tagged = kind != 4 or j % 2 == 0
            text = f"<think>\n{think}\n</think>\n<answer>\n{answer}\n</answer>\n" if tagged else str(answer)
            texts.append(text)
        return with_responses(tok, input_ids, texts), None

    trainer.sample = sample


def group_hash(group):
    """A group's rows (its prompt and response tokens), hashed."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(group.prompt_response_ids, group.attention_mask)]
    return zlib.crc32(json.dumps(rows).encode())


def recording_micro_batches(trainer, record):
    """trainer.make_micro_batches, appending [step, each group's hash] of this rank's part of every rollout."""
    make = trainer.make_micro_batches

    def recording(groups):
        record.append([trainer.state.update_steps, [group_hash(group) for group in groups]])
        return make(groups)

    trainer.make_micro_batches = recording


@contextlib.contextmanager
def recording_reads(record, out):
    """In the block, the files this rank reads whole (torch.load of a path: broadcast_object_list unpickles from
    memory with it too; the weights through checkpoints.load_causal_lm) appended to record, relative to out."""
    torch_load, load_causal_lm = torch.load, checkpoints.load_causal_lm

    def recorded(read):
        def reading(path, *args, **kwargs):
            if isinstance(path, str):
                record.append(os.path.relpath(path, out))
            return read(path, *args, **kwargs)

        return reading

    torch.load, checkpoints.load_causal_lm = recorded(torch_load), recorded(load_causal_lm)
    try:
        yield
    finally:
        torch.load, checkpoints.load_causal_lm = torch_load, load_causal_lm


def make_trainer(output_dir, **settings):
    args = DapoArguments(model_path=model_dir, data_path=data_dir, output_dir=output_dir, **(FAST | settings))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return DapoTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=[correctness_reward, digit_reward, hard_format_reward, mark_reward],
        args=args,
        train_dataset=GSM8KDataset(data_dir, tokenizer, split="train"),
        eval_dataset=GSM8KDataset(data_dir, tokenizer, split="test"),
        tokenizer=tokenizer,
    )


def weights(trainer):
    """The full parameters (under --fsdp gathered from the shards, a collective: every rank calls it)."""
    full = trainer.world.full_model_state(trainer.model)
    return {k: v.clone() for k, v in (trainer.model.state_dict() if full is None else full).items()}


result, report = {}, {}
if scenario == "equivalence":  # one optimizer step per loss_agg_mode; plain SGD, so parameters show the gradient
    for mode in overrides.pop("modes", ("seed", "token-mean", "seq-mean-token-mean")):
        trainer = make_trainer(os.path.join(out, mode), max_steps=1, loss_agg_mode=mode, **overrides)
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
        scripted_sampler(trainer)
        result["initial"] = weights(trainer)
        trainer.train()
        result[mode] = weights(trainer)
        report[mode] = trainer.history[-1]["num_tokens"]
        result[mode]["grad_norm"] = torch.tensor(trainer.history[-1]["grad_norm"])  # clip_grad_norm_'s, over shards
elif scenario == "starved_rank":  # rank 1 keeps no group: rank 0 fills every step
    starved = dict(filter_metric="reward", batch_size=1, save_steps=3, **overrides)
    trainer = make_trainer(out, max_steps=3, **starved)
    if trainer.world.fsdp:  # real generate, ranks asking for different lengths: one all-gather per call
        with trainer.world.unsharded(trainer.model):
            ids = torch.ones(1, 3, dtype=torch.long)
            length = 3 + 5 * rank
            generated = trainer.model.generate(ids, max_new_tokens=length, min_new_tokens=length, do_sample=False)
        report["generated"] = generated.size(1)
    scripted_sampler(trainer, skip_on_rank=1)
    trainer.train()
    report |= {"steps": trainer.state.update_steps, "history": [r["step"] for r in trainer.history]}
    report["skipped_groups"] = trainer.world.sum(trainer.state.skipped_groups)  # every rank's
    report["num_gen_batches"] = [r.get("num_gen_batches") for r in trainer.history]
    if not trainer.world.fsdp:  # (--fsdp resumes in the fsdp_resume scenario)
        # Resumed from checkpoint_3 under 2 processes: the skip count goes on from the checkpoint's.
        resumed = make_trainer(out, max_steps=4, **starved)
        scripted_sampler(resumed, skip_on_rank=1)
        resume_run(resumed, os.path.join(out, "checkpoint_3"))
        resumed.train()
        report["skipped_after_resume"] = resumed.world.sum(resumed.state.skipped_groups)
    # Now every rank skips everything: the max_num_gen_batches error must come on all ranks, at the same round.
    trainer = make_trainer(out + "_starved", max_steps=3, filter_metric="reward", max_num_gen_batches=3)
    scripted_sampler(trainer, skip_on_rank=rank)
    try:
        trainer.train()
    except RuntimeError as error:
        report["error"], report["rounds"] = str(error), trainer.state.rounds
    # SIGTERM on rank 1 alone (its node is preempted), in step 2: every rank finishes step 2, saves, and stops.
    trainer = make_trainer(out + "_sigterm", max_steps=4, save_steps=100)
    scripted_sampler(trainer)
    optimizer_step = trainer.optimizer.step

    def step_with_sigterm(*args, **kwargs):
        if rank == 1 and trainer.state.update_steps == 1 and not trainer.stop_requested:
            os.kill(os.getpid(), signal.SIGTERM)
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = step_with_sigterm
    try:
        trainer.train()
    except KeyboardInterrupt:  # stop_if_requested: after the checkpoint
        report["sigterm_stopped_at"] = trainer.state.update_steps
        report["sigterm_saved"] = sorted(f for f in os.listdir(out + "_sigterm") if f.startswith("checkpoint_"))
elif scenario == "sampling_order":  # the demo's step (16 prompts x 8 responses), both filters, 3 steps
    resume_from, fresh = overrides.pop("resume_from", None), overrides.pop("fresh", True)  # a checkpoint_2's run
    demo_step = dict(num_generations=8, batch_size=4, max_generate_length=20, lr=3e-4, max_grad_norm=1.0)
    demo_step |= dict(max_steps=3, save_steps=2, epoch=10)
    for metric in ("reward", "correctness"):
        runs = ([(metric, None)] if fresh else []) + ([(f"{metric}_resumed", resume_from)] if resume_from else [])
        for name, source in runs:
            trainer = make_trainer(os.path.join(out, name), **demo_step, filter_metric=metric, **overrides)
            step_dependent_sampler(trainer)
            report[name] = {"micro_batches": []}
            recording_micro_batches(trainer, report[name]["micro_batches"])
            if source:  # the fresh run's checkpoint_2 in another launch, of another number of processes
                resume_run(trainer, os.path.join(source, metric, "checkpoint_2"))
            else:
                result["initial"] = weights(trainer)
            trainer.train()
            result[name] = weights(trainer)
            report[name] |= {key: [r[key] for r in trainer.history] for key in ("grad_norm", "num_gen_batches")}
            report[name]["skipped_groups"] = trainer.world.sum(trainer.state.skipped_groups)
elif scenario == "fsdp_resume":  # 4 steps straight; 2 steps, then checkpoint_2 resumed in a new trainer for 2 more
    straight = make_trainer(os.path.join(out, "straight"), fsdp=True, lr=1e-3, max_steps=4)
    scripted_sampler(straight)
    straight.train()
    result["straight"] = weights(straight)
    for steps in (2, 4):
        trainer = make_trainer(os.path.join(out, "resumed"), fsdp=True, lr=1e-3, max_steps=steps, save_steps=2)
        scripted_sampler(trainer)
        if steps == 4:
            with recording_reads(report.setdefault("read", []), out):
                resume_run(trainer, os.path.join(out, "resumed", "checkpoint_2"))
        trainer.train()
        result[f"resumed_{steps}"] = weights(trainer)
elif scenario == "main":  # train.py's main (training or --eval_only), with vLLM: what each rank sampled
    DapoTrainer.generate_samples = recording_generate_samples(report.setdefault("rollouts", []))
    train.main(overrides["argv"])
if rank == 0:
    torch.save(result, os.path.join(out, "result.pt"))
with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
    json.dump(report, f)
if torch.distributed.is_initialized():  # the ranks leave together: a rank whose peer already tore the process
    torch.distributed.barrier()  # group down could abort at exit ("terminate called without an active exception")
distributed.end_of_run()  # as train.py ends: before vLLM's own clean-up would tear the process group down again
