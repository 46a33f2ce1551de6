"""The seed's slow paths, as monkeypatches on a DapoTrainer instance (train.py keeps the fast paths only).

    from seed_paths import use_seed_paths
    use_seed_paths(trainer)                        # every seed path
    use_seed_paths(trainer, "full_log_softmax")    # one of them

Each path gives the same results as train.py's (tests/test_performance.py checks it) at the seed's cost:

- pad_to_max:          prompts left-padded to max_prompt_length, responses right-padded to
                       max_generate_length, instead of each group to its own longest
- per_prompt_generate: one generate call per prompt instead of one per batch
- full_log_softmax:    logits at every position and a float32 log-softmax over all of them
                       ([N, P+T-1, V]), instead of the log-probs from the hidden states (dapo_utils/kernels.py)
- hf_generate:         the seed's sampler, generate(do_sample=True): a prompt pass per row, its warpers and
                       torch.multinomial over all V ids, its per-token passes over the vocabulary, instead of
                       decoding.decode
- unpacked_output_layer: decode's output-layer product as W @ h^T, what a torch without MKL runs, instead of
                       MKL's packed weight (decoding.packed_weight_head); the seed's generate runs F.linear
- old_log_prob_pass:   a no-grad pi_old pass even when num_iterations == 1 (where pi_old = pi_theta)
- one_call_per_batch:  a sampling call per prompt batch (micro-batch) instead of one per rollout
- repeated_prefill:    decode runs the prompt pass once per response (G times per prompt) instead of
                       once per prompt (decoding.distinct_prompts)
- arrival_order:       with padding_free, micro-batches of batch_size groups in the order they were sampled,
                       instead of balanced by real tokens within each optimizer step (padded passes keep
                       that order anyway)
- freed_memory_to_kernel: glibc's default heap policy (freed blocks of a few MB go back to the kernel and
                       fault in again) instead of kernels.reuse_freed_memory; process-wide and not undoable,
                       so keep_glibc_heap_policy() must run before the trainer is built
"""

import dataclasses

import torch
import torch.nn.functional as F

SEED_PATHS = ("pad_to_max", "per_prompt_generate", "full_log_softmax", "hf_generate", "old_log_prob_pass")
SEED_PATHS += ("one_call_per_batch", "repeated_prefill", "arrival_order", "freed_memory_to_kernel")
SEED_PATHS += ("unpacked_output_layer",)


def pad_to_max(trainer):
    encode_prompts, generate_samples = trainer.encode_prompts, trainer.generate_samples
    pad, P, T = trainer.tokenizer.pad_token_id, trainer.args.max_prompt_length, trainer.args.max_generate_length

    def encode_to_max(prompts):  # generate sees prompts padded to the full budget, as in the seed
        ids, mask = encode_prompts(prompts)  # [B, longest]
        return F.pad(ids, (P - ids.size(1), 0), value=pad), F.pad(mask, (P - mask.size(1), 0))

    def samples_to_max(inputs):  # each group comes back as wide as itself; pad it to the full budget
        out = []
        for s in generate_samples(inputs):
            left, right = P - (s.prompt_response_ids.size(1) - s.num_actions), T - s.num_actions
            out.append(
                dataclasses.replace(
                    s,
                    prompt_response_ids=F.pad(s.prompt_response_ids, (left, right), value=pad),
                    response_ids=F.pad(s.response_ids, (0, right), value=pad),
                    attention_mask=F.pad(s.attention_mask, (left, right)),
                    action_mask=F.pad(s.action_mask, (0, right)),
                    num_actions=T,
                    sampler_log_probs=None if s.sampler_log_probs is None else F.pad(s.sampler_log_probs, (0, right)),
                )
            )
        return out

    trainer.encode_prompts, trainer.generate_samples = encode_to_max, samples_to_max


def per_prompt_generate(trainer):
    generate_samples = trainer.generate_samples

    def one_call_per_prompt(inputs):
        n = len(inputs["prompt"])
        return [s for i in range(n) for s in generate_samples({key: value[i : i + 1] for key, value in inputs.items()})]

    trainer.generate_samples = one_call_per_prompt


def full_log_softmax(trainer):
    def get_action_log_probs(model, input_ids, attention_mask, num_actions, with_entropy=False):
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        with trainer.autocast():
            logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
        if trainer.args.score_with_temperature:
            logits = logits / trainer.args.temperature
        all_log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)[:, -num_actions:]  # [N, T, V]
        log_probs = all_log_probs.gather(-1, input_ids[:, -num_actions:].unsqueeze(-1)).squeeze(-1)  # [N, T]
        if not with_entropy:
            return log_probs
        with torch.no_grad():
            entropy = -(all_log_probs.exp() * all_log_probs).sum(dim=-1)  # H = -sum p log p
        return log_probs, entropy

    trainer.get_action_log_probs = get_action_log_probs


def hf_generate(trainer):
    from dapo_utils import decoding

    trainer.decode = decoding.generate


def unpacked_output_layer(trainer):
    from unittest import mock

    sample = trainer.sample

    def without_mkl(input_ids, attention_mask):  # packed_weight_head's fallback for this call
        with mock.patch.object(torch.backends.mkl, "is_available", lambda: False):
            return sample(input_ids, attention_mask)

    trainer.sample = without_mkl


def old_log_prob_pass(trainer):
    make_micro_batches = trainer.make_micro_batches

    def with_old_log_probs(groups):
        micro_batches = make_micro_batches(groups)
        with torch.no_grad():
            for inputs in micro_batches:
                if inputs.old_action_log_probs is None:
                    inputs.old_action_log_probs = trainer.get_action_log_probs(
                        trainer.model, *trainer.model_inputs(inputs)
                    )
        return micro_batches

    trainer.make_micro_batches = with_old_log_probs


def one_call_per_batch(trainer):
    trainer.world.rounds_to_sample = lambda *args: 1


def repeated_prefill(trainer):
    from dapo_utils import decoding

    sample = trainer.sample

    def every_row_its_own(input_ids, attention_mask):  # no two rows share a prompt pass
        return input_ids, attention_mask, torch.arange(len(input_ids), device=input_ids.device)

    def one_prompt_pass_per_row(input_ids, attention_mask):  # train.sample's own call
        shared, decoding.distinct_prompts = decoding.distinct_prompts, every_row_its_own
        try:
            return sample(input_ids, attention_mask)
        finally:
            decoding.distinct_prompts = shared

    trainer.sample = one_prompt_pass_per_row


def arrival_order(trainer):
    import train

    make_micro_batches = trainer.make_micro_batches

    def unbalanced(groups):  # train.make_micro_batches' own code, with the seed's consecutive groups
        grouping = train.micro_batch_groups
        train.micro_batch_groups = lambda tokens, batch_size, steps, balance: grouping(tokens, batch_size, steps, False)
        try:
            return make_micro_batches(groups)
        finally:
            train.micro_batch_groups = grouping

    trainer.make_micro_batches = unbalanced


def leave_heap_policy():
    return False


def keep_glibc_heap_policy():
    """Before a trainer is built: it will leave glibc's heap policy as it is (train.py calls reuse_freed_memory)."""
    import train

    train.reuse_freed_memory = leave_heap_policy


def freed_memory_to_kernel(trainer):
    import train

    if train.reuse_freed_memory is not leave_heap_policy:  # mallopt's change cannot be undone exactly
        raise RuntimeError(
            "freed_memory_to_kernel: call seed_paths.keep_glibc_heap_policy() before building the trainer"
        )


def use_seed_paths(trainer, *paths):
    """Apply the named seed paths (default: all of them) to `trainer`, in place; returns it."""
    for name in paths or SEED_PATHS:
        if name not in SEED_PATHS:
            raise ValueError(f"unknown seed path {name!r}; choose from {SEED_PATHS}")
        globals()[name](trainer)
    return trainer
