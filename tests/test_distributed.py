"""Data-parallel training (distributed.py) with two CPU processes over gloo, launched by torch.distributed.run: the
one-process step (each loss mode; dynamic sampling at the demo's size), a rank that keeps no group, --fsdp, and a
checkpoint resumed under another number of processes. train.py itself under torchrun: tests/test_multinode.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from dapo_utils import distributed
from dapo_utils.curves import read_jsonl
from dapo_utils.tiny_world import build_tiny_world
from train import SYSTEM_PROMPT, DapoArguments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "dist_worker.py")
TIMEOUT = 1200  # s per launch: a hang fails the test, not CI (this test took 252 s for 4 launches, load 17)


def run(args, nproc=None, check=True):
    """python ARGS (one process), or torch.distributed.run with nproc processes."""
    launcher = [sys.executable] if nproc is None else [sys.executable, "-m", "torch.distributed.run"]
    if nproc is not None:
        launcher += [f"--nproc_per_node={nproc}", "--standalone"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(launcher + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done


def worker(scenario, world, out, nproc=None, **overrides):
    run([WORKER, scenario, *world, str(out), json.dumps(overrides)], nproc)
    ranks = range(nproc or 1)
    return [json.load(open(os.path.join(out, f"rank_{r}.json"))) for r in ranks], os.path.join(out, "result.pt")


@pytest.fixture(scope="module")
def one_process_step(world, tmp_path_factory):
    """The equivalence scenario's one-process run (batch_size 2): (report, result.pt path)."""
    single, single_result = worker("equivalence", world, tmp_path_factory.mktemp("one"), batch_size=2)
    return single[0], single_result


def test_two_processes_take_the_one_process_step(world, tmp_path, one_process_step):
    """batch_size b on each of 2 ranks == batch_size 2b on one process, the same groups, for every loss_agg_mode."""
    single, single_result = one_process_step
    double, double_result = worker("equivalence", world, tmp_path / "two", nproc=2, batch_size=1)
    assert double[0] == double[1] == single  # the step's token count, gathered from both ranks
    one, two = torch.load(single_result), torch.load(double_result)
    for mode in one:
        for name, value in one[mode].items():
            torch.testing.assert_close(two[mode][name], value, atol=1e-5, rtol=0, msg=f"{mode}: {name}")
    # lr 1 SGD: the step moved the weights, and differently per mode (a mode ignored would show)
    moved = {mode: (one[mode]["lm_head.weight"] - one["initial"]["lm_head.weight"]).abs().max() for mode in one}
    assert all(moved[mode] > 1e-3 for mode in ("seed", "token-mean", "seq-mean-token-mean")), moved
    weights = [one[mode]["lm_head.weight"] for mode in ("seed", "token-mean", "seq-mean-token-mean")]
    assert not (torch.equal(weights[0], weights[1]) or torch.equal(weights[1], weights[2]))


@pytest.fixture(scope="module")
def demo_size_world(tmp_path_factory):
    """The demo's 1,000 training problems and vocabulary, its model untrained (no warm-up: scripted responses)."""
    return build_tiny_world(str(tmp_path_factory.mktemp("demo_size")), SYSTEM_PROMPT, num_test=8, seed=0)


def test_n_processes_take_one_process_steps_with_dynamic_sampling_and_resume_under_another_count(
    demo_size_world, tmp_path
):
    """The demo's step (16 prompts x 8 responses: 1 process x 4 micro-batches of 4 groups, or 2 x 2) for 3 steps,
    with the seed's filter and the paper's (correctness), responses scripted per (prompt, step): a step's groups are
    the first valid ones in prompt order, whichever rank sampled them. Both runs take the same micro-batches (each
    group's rows, hashed) and end with the same weights; so do checkpoint_2 of either resumed under the other count
    (1 -> 2 and 2 -> 1: the buffer, position and RNG regrouped)."""
    one = worker("sampling_order", demo_size_world, tmp_path / "one", gradient_accumulation_steps=4)
    two = worker("sampling_order", demo_size_world, tmp_path / "two", 2, gradient_accumulation_steps=2,
                 resume_from=str(tmp_path / "one"))  # fmt: skip
    back = worker("sampling_order", demo_size_world, tmp_path / "back", gradient_accumulation_steps=4,
                  resume_from=str(tmp_path / "two"), fresh=False)  # fmt: skip
    (single,), (zero, one_rank), (resumed,) = one[0], two[0], back[0]
    weights = {"one": torch.load(one[1]), "two": torch.load(two[1]), "back": torch.load(back[1])}
    for metric in ("reward", "correctness"):
        steps = single[metric]["micro_batches"]
        assert [(step, len(groups)) for step, groups in steps] == [(0, 16), (1, 16), (2, 16)]
        # rank 0 trains the first 8 of each step's 16 groups, rank 1 the next 8: together one process's
        joined = [[s, first + second] for (s, first), (_, second) in zip(zero[metric]["micro_batches"],
                                                                          one_rank[metric]["micro_batches"])]  # fmt: skip
        assert joined == steps, metric
        assert zero[metric]["grad_norm"] == pytest.approx(single[metric]["grad_norm"], rel=1e-5)
        assert zero[metric]["num_gen_batches"] == single[metric]["num_gen_batches"]  # prompt batches, all ranks
        assert max(single[metric]["num_gen_batches"]) > 4 and single[metric]["skipped_groups"] > 0  # refilled
        # 1 -> 2 processes and 2 -> 1: step 3 takes the uninterrupted run's groups
        assert resumed[f"{metric}_resumed"]["micro_batches"] == steps[2:]
        joined = [first + second for (_, first), (_, second) in zip(zero[f"{metric}_resumed"]["micro_batches"],
                                                                     one_rank[f"{metric}_resumed"]["micro_batches"])]  # fmt: skip
        assert joined == [steps[2][1]]
        for run, name in (("two", metric), ("two", f"{metric}_resumed"), ("back", f"{metric}_resumed")):
            for key, value in weights["one"][metric].items():
                torch.testing.assert_close(weights[run][name][key], value, atol=1e-5, rtol=0, msg=f"{run} {name}")
    # the filters kept different groups, and the steps moved the weights
    assert single["reward"]["micro_batches"] != single["correctness"]["micro_batches"]
    moved = (weights["one"]["reward"]["lm_head.weight"] - weights["one"]["initial"]["lm_head.weight"]).abs().max()
    assert moved > 1e-4


def test_the_step_decision_and_regrouping_in_the_sampling_order():
    """rollout_order: the first groups by place over every rank's buffer; step_shares: each rank's consecutive part
    of each optimizer step, which joined_steps puts back; regrouped: a checkpoint of 2 ranks for 1 and for 3."""
    held = [[0, 3, 8], [1, 2, 9]]  # places (in the epoch's order) of the groups rank 0 and rank 1 hold
    assert distributed.rollout_order(held, 7) is None
    assert distributed.rollout_order(held, 4) == [(0, 0), (1, 0), (1, 1), (0, 1)]  # places 0, 1, 2, 3
    assert distributed.rollout_order([[4, 6, 9]], 2) == [(0, 0), (0, 1)]  # one process: buffer[:2]
    items = list(range(8))  # a rollout of 2 optimizer steps, 4 items each
    parts = [distributed.step_shares(items, 2, rank, 2) for rank in range(2)]
    assert parts == [[0, 1, 4, 5], [2, 3, 6, 7]] and distributed.step_shares(items, 2, 0, 1) == items
    assert distributed.joined_steps(parts, 2) == items
    loop = dict(update_steps=5, rollout=None, skipped_groups=2, truncated_prompts=1)
    saved = [
        {"loop": loop | {"buffer": [{"index": 7}], "rollout": [0, 1, 4, 5]}, "rng": "rng 0", "cuda_rng": None},
        {"loop": loop | {"buffer": [{"index": 6}], "rollout": [2, 3, 6, 7]}, "rng": "rng 1", "cuda_rng": None},
    ]
    assert distributed.regrouped(saved, 1, 2, steps=2) is saved[1]  # as many processes: its own
    alone = distributed.regrouped(saved, 0, 1, steps=2)
    assert alone["loop"]["buffer"] == [{"index": 6}, {"index": 7}] and alone["loop"]["rollout"] == items
    assert (alone["loop"]["skipped_groups"], alone["loop"]["truncated_prompts"], alone["rng"]) == (4, 2, "rng 0")
    three = [distributed.regrouped(saved, rank, 3, steps=2) for rank in range(3)]
    assert [r["loop"]["rollout"] for r in three] == [[0, 1, 4, 5], [2, 6], [3, 7]]
    assert [r["loop"]["buffer"] for r in three] == [[{"index": 7}], [{"index": 6}], []]
    assert [r["rng"] for r in three] == ["rng 0", "rng 1", None]  # rank 2 keeps its own seed's stream
    assert [r["loop"]["skipped_groups"] for r in three] == [4, 0, 0]
    # the prompt batches of a call, over all ranks (one process's), and each rank's part
    world = distributed.World(0, 2)
    assert [world.rounds_to_sample(held, 2, 1) for held in (0, 1, 3, 4)] == [4, 3, 1, 1]
    assert [distributed.step_slice(list("abc"), rank, 2) for rank in range(2)] == [["a", "b"], ["c"]]


def test_a_rank_without_groups_still_steps_with_the_others(world, tmp_path):
    reports, _ = worker("starved_rank", world, tmp_path, nproc=2)
    zero, one = reports
    assert zero["steps"] == one["steps"] == 3 and zero["history"] == one["history"] == [1, 2, 3]
    # A step takes 4 groups (2 micro-batches x 1 group x 2 ranks); rank 1 skips all it samples, rank 0 keeps all.
    # The calls take what one process would: 4 prompt batches (2 each: 2 groups), then 2 (1 each: 3), then 1
    # (rank 0's: 4). Rank 0's 4 groups are shared out, 2 to each rank.
    assert zero["num_gen_batches"] == one["num_gen_batches"] == [7, 7, 7]
    assert zero["skipped_groups"] == one["skipped_groups"] == 9  # rank 1's 2 + 1 a step, counted over both ranks
    # resumed from checkpoint_3 for one more step: 9 + 3, on both ranks (not each rank's count summed again)
    assert zero["skipped_after_resume"] == one["skipped_after_resume"] == 12
    assert (
        zero["rounds"] == one["rounds"] == 3
        and "3 sampling rounds" in zero["error"]
        and "3 sampling rounds" in one["error"]
    )
    # SIGTERM reached rank 1 alone in step 2: both ranks stopped after step 2, with its checkpoint
    assert zero["sigterm_stopped_at"] == one["sigterm_stopped_at"] == 2
    assert zero["sigterm_saved"] == one["sigterm_saved"] == ["checkpoint_2"]


def train_py(world, out, *extra, nproc=2, check=True):
    model_dir, data_dir = world
    settings = dict(model_path=model_dir, data_path=data_dir, output_dir=out, device="cpu", max_generate_length=12)
    settings |= dict(eval_samples=4, eval_batch_size=4, num_generations=4, lr=1e-3, filter_metric="none")
    settings |= dict(eval_steps=10, save_steps=10)
    return run(["train.py", *(f"--{k}={v}" for k, v in settings.items()), *extra], nproc, check)


# ---- --fsdp: torch's fully_shard (FSDP2) over the same two gloo processes ----
def test_fsdp_takes_the_one_process_step(world, tmp_path, one_process_step):
    """Sharded parameters, gradients reduce-scattered as a sum: the one-process step (token-mean), and the same
    gradient norm from clip_grad_norm_ over the shards."""
    single, single_result = one_process_step
    modes = ["token-mean"]
    sharded, sharded_result = worker("equivalence", world, tmp_path, nproc=2, batch_size=1, fsdp=True, modes=modes)
    assert sharded[0]["token-mean"] == sharded[1]["token-mean"] == single["token-mean"]
    one, two = torch.load(single_result), torch.load(sharded_result)
    assert two["token-mean"].keys() == one["token-mean"].keys()  # gathered whole, every tensor
    for name, value in one["token-mean"].items():
        torch.testing.assert_close(two["token-mean"][name], value, atol=1e-5, rtol=0, msg=name)
    assert (two["token-mean"]["lm_head.weight"] - two["initial"]["lm_head.weight"]).abs().max() > 1e-3


def test_fsdp_rank_without_groups_and_uneven_generate_do_not_hang(world, tmp_path):
    """Rank 1 keeps no group and samples no prompt in some rounds (the policy is still gathered with the others'):
    it trains rank 0's groups, sent over (forward, backward, and the reference model's and pi_old's forwards: beta >
    0, steps_per_generation 2); and generate with rank-dependent lengths inside World.unsharded. A hang would be a
    timeout."""
    settings = dict(fsdp=True, beta=0.04, steps_per_generation=2)
    zero, one = worker("starved_rank", world, tmp_path, nproc=2, **settings)[0]
    assert zero["steps"] == one["steps"] == 3 and zero["history"] == one["history"] == [1, 2, 3]
    assert (zero["generated"], one["generated"]) == (3 + 3, 3 + 8)
    assert zero["num_gen_batches"] == one["num_gen_batches"] == [15, None, 15]  # a rollout's 8 groups: 8 + 4 + 2 + 1
    with open(os.path.join(tmp_path, "training_losses.txt")) as f:
        lines = f.read().splitlines()
    assert len(lines) == 3 * 2 * 2  # 2 micro-batches a step on each rank: rank 1 trains as many as rank 0


def test_train_py_with_fsdp_saves_resumes_and_writes_a_loadable_model(world, tmp_path):
    """torchrun train.py --fsdp=true (beta > 0: the reference model is sharded too), with an evaluation whose 3
    problems split 2 / 1 over the ranks in batches of 1 (uneven generate calls), a checkpoint at step 2, a
    resume to step 4; the final model loads in one process."""
    out = str(tmp_path / "run")
    extra = ["--fsdp=true", "--beta=0.04", "--eval_samples=3", "--eval_batch_size=1", "--eval_steps=2"]
    done = train_py(world, out, *extra, "--max_steps=2", "--save_steps=2")
    # Both ranks end in distributed.end_of_run (os._exit, no interpreter shutdown): exit 0, rank 0's summary last.
    last_line = done.stdout.splitlines()[-1]
    assert last_line.startswith("held-out accuracy (strict / lenient)  step 0 ") and "->  step 2 " in last_line
    at_2 = AutoModelForCausalLM.from_pretrained(os.path.join(out, "checkpoint_2")).state_dict()
    final_2 = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(at_2[k], final_2[k]) for k in at_2)
    state = torch.load(os.path.join(out, "checkpoint_2", "trainer_state.pt"), weights_only=True)
    assert sorted(state["optimizer"]["state"]) == list(range(len(state["optimizer"]["state"])))  # plain format
    assert state["optimizer"]["state"][0]["exp_avg"].shape == at_2["model.embed_tokens.weight"].shape  # whole

    train_py(world, out, *extra, "--resume=latest", "--max_steps=4", "--save_steps=2")
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    with open(os.path.join(out, "accuracy_losses.txt")) as f:
        assert [line.split(",")[0] for line in f.read().splitlines()] == ["0", "2", "4"]
    final = AutoModelForCausalLM.from_pretrained(out).state_dict()  # one process, no FSDP
    assert any(not torch.equal(final[k], at_2[k]) for k in final)  # steps 3 and 4 trained


def test_fsdp_resume_is_exact_and_only_rank_0_reads_the_full_states(world, tmp_path):
    """--fsdp, 2 processes: checkpoint_2 resumed for 2 more steps ends with the weights of 4 steps straight, to the
    bit. Rank 0 alone reads the checkpoint's trainer state and weights; rank 1 gets its shards from it."""
    reports, result = worker("fsdp_resume", world, tmp_path, nproc=2)
    assert reports[0]["read"] == ["resumed/checkpoint_2/trainer_state.pt", "resumed/checkpoint_2"]
    assert reports[1]["read"] == []
    weights = torch.load(result)
    straight, at_2, resumed = weights["straight"], weights["resumed_2"], weights["resumed_4"]
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)
    assert all(not torch.equal(resumed[name], at_2[name]) for name in straight if "norm" not in name)  # trained


def test_end_of_run_leaves_a_group_of_one_to_the_usual_shutdown(tmp_path):
    """vLLM starts a process group of 1 in the trainer's process (and transformers imports torch's FSDP): after
    main(), end_of_run returns and the interpreter shuts down as usual, atexit handlers included."""
    script = (
        "import atexit, torch.distributed as dist, torch.distributed.fsdp\nfrom dapo_utils import distributed\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "atexit.register(print, 'shutdown ran')\n"
        "distributed.end_of_run()\n"
        "print('returned')\n"
    )
    assert run(["-c", script]).stdout == "returned\nshutdown ran\n"


def test_fsdp_refuses_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node=N train.py --fsdp=true"):
        DapoArguments(fsdp=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    DapoArguments(fsdp=True)  # under torchrun: fine
    DapoArguments(fsdp=True, use_vllm=True, device="cpu")  # an engine per rank (tests/test_vllm_trainer.py runs it)
