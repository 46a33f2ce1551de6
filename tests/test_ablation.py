"""Issue 39: the paper's ladder (presets, --ablation), the GRPO family (scale_rewards, Dr. GRPO's normaliser, GSPO's
sequence-level ratio) against hand-worked numbers, --plot of several runs, perf/throughput and perf/mfu."""

import dataclasses
import json
import math
import os
import types

import pytest
import torch

from conftest import make_batch
from dapo_utils import ablation, curves
from dapo_utils.cli import parse_cli
from dapo_utils.flops import log_prob_flops, model_shape, pass_flops, sampling_flops
from dapo_utils.presets import PRESETS, paper_preset
from dapo_utils.tiny_world import DEMO_ARGS
from train import DapoArguments, MicroBatch, aggregate_loss, build_args, dapo_per_token_loss, group_advantages
from train import loss_normaliser, main, sequence_log_ratio

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

LADDER = ["grpo", "overlong_filter", "clip_higher", "soft_overlong", "token_loss", "paper"]


# ---------- 1. the rungs ----------
def changed(below, above):
    """{field: (below's value, above's)} of every DapoArguments field the two presets set differently."""
    a, b = (dataclasses.asdict(build_args(preset, {"max_generate_length": 20})) for preset in (below, above))
    return {key: (a[key], b[key]) for key in a if a[key] != b[key]}


def test_neighbouring_rungs_differ_by_their_technique_alone():
    assert PRESETS == ["seed", *LADDER, "dr_grpo", "gspo"]
    grpo = build_args("grpo", {"max_generate_length": 20})
    assert (grpo.clip_eps_low, grpo.clip_eps_high, grpo.loss_agg_mode) == (0.2, 0.2, "seq-mean-token-mean")
    assert (grpo.filter_metric, grpo.overlong_filter, grpo.overlong_buffer_len, grpo.beta) == ("none", False, 0, 0.0)
    assert (grpo.scale_rewards, grpo.importance_sampling_level) == ("group", "token")  # GRPO's Eq. (9), per token
    steps = [changed(below, above) for below, above in zip(LADDER, LADDER[1:])]
    assert steps == [
        {"overlong_filter": (False, True)},
        {"clip_eps_high": (0.2, 0.28)},
        {"overlong_filter": (True, False), "overlong_buffer_len": (0, 4)},  # Sec. 3.4: punish instead of mask
        {"loss_agg_mode": ("seq-mean-token-mean", "token-mean")},
        {"filter_metric": ("none", "correctness")},
    ]
    assert changed("grpo", "dr_grpo") == {
        "scale_rewards": ("group", "none"),
        "loss_agg_mode": ("seq-mean-token-mean", "seq-mean-token-sum-norm"),
    }
    assert changed("grpo", "gspo") == {
        "importance_sampling_level": ("token", "sequence"),
        "clip_eps_low": (0.2, 3e-4),
        "clip_eps_high": (0.2, 4e-4),
    }
    # The ladder's top is --preset paper, whose fields are what they were before the ladder (issue 5)
    before = dict(filter_metric="correctness", loss_agg_mode="token-mean", overlong_buffer_len=4)
    before |= dict(steps_per_generation=4, temperature=1.0, top_k=0, score_with_temperature=True)
    before |= dict(weight_decay=0.1, warmup_steps=10, max_grad_norm=1.0)
    assert build_args("paper", {"max_generate_length": 20}) == DapoArguments(max_generate_length=20, **before)
    assert paper_preset(20480)["overlong_buffer_len"] == 4096
    # The defaults stay the seed's
    seed = DapoArguments()
    assert (seed.scale_rewards, seed.importance_sampling_level, seed.loss_agg_mode) == ("group", "token", "seed")


def test_ablation_command_line_is_checked():
    cli, given = parse_cli(DapoArguments, ["--ablation", "--demo", "--seeds=1,2", "--variants", "--lr=1e-5"])
    assert (cli.ablation, cli.demo, cli.seeds, cli.variants, given) == (True, True, "1,2", True, {"lr": 1e-5})
    assert ablation.parse_seeds("42,1,2,1") == [42, 1, 2]
    for argv, problem in [
        (["--seeds=1"], "--seeds sets up the ablation ladder: add --ablation"),
        (["--ablation", "--preset=paper"], "it takes no --preset"),
        (["--ablation", "--seed=3"], "it takes no --seed"),
    ]:
        with pytest.raises(SystemExit):
            parse_cli(DapoArguments, argv)
    with pytest.raises(SystemExit, match="whole numbers"):
        ablation.parse_seeds("42,one")
    # every run gets the same overrides, as train.py arguments
    assert ablation.as_flags({"lr": 1e-5, "bf16": False, "reward_weights": [1.0, 0.5]}) == [
        "--lr=1e-05",
        "--bf16=false",
        "--reward_weights=1.0,0.5",
    ]
    # the demo's ladder: the demo's settings with a length budget that responses reach
    assert ablation.DEMO_LADDER == {"max_generate_length": 16} and DEMO_ARGS["max_generate_length"] == 20


# ---------- 2. scale_rewards (TRL's), Dr. GRPO's normaliser ----------
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]])


def test_scale_rewards_group_batch_none_by_hand():
    group = group_advantages(REWARDS, "group")
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / 0.57735 = +-0.866025; group 3: mean 0.75, std 1.5
    assert torch.allclose(group, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025], [0, 0, 0, 0],
                                               [1.5, -0.5, -0.5, -0.5]]), atol=1e-6)  # fmt: skip
    assert torch.equal(group, group_advantages(REWARDS))  # the default is the seed's
    # batch: the std of all 12 rewards, sum 13, sum of squares 27: sqrt((27 - 13^2 / 12) / 11) = 1.0836247
    batch = group_advantages(REWARDS, "batch")
    assert torch.allclose(batch[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / 1.0836247, atol=1e-6)
    assert torch.allclose(batch[2], torch.tensor([2.25, -0.75, -0.75, -0.75]) / 1.0836247, atol=1e-6)
    # none (Dr. GRPO): R - mean(R), no division
    none = group_advantages(REWARDS, "none")
    assert torch.allclose(none, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [2.25, -0.75, -0.75, -0.75]]))
    for mode in ("group", "batch", "none"):  # equal rewards: exactly 0, also where float32's mean is not exact
        assert group_advantages(torch.full((1, 8), 0.3), mode).count_nonzero() == 0


def test_scale_rewards_reaches_the_sampled_groups(make_trainer):
    def totals(prompts, responses, answers):  # 0, 1, 2, 3 in every group of 4
        return [float(i % 4) for i in range(len(responses))]

    trainer = make_trainer(reward_funcs=[totals], scale_rewards="none")
    kept, _ = trainer.generate_experiences(make_batch(trainer, n=2))
    assert [group.advantages.tolist() for group in kept] == [[-1.5, -0.5, 0.5, 1.5]] * 2  # R - 1.5


# Two responses of G=2, T=4 (masked positions hold 1000: any leak shows); budget L_max = 8
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 1000, 1000, 1000]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])


def test_dr_grpo_normaliser_is_responses_times_the_length_budget_with_gradients():
    per_token = PER_TOKEN.clone().requires_grad_()
    loss = aggregate_loss(per_token, MASK, "seq-mean-token-sum-norm", num_generations=2, max_length=8)
    assert loss.item() == pytest.approx((1 + 2 + 3 + 4 + 5) / (2 * 8))  # 15 / 16, whatever the lengths
    loss.backward()
    assert torch.equal(per_token.grad, MASK / 16)  # every token weighs alike, 1 / (responses x L_max)
    assert loss_normaliser(MASK, "seq-mean-token-sum-norm", 2, max_length=8) == 16
    assert loss_normaliser(MASK, "seq-mean-token-sum-norm", 2) == 8  # verl's default: the padded width T = 4
    # A step of two such micro-batches: each divides by the step's 32, their sum is the whole step's mean
    halves = [
        aggregate_loss(PER_TOKEN[i : i + 1], MASK[i : i + 1], "seq-mean-token-sum-norm", 1, 16, 8) for i in (0, 1)
    ]
    assert sum(halves).item() == pytest.approx(15 / 16)
    # Through compute_loss (on-policy: ratio 1, loss -A per token): -(A_0 * 4 + A_1 * 1) / (2 x 8), d/d logp = -A / 16
    log_probs = torch.zeros(2, 4, requires_grad=True)
    per_token, _ = dapo_per_token_loss(log_probs, log_probs.detach(), torch.tensor([1.0, -2.0]), 0.2, 0.28)
    loss = aggregate_loss(per_token, MASK, "seq-mean-token-sum-norm", 2, max_length=8)
    assert loss.item() == pytest.approx(-(1.0 * 4 - 2.0 * 1) / 16)
    loss.backward()
    assert torch.allclose(log_probs.grad, torch.tensor([[-1.0] * 4, [2.0, 0, 0, 0]]) / 16)


# ---------- 3. GSPO's sequence-level ratio ----------
# log pi - log pi_old per token; row 1's last token is masked (its 5.0 must not count)
LOG_RATIO = torch.tensor([[0.1, 0.2, 0.3], [-0.3, 0.1, 5.0]])
SEQ_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
S0, S1 = math.exp(0.2), math.exp(-0.1)  # exp of each response's mean log-ratio: 1.221403, 0.904837


def test_gspo_ratio_and_its_clip_per_response_by_hand():
    log_probs = LOG_RATIO.clone().requires_grad_()
    old = torch.zeros(2, 3)
    assert torch.allclose(sequence_log_ratio(log_probs, old, SEQ_MASK), torch.tensor([[0.2], [-0.1]]))
    # A = (-1, +1), GSPO's range (3e-4, 4e-4): response 0 has s > 1 + eps with A < 0 and response 1 s < 1 - eps with
    # A > 0, so neither clip binds: loss_i = -A_i s_i at each of its tokens
    per_token, ratio = dapo_per_token_loss(log_probs, old, torch.tensor([-1.0, 1.0]), 3e-4, 4e-4, SEQ_MASK)
    assert torch.allclose(ratio, torch.tensor([[S0] * 3, [S1] * 3]))  # one ratio per response
    loss = aggregate_loss(per_token, SEQ_MASK, "seq-mean-token-mean", num_generations=2)
    assert loss.item() == pytest.approx((S0 - S1) / 2, abs=1e-6)  # GSPO Eq. (5): the mean over responses
    loss.backward()
    # d/d logp_t of -A_i s_i / 2 = -A_i s_i / (2 |o_i|) at each of response i's tokens, 0 at the masked one
    expected = torch.tensor([[S0 / 6] * 3, [-S1 / 4, -S1 / 4, 0.0]])
    assert torch.allclose(log_probs.grad, expected, atol=1e-6)
    # A = (+1, -1): both clips bind, each response whole: loss -(1 + 4e-4) and +(1 - 3e-4), no gradient anywhere
    log_probs.grad = None
    per_token, _ = dapo_per_token_loss(log_probs, old, torch.tensor([1.0, -1.0]), 3e-4, 4e-4, SEQ_MASK)
    loss = aggregate_loss(per_token, SEQ_MASK, "seq-mean-token-mean", num_generations=2)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + (1 - 3e-4)) / 2, abs=1e-7)
    loss.backward()
    assert log_probs.grad.abs().max() == 0
    # Per token (GRPO) with the same range and A = +1, each token is clipped on its own ratio: exp(0.1), exp(0.2),
    # exp(0.3) are all above 1 + 4e-4, so all three are; with (0.2, 0.28) only exp(0.3) = 1.35 > 1.28 is
    _, token_ratio = dapo_per_token_loss(LOG_RATIO, old, torch.tensor([1.0, 1.0]), 0.2, 0.28)
    assert torch.allclose(token_ratio[0], LOG_RATIO[0].exp()) and (token_ratio[0] > 1.28).tolist() == [0, 0, 1]


def test_gspo_equals_grpo_on_policy_in_one_pass(make_trainer):
    """On-policy (one optimizer step per rollout: pi_old = pi_theta, detached), s_i = r_t = 1 and both gradients are
    -A_i times each token's d log pi, weighted alike within a response: GSPO's loss and gradient are GRPO's in every
    aggregation. Off-policy they differ."""
    trainer = make_trainer(num_generations=2, max_generate_length=8)
    group = trainer.generate_samples(make_batch(trainer, n=1))[0]
    action_mask = group.action_mask.clone()
    action_mask[1, 1:] = 0  # responses of different lengths
    inputs = MicroBatch(group.prompt_response_ids, group.attention_mask, action_mask, torch.tensor([1.0, -0.5]))

    def loss_and_gradient(mode, level, old=None):
        trainer.args.loss_agg_mode, trainer.args.importance_sampling_level = mode, level
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dataclasses.replace(inputs, old_action_log_probs=old))
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    for mode in ("seed", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        token, sequence = loss_and_gradient(mode, "token"), loss_and_gradient(mode, "sequence")
        assert sequence[0] == pytest.approx(token[0], abs=1e-7) and token[1].abs().max() > 0, mode
        assert torch.allclose(sequence[1], token[1], atol=1e-7, rtol=1e-5), mode
    # pi_old elsewhere (a later step on the same rollout): the per-response ratio is another weighting
    old = trainer.get_action_log_probs(trainer.model, *trainer.model_inputs(inputs)).detach()
    old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    token, sequence = (
        loss_and_gradient("seq-mean-token-mean", "token", old),
        loss_and_gradient("seq-mean-token-mean", "sequence", old),
    )
    assert (sequence[1] - token[1]).abs().max() > 1e-3 * token[1].abs().max()


# ---------- 4. model FLOPs ----------
def test_flops_from_the_shapes_by_hand(make_trainer):
    trainer = make_trainer()
    config, shape = trainer.model.config, model_shape(trainer.model)
    V, H, L = config.vocab_size, config.hidden_size, config.num_hidden_layers  # tied embeddings: counted once
    assert shape.head == V * H and shape.decoder == sum(p.numel() for p in trainer.model.parameters()) - V * H
    assert shape.attention == 4 * L * config.num_attention_heads * (H // config.num_attention_heads)
    # 2 rows: prompt of 2 real tokens (1 left pad), responses of 2 and 1 tokens (T = 2)
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    tokens, responses, pairs = 4 + 3, 2 + 1, (4 * 5 + 3 * 4) // 2  # causal: token k attends to k tokens
    forward = 2 * shape.decoder * tokens + 2 * shape.head * responses + shape.attention * pairs
    assert pass_flops(shape, mask, 2) == forward and pass_flops(shape, mask, 2, passes=3) == 3 * forward
    # pi_old's and pi_ref's passes over a rollout: one micro-batch with both, one with pi_old's alone, one with none
    both = MicroBatch(mask, mask, mask[:, 3:], None, old_action_log_probs=1, ref_action_log_probs=1)
    old = dataclasses.replace(both, ref_action_log_probs=None)
    none = dataclasses.replace(old, old_action_log_probs=None)
    assert log_prob_flops(shape, [both, old, none]) == 3 * forward
    # drawing that group: the prompt's pass once, then 3 drawn tokens attending to 2 + 1, 2 + 2 and 2 + 1 tokens
    drawn = 2 * shape.decoder * (2 + 3) + 2 * shape.head * 3 + shape.attention * (3 + 3 + 4 + 3)
    group = types.SimpleNamespace(attention_mask=mask, num_actions=2)  # a Samples' two fields that it reads
    assert sampling_flops(shape, [group, group]) == 2 * drawn


# ---------- 5. the ladder, --plot, perf/* on real runs ----------
def fake_run(code_for):
    """A stand-in for one run's subprocess: it writes a short run's logs into the run's folder and exits with
    code_for(preset, seed) (130: interrupted after a checkpoint)."""
    seen = []

    def run(command, log):
        preset, folder = command[2].split("=")[1], command[4].split("=")[1]
        seen.append((preset, command[3], "--resume=latest" in command))
        os.makedirs(folder, exist_ok=True)
        code = code_for(preset, command[3])
        if code:  # interrupted: a checkpoint and the logs so far
            os.makedirs(os.path.join(folder, "checkpoint_1"), exist_ok=True)
        with open(os.path.join(folder, "accuracy_losses.txt"), "w") as f:
            f.write(f"0,0.20\n2,{0.30 + 0.01 * LADDER.index(preset):.2f}\n")
        with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
            for step in (1, 2):
                record = {"step": step, "time/step": 0.5, "sampled_tokens": 10, "num_tokens": 6, "perf/mfu": 0.01}
                f.write(
                    json.dumps(record | {"skipped_groups": 0, "entropy": 0.5, "completions/mean_length": 13}) + "\n"
                )
        return code

    return run, seen


def test_an_interrupted_ladder_continues_without_redoing_finished_runs(tmp_path, monkeypatch, world):
    model_dir, data_dir = world
    argv = ["--ablation", "--seeds=42,1", f"--output_dir={tmp_path}", f"--model_path={model_dir}"]
    argv += [f"--data_path={data_dir}", "--device=cpu", "--jobs=1"]
    run, seen = fake_run(lambda preset, seed: 130 if (preset, seed) == ("clip_higher", "--seed=1") else 0)
    monkeypatch.setattr(ablation, "run_process", run)
    with pytest.raises(SystemExit, match="1 run\\(s\\) failed"):
        main(argv)
    assert len(seen) == 12 and not any(resumed for *_, resumed in seen)
    assert json.load(open(tmp_path / "ablation.json"))["runs"]["clip_higher"].keys() == {"42"}  # the finished seed
    run, seen = fake_run(lambda preset, seed: 0)
    monkeypatch.setattr(ablation, "run_process", run)
    results = main(argv)  # the same command: the one unfinished run, from its checkpoint
    assert seen == [("clip_higher", "--seed=1", True)]
    assert [sorted(results[p]) for p in LADDER] == [[1, 42]] * 6
    report = (tmp_path / "ablation.md").read_text()
    assert "| `clip_higher` | + clip-higher | Sec. 3.1 | 38 | +0.010 vs overlong_filter | 0.320 ± 0.000 |" in report
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="holds a ladder of other settings \\(lr; "):  # no run beside other settings'
        main(argv + ["--lr=1e-4"])


def test_the_ladder_runs_every_rung_and_plot_overlays_two_runs(tmp_path, monkeypatch):
    """Real runs on the demo's world, one seed, one optimizer step each (subprocesses of train.py, two at a time),
    then --plot of two of them; every record's perf/mfu in (0, 1] and perf/throughput = (sampled + trained tokens)
    / time/step."""
    short = ["--max_steps=1", "--eval_steps=1", "--eval_samples=8", "--eval_batch_size=8", "--save_steps=1000"]
    results = main(["--ablation", "--demo", "--seeds=3", f"--output_dir={tmp_path}", *short])
    assert list(results) == LADDER and all(list(by_seed) == [3] for by_seed in results.values())
    folders = [tmp_path / preset / "seed_3" for preset in LADDER]
    for folder in folders:
        (record,) = [json.loads(line) for line in open(folder / "metrics.jsonl")]
        assert 0 < record["perf/mfu"] <= 1 and record["perf/flops"] > 0
        tokens = record["sampled_tokens"] + record["num_tokens"]
        assert record["perf/throughput"] == pytest.approx(tokens / record["time/step"], rel=1e-12)
    saved = json.load(open(tmp_path / "ablation.json"))
    assert saved["seeds"] == [3] and saved["runs"]["paper"]["3"]["steps"] == 1
    assert (
        saved["settings"]["model_path"] == str(tmp_path / "world" / "tiny-qwen2")
        and "output_dir" not in saved["settings"]
    )
    assert saved["settings"]["max_generate_length"] == 16 and saved["settings"]["max_steps"] == 1  # DEMO_LADDER, given
    # --plot A B: both runs on every panel, labelled by their folders, with their own values
    drawn = {}
    monkeypatch.setattr(curves, "save_figure", lambda fig, path: drawn.update(fig=fig, path=path) or path)
    a, b = str(folders[0]), str(folders[-1])
    main(["--plot", a, b])
    accuracy_axes = drawn["fig"].axes[0]
    assert [line.get_label() for line in accuracy_axes.lines] == [a, b]
    for line, folder in zip(accuracy_axes.lines, (a, b)):
        strict = curves.read_accuracies(folder)[0]
        assert list(line.get_xdata()) == sorted(strict) and list(line.get_ydata()) == [
            strict[s] for s in sorted(strict)
        ]
    assert drawn["path"] == os.path.join(os.path.relpath(tmp_path), "overlay.png")
