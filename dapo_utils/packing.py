"""The shapes of a rollout: how sampled groups become the tensors the training passes run on.

join_batches              a sampling call's prompt batches as one batch
pad_and_cat               right-pad tensors to one width and stack them
trim_group                the columns a group keeps: its own prompt and response widths
pad_and_cat_groups        a micro-batch's groups, left-padded prompts and right-padded responses
padded_sequences          the padded rows as the model reads them (padding_free off)
pack_sequences, unpack    the real tokens alone in one row (padding_free), and back to [N, T]
micro_batch_groups        which groups form each micro-batch: consecutive_micro_batches (the seed's order)
                          or balanced_micro_batches (padding_free: balanced by real tokens)
"""

import torch
import torch.nn.functional as F


def join_batches(batches):
    """DataLoader batches (dicts of lists or tensors) as one batch, in order."""
    joined = {}
    for key in batches[0]:
        values = [batch[key] for batch in batches]
        joined[key] = torch.cat(values) if torch.is_tensor(values[0]) else [x for v in values for x in v]
    return joined


def numbered(batches):
    """DataLoader batches as a list, each with "index" [b]: its prompts' places in the epoch's order (the same on
    every rank, whatever the batch size), which seed their vLLM responses (VllmSampler.rollout_seeds)."""
    indexed, first = [], 0
    for batch in batches:
        indexed.append(batch | {"index": torch.arange(first, first + len(batch["prompt"]))})
        first += len(batch["prompt"])
    return indexed


def pad_and_cat(tensors, value):
    """[N_i, T_i] tensors right-padded with value to the widest, concatenated: [sum N_i, max T_i]."""
    width = max(x.size(1) for x in tensors)
    return torch.cat([F.pad(x, (0, width - x.size(1)), value=value) for x in tensors])


def trim_group(attention_mask, num_actions):
    """The columns of one group's [G, P+T] tensors that are not padding in every row: from its longest prompt's
    first token to its longest response's last. A sampling call pads every group to the call's longest prompt and
    response; trimmed, each group is as wide as if it had been sampled alone (the seed's one call per prompt).
    Returns (columns of prompt_response_ids / attention_mask, the kept width of the T response columns)."""
    P = attention_mask.size(1) - num_actions
    width = max(int(attention_mask[:, P:].sum(-1).max()), 1)  # responses are a prefix of their T columns
    first = P - int(attention_mask[:, :P].sum(-1).max())  # prompts are left-padded
    return slice(first, P + width), width


def pad_and_cat_groups(groups, pad_token_id, step=0):
    """Join groups whose prompts (left-padded) or responses (right-padded) differ in length.

    groups: train.Samples (prompt_response_ids / attention_mask [G, P_i+T_i], action_mask and sampler_log_probs
    [G, T_i], advantages [G]). Returns the MicroBatch fields as [sum G, ...] tensors, padded to max P_i and T_i;
    with vLLM's log-probs, each row's sampler_lag: step (pi_old's) minus the step that sampled its group.
    """
    num_actions = [group.action_mask.size(1) for group in groups]
    prompt_lengths = [group.prompt_response_ids.size(1) - t for group, t in zip(groups, num_actions)]
    max_p, max_t = max(prompt_lengths), max(num_actions)
    sizes = list(zip(groups, prompt_lengths, num_actions))

    def padded(key, left, value=0):  # [sum G, ...]: left-padded to max P_i (left), right-padded to max T_i
        return torch.cat(
            [F.pad(getattr(g, key), (max_p - p if left else 0, max_t - t), value=value) for g, p, t in sizes]
        )

    batch = dict(prompt_response_ids=padded("prompt_response_ids", True, pad_token_id))
    batch |= dict(attention_mask=padded("attention_mask", True), action_mask=padded("action_mask", False))
    batch["advantages"] = torch.cat([group.advantages for group in groups])
    if groups[0].sampler_log_probs is not None:  # use_vllm
        batch["sampler_log_probs"] = padded("sampler_log_probs", False)
        batch["sampler_lag"] = torch.tensor([step - g.sampled_at for g in groups for _ in range(g.advantages.numel())])
    return batch


def padded_sequences(input_ids, attention_mask, num_actions):
    """The padded pass's (ids [N, W], the model's keyword arguments, labels [N, T], None): logits at the T
    positions before the last only; position ids follow the mask, as in generate."""
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    width = input_ids.size(1)
    keep = torch.arange(width - num_actions - 1, width - 1, device=input_ids.device)
    inputs = dict(attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=keep, use_cache=False)
    return input_ids, inputs, input_ids[:, -num_actions:], None


def pack_sequences(input_ids, attention_mask, num_actions):
    """A padded micro-batch as one row of its real tokens, for a padding-free pass (verl's use_remove_padding).

    input_ids, attention_mask: [N, W], the last num_actions columns the responses. Position ids restart at 0
    for every sequence and no attention mask is passed: transformers then reads the sequence boundaries from
    the position ids (flash-attention's varlen on CUDA, a block-diagonal causal mask with sdpa). With a 2-D
    mask it would let the sequences attend to each other. Returns (ids [1, S], the model's keyword arguments,
    labels [1, K]: the real response tokens, where [N, T] bool: where they sit in the padded layout).
    """
    real = attention_mask.bool()  # [N, W]
    where = real.clone()
    where[:, :-num_actions] = False  # [N, W]: real response tokens
    packed_index = real.flatten().cumsum(0).view_as(real) - 1  # [N, W]: each real token's place in the row
    position_ids = (attention_mask.cumsum(dim=-1) - 1)[real].unsqueeze(0)  # [1, S]
    keep = packed_index[where] - 1  # [K]: the logits that predict them come from the token before
    inputs = dict(position_ids=position_ids, logits_to_keep=keep, use_cache=False)
    return input_ids[real].unsqueeze(0), inputs, input_ids[where].unsqueeze(0), where[:, -num_actions:]


def unpack(values, where):
    """[1, K] values of a packed pass back to the padded layout [N, T] (0 where there is no token)."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values[0])


def consecutive_micro_batches(num_groups, batch_size):
    """The seed's micro-batches: batch_size consecutive group indices each (the last may hold fewer)."""
    return [list(range(first, min(first + batch_size, num_groups))) for first in range(0, num_groups, batch_size)]


def micro_batch_groups(tokens, batch_size, num_steps, balance):
    """The rollout's groups (tokens: each one's real token count) as micro-batches of group indices: balanced by
    tokens (balance, for packed passes) or the seed's consecutive groups. A padded pass costs its widest group,
    and balancing pairs long groups with short ones: 26% more computed tokens measured (docs/performance.md)."""
    if balance:
        return balanced_micro_batches(tokens, batch_size, num_steps)
    return consecutive_micro_batches(len(tokens), batch_size)


def balanced_micro_batches(tokens, batch_size, num_steps):
    """The rollout's groups (tokens: each one's real token count) as micro-batches of group indices, so that the
    micro-batches of each optimizer step hold about the same number of tokens (verl's sequence-length balancing).

    Which groups form each step is unchanged: the consecutive slices step_slice cuts from micro-batches of
    batch_size groups (the last may hold fewer), so each step's loss and normaliser are too. Within a step,
    the longest group goes first, each into the micro-batch with the fewest tokens that has room. Micro-batches
    keep rollout order inside and are ordered by their first group: with batch_size 1, nothing moves.
    """
    from dapo_utils.distributed import step_slice

    chunks = consecutive_micro_batches(len(tokens), batch_size)
    micro_batches = []
    for step in range(num_steps):
        parts = step_slice(chunks, step, num_steps)
        room, members = [len(part) for part in parts], [[] for _ in parts]
        totals = [0] * len(parts)
        for group in sorted((g for part in parts for g in part), key=lambda g: -tokens[g]):
            j = min((j for j in range(len(parts)) if len(members[j]) < room[j]), key=totals.__getitem__)
            members[j].append(group)
            totals[j] += tokens[group]
        micro_batches += sorted(sorted(m) for m in members)
    return micro_batches
