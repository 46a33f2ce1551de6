"""The default sampler (dapo_utils/decoding.py): generate's distribution, generate's sequences where a draw is
determined, the learner's log-probs of what it drew, at the sizes a run samples."""

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import make_batch
from dapo_utils import decoding
from dapo_utils.decoding import Sampling, decode, draw_tokens, generate_with_graphs, packed_weight_head

GEN = torch.Generator().manual_seed(0)
LOGITS = torch.tensor([[2.0, 1.5, 1.2, 0.9, 0.9, 0.9, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0]])  # ids 3-5 tie at the 4th


def generates_distribution(logits, temperature, top_k, top_p):
    """What generate(do_sample=True) draws from: its own warpers, in its order, then softmax. [N, V]"""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone()) if temperature != 1.0 else logits.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(0.9, 50, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.8), (1.3, 5, 0.9), (1.0, 0, 1.0)]
)
def test_draw_tokens_draws_from_generates_distribution(temperature, top_k, top_p):
    expected = generates_distribution(LOGITS, temperature, top_k, top_p)[0]
    if top_k == 4:
        assert int((expected > 0).sum()) == 6  # HF keeps the ties at the k-th value: so must we
    n = 200_000
    torch.manual_seed(0)
    drawn = draw_tokens(LOGITS.expand(n, -1).clone(), temperature, top_k, top_p)  # [n]
    frequency = torch.bincount(drawn, minlength=12) / n
    assert (frequency[expected == 0] == 0).all()  # never an id the warpers removed
    assert torch.allclose(frequency, expected, atol=0.005), (frequency, expected)  # 5 standard errors at most


def test_draw_tokens_greedy_and_rows_with_few_finite_scores():
    assert draw_tokens(LOGITS.clone(), 0.0, 50, 1.0).tolist() == [0]  # temperature 0: argmax
    forced = torch.full((3, 12), -float("inf"))
    forced[:, 7] = 0.0  # one finite id (a forced EOS): -inf ties at the k-th value are no tie to keep
    assert draw_tokens(forced, 0.9, 4, 1.0).tolist() == [7, 7, 7]
    scores = LOGITS.expand(4, -1).clone()
    values, ids = decoding.warped_scores(scores, 1.0, 4, 1.0)
    assert ids.shape == (4, 6) and sorted(ids[0].tolist()) == [0, 1, 2, 3, 4, 5]  # the tie widens the shortlist


def decode_settings(trainer, **changes):
    a = trainer.args
    settings = Sampling(a.max_generate_length, trainer.eos_token_ids, trainer.tokenizer.pad_token_id, a.temperature,
                        a.top_k, a.top_p)  # fmt: skip
    return settings._replace(**changes)


def rows_of(trainer, prompts, copies):
    """Left-padded prompts, each repeated `copies` times in a row (a rollout's groups): [N, P] each."""
    ids, mask = trainer.encode_prompts(prompts)
    return ids.repeat_interleave(copies, dim=0), mask.repeat_interleave(copies, dim=0)


def plain_generate(model, ids, mask, settings):
    """generate as the seed calls it, greedy (top-k 1 is greedy: the draw is determined)."""
    return model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=settings.max_new_tokens,
        eos_token_id=list(settings.eos_token_ids), pad_token_id=settings.pad_token_id,
    )  # fmt: skip


def test_decode_and_graphs_path_give_generates_sequences_at_a_rollouts_size(make_trainer):
    """256 rows (64 prompts of several lengths x G 4) in one call: with top-k 1 the draws are determined, so decode,
    the CUDA path (generate over a static cache, run eagerly here) and the seed's generate agree token for token,
    left padding, EOS and the pads after it included."""
    trainer = make_trainer(num_generations=4, max_generate_length=24, top_k=1)
    data = trainer.train_dataset
    prompts = [data[i % len(data)]["prompt"] for i in range(64)]
    ids, mask = rows_of(trainer, prompts, 4)  # [256, P]
    assert len(set(mask.sum(1).tolist())) > 3  # prompts of several lengths
    settings = decode_settings(trainer)
    with torch.no_grad():  # weights 15x the tiny model's: greedy responses that vary and end (EOS) at many lengths
        for weight in (p for p in trainer.model.parameters() if p.dim() == 2):
            weight.normal_(0, 0.3, generator=GEN)
    ours = decode(trainer.model, ids, mask, settings)
    graphs = generate_with_graphs(trainer.model, ids, mask, settings)
    seed = plain_generate(trainer.model, ids, mask, settings)
    assert torch.equal(ours, seed) and torch.equal(graphs, seed)
    responses = ours[:, ids.size(1) :]
    ended = torch.isin(responses, torch.tensor(trainer.eos_token_ids))
    lengths = torch.where(ended.any(1), ended.long().argmax(1) + 1, responses.size(1))  # [N]
    assert len(set(lengths.tolist())) > 4, lengths  # rows end at many lengths
    after = ended.long().cumsum(1) - ended.long() > 0  # [N, T]: positions after a row's first EOS
    assert (responses[after] == settings.pad_token_id).all()


def test_decode_draws_generates_distribution_over_the_first_two_tokens(make_trainer):
    """4,000 rows of 2 prompts: the first token's frequencies match generate's warped softmax of the prompt's logits,
    and the second token's, given a first token, that of the logits after it (the KV cache's step)."""
    n = 2000
    trainer = make_trainer(num_generations=n, max_generate_length=2, temperature=0.9, top_k=20)
    ids, mask = rows_of(trainer, make_batch(trainer, 2, varied=True)["prompt"], n)  # [2n, P]
    settings = decode_settings(trainer)
    for sampler in (decode, generate_with_graphs):
        torch.manual_seed(0)
        drawn = sampler(trainer.model, ids, mask, settings)[:, ids.size(1) :]  # [2n, 2]
        with torch.no_grad():
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = trainer.model(ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]  # [2n, V]
        first = drawn[:, 0].view(2, n)
        expected = generates_distribution(logits[::n], 0.9, 20, 1.0)  # [2, V]
        frequency = torch.stack([torch.bincount(row, minlength=expected.size(1)) for row in first]) / n
        assert (frequency[expected == 0] == 0).all()
        assert ((frequency - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-3).all()
        # the second token after the most frequent first token of prompt 0
        token = first[0].mode().values
        rows = (drawn[:, 0] == token) & (torch.arange(2 * n) < n)
        longer = torch.cat([ids[:1], token.view(1, 1)], 1), torch.cat([mask[:1], torch.ones(1, 1, dtype=mask.dtype)], 1)
        with torch.no_grad():
            position_ids = (longer[1].cumsum(-1) - 1).clamp(min=0)
            after = trainer.model(longer[0], attention_mask=longer[1], position_ids=position_ids).logits[:, -1]
        expected = generates_distribution(after, 0.9, 20, 1.0)[0]
        m = int(rows.sum())
        frequency = torch.bincount(drawn[rows, 1], minlength=expected.numel()) / m
        assert m > 200 and (frequency[expected == 0] == 0).all()
        assert ((frequency - expected).abs() <= 5 * (expected * (1 - expected) / m).sqrt() + 1e-3).all(), sampler


def test_the_learners_log_probs_of_decodes_tokens_are_the_samplers(make_trainer):
    """Each step's logits in decode (KV cache, packed output layer) give the drawn tokens the log-probs the learner
    computes from the whole sequence (get_action_log_probs), to 1e-6 in float32, over 64 rows x 32 tokens."""
    trainer = make_trainer(num_generations=4, max_generate_length=32, temperature=1.0, top_k=0)
    ids, mask = rows_of(trainer, make_batch(trainer, 16, varied=True)["prompt"], 4)  # [64, P]
    steps = []

    def keep_logits(sequences, scores):  # the raw float32 logits each step draws from
        steps.append(scores.log_softmax(-1))
        return scores

    torch.manual_seed(0)
    sequences = decode(trainer.model, ids, mask, decode_settings(trainer), logits_processor=keep_logits)
    T = sequences.size(1) - ids.size(1)
    drawn = sequences[:, ids.size(1) :]  # [64, T]
    sampler = torch.stack(steps, 1).gather(-1, drawn.unsqueeze(-1)).squeeze(-1)  # [64, T]
    full_mask = torch.cat([mask, torch.ones_like(drawn)], 1)
    with torch.no_grad():
        learner = trainer.get_action_log_probs(trainer.model, sequences, full_mask, T)  # [64, T]
    before_eos = (
        torch.isin(drawn, torch.tensor(trainer.eos_token_ids)).long().cumsum(1)
        - torch.isin(drawn, torch.tensor(trainer.eos_token_ids)).long()
        == 0
    )  # the drawn tokens up to and with a row's EOS (pads after it were not drawn)
    assert T == 32 and before_eos.sum() > 1000
    assert (sampler - learner)[before_eos].abs().max() < 1e-6


def test_packed_output_layer_computes_the_layers_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False)
    hidden = torch.randn(8, 1, 64)  # [N, 1, H]
    expected = head(hidden)  # [N, 1, V]
    assert torch.allclose(packed_weight_head(head, 8)(hidden), expected, atol=1e-5, rtol=1e-5)
    mkl = torch.backends.mkl.is_available
    torch.backends.mkl.is_available = lambda: False  # torch without MKL: W @ h^T
    try:
        assert torch.allclose(packed_weight_head(head, 8)(hidden), expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.backends.mkl.is_available = mkl


def test_sampling_ignores_the_models_generation_config(make_trainer):
    """A model's own generation_config (greedy, a repetition penalty, an n-gram ban, another EOS) changes nothing:
    the same seed draws the same responses with and without it, under both samplers."""
    from transformers import GenerationConfig

    trainer = make_trainer(num_generations=8, max_generate_length=6)
    batch = make_batch(trainer)
    hostile = GenerationConfig(
        do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=2, top_k=1, eos_token_id=[0]
    )
    for sampler in (decode, generate_with_graphs):
        trainer.decode, drawn = sampler, []
        for config in (trainer.model.generation_config, hostile):
            trainer.model.generation_config = config
            torch.manual_seed(0)
            drawn.append(trainer.generate_samples(batch)[0].response_ids)
            assert trainer.model.generation_config is config  # the user's config is put back
        assert torch.equal(*drawn) and len({tuple(r) for r in drawn[0].tolist()}) > 1  # sampled, not greedy
