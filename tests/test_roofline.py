"""Issue 47: the roofline. The bytes a pass reads and sampling's bound against hand-worked numbers, the bandwidth
probe, perf/sampling_bound and perf/sampling_roofline in metrics.jsonl, and bench.py's phase table."""

import json
import math
import os
import sys
import types

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_utils.flops import Roof, bandwidth_probe, device_roof, model_shape, pass_bytes, perf_metrics
from dapo_utils.flops import read_bandwidth, sampling_bound, sampling_flops, sampling_metrics

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench  # noqa: E402


def tiny_model():
    """1 layer, hidden 4, 2 heads of width 2, 1 key/value head, MLP 6, 10 ids, tied output layer. Parameters:
    embeddings 10 x 4 = 40 (the output layer too); q 4 x 4 + 4, k and v 4 x 2 + 2 each, o 4 x 4: 56; gate, up and
    down 3 x 24: 72; two norms 8; the final norm 4: decoder 140, 180 in all."""
    config = Qwen2Config(
        vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=16,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


# Two groups of G = 2: A's prompt has 2 real tokens (1 left pad) and responses of 2 and 1 tokens; B's prompt 3
# tokens and responses of 1 token each.
GROUP_A = types.SimpleNamespace(attention_mask=torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]]), num_actions=2)
GROUP_B = types.SimpleNamespace(attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]]), num_actions=1)
ROOF = Roof(peak=1000.0, bandwidth=800.0, itemsize=4)  # FLOP/s, bytes/s: both regimes show up below


def test_bytes_a_pass_reads_by_hand():
    model = tiny_model()
    shape = model_shape(model)
    assert sum(p.numel() for p in model.parameters()) == 180  # the docstring's count
    assert (shape.decoder, shape.head, shape.attention) == (140, 40, 4 * 1 * 2 * 2)
    assert shape.cached == 2 * 1 * 1 * 2  # keys and values, 1 layer, 1 key/value head of width 2
    assert pass_bytes(shape, 4) == 4 * 180  # the tied output layer once
    assert pass_bytes(shape, 2, cached_tokens=3) == 2 * (180 + 4 * 3)
    assert device_roof("cpu").itemsize == 4  # float32 weights, no autocast on a CPU


def test_sampling_bound_by_hand():
    shape = model_shape(tiny_model())  # decoder 140, head 40, attention 16, cached 4
    # One call (vLLM's, or rows >= 4). Prefill: one pass over both prompts, the decoder's 560 bytes read once,
    # 2 x 140 x 2 + 16 x 3 + 2 x 140 x 3 + 16 x 6 = 1544 FLOPs: max(0.7, 1.544) s.
    # Decode step 1, all 4 rows, attending to 3, 3, 4, 4 tokens: 4 x 2 x 180 + 16 x 14 = 1664 FLOPs, bytes
    # 4 x (180 + 4 x (2 + 2 + 3 + 3)) = 880: max(1.1, 1.664). Step 2, A's first row alone, attending to 4 tokens:
    # 360 + 64 = 424 FLOPs, 4 x (180 + 4 x 3) = 768 bytes: max(0.96, 0.424).
    prefill, decode = sampling_bound(shape, [GROUP_A, GROUP_B], None, ROOF)
    assert (prefill, decode) == pytest.approx((1.544, 1.664 + 0.96), rel=1e-12)
    assert sampling_bound(shape, [GROUP_A, GROUP_B], 4, ROOF) == pytest.approx((prefill, decode), rel=1e-12)
    # With infinite bandwidth the bound is the FLOPs / peak: sampling_flops', part for part.
    fast = Roof(peak=1000.0, bandwidth=math.inf, itemsize=4)
    assert sum(sampling_bound(shape, [GROUP_A, GROUP_B], None, fast)) == pytest.approx(
        sampling_flops(shape, [GROUP_A, GROUP_B]) / 1000.0, rel=1e-12
    )
    # A call per group (at most 2 or 3 rows a call: whole groups). A: prefill max(0.7, 0.608); step 1 816 FLOPs,
    # 4 x (180 + 4 x 4) = 784 bytes: 0.98; step 2 as above: 0.96. B: prefill max(0.7, 0.936); its one step
    # 720 + 128 = 848 FLOPs, 4 x (180 + 4 x 6) = 816 bytes: 1.02. Each call reads the weights itself.
    split = (0.7 + 0.936, 0.98 + 0.96 + 1.02)
    for rows in (1, 2, 3):
        assert sampling_bound(shape, [GROUP_A, GROUP_B], rows, ROOF) == pytest.approx(split, rel=1e-12)
    assert sampling_bound(shape, [], None, ROOF) == (0.0, 0.0)
    metrics = sampling_metrics(shape, [GROUP_A, GROUP_B], None, ROOF)
    assert metrics == {"perf/flops": [3632.0], "perf/sampling_bound": [pytest.approx(1.544 + 1.664 + 0.96)]}


def test_perf_metrics_give_sampling_time_over_its_bound():
    record = {"time/step": 4.0, "time/sampling": 3.0, "perf/sampling_bound": 0.5, "sampled_tokens": 8}
    assert perf_metrics(record, peak=1e9)["perf/sampling_roofline"] == 6.0
    assert perf_metrics({"time/step": 4.0, "time/sampling": None}, peak=1e9)["perf/sampling_roofline"] is None


def test_the_bandwidth_probe_is_measured_once_and_draws_nothing():
    state = torch.get_rng_state()
    rate = bandwidth_probe("cpu", torch.get_num_threads(), size=2**20)  # 4 MiB: quick
    assert torch.equal(torch.get_rng_state(), state) and 1e8 < rate < math.inf
    first = read_bandwidth("cpu")
    hits = bandwidth_probe.cache_info().hits
    assert read_bandwidth("cpu") == first and bandwidth_probe.cache_info().hits == hits + 1


def test_metrics_jsonl_records_the_sampling_bound_and_its_ratio(make_trainer):
    trainer = make_trainer(max_steps=2, eval_steps=1000)
    trainer.train()
    with open(os.path.join(trainer.args.output_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 2
    for r in records:
        assert 0 < r["perf/sampling_bound"] < r["time/sampling"]  # a bound: no sampler beats it
        assert math.isfinite(r["perf/sampling_roofline"]) and r["perf/sampling_roofline"] > 1
        assert r["perf/sampling_roofline"] == pytest.approx(r["time/sampling"] / r["perf/sampling_bound"])


def test_bench_prints_each_phase_against_its_bound(capsys):
    """Synthetic numbers: decode = sampling less the prompt pass timed alone; a phase without work (no pi_old or
    pi_ref pass) has no ratio; +use_vllm's sampling is one row; TRL's result has no phases."""
    default = {
        "time/sampling": 5.0, "bench/prefill": 0.05, "bench/bound_prefill": 0.01, "bench/bound_decode": 0.8,
        "time/old_ref_log_probs": 0.0, "bench/bound_log_probs": 0.0, "time/training": 1.4,
        "bench/bound_training": 0.7, "bandwidth": 24.5e9, "peak_flops": 346e9,
    }  # fmt: skip
    vllm = dict(default, **{"bench/prefill": math.nan})
    bench.print_roofline({bench.DEFAULT: default, bench.VLLM: vllm, bench.TRL: {"time/sampling": 3.0}})
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith((" ", bench.DEFAULT, bench.VLLM))]
    assert rows == [
        ["default", "(train.py)", "sampling", "prefill", "0.050", "0.010", "5.0", "24.5", "346"],
        ["sampling", "decode", "4.950", "0.800", "6.2"],
        ["old/ref", "log-probs", "0.000", "0.000", "-"],
        ["training", "1.400", "0.700", "2.0"],
        ["+use_vllm", "sampling", "5.000", "0.810", "6.2", "24.5", "346"],
        ["old/ref", "log-probs", "0.000", "0.000", "-"],
        ["training", "1.400", "0.700", "2.0"],
    ]
    assert not any(bench.TRL in line for line in lines)
