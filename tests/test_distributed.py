"""Data-parallel training (distributed.py) with two CPU processes over gloo, launched by torch.distributed.run."""

import json
import os
import subprocess
import sys

import torch

from curves import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "dist_worker.py")
TIMEOUT = 240  # seconds: a hang fails the test instead of the CI job


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


def test_two_processes_take_the_one_process_step(world, tmp_path):
    """batch_size b on each of 2 ranks == batch_size 2b on one process, the same groups, for every loss_agg_mode."""
    single, single_result = worker("equivalence", world, tmp_path / "one", batch_size=2)
    double, double_result = worker("equivalence", world, tmp_path / "two", nproc=2, batch_size=1)
    assert double[0] == double[1] == single[0]  # the step's token count, gathered from both ranks
    one, two = torch.load(single_result), torch.load(double_result)
    for mode in one:
        for name, value in one[mode].items():
            torch.testing.assert_close(two[mode][name], value, atol=1e-5, rtol=0, msg=f"{mode}: {name}")
    # lr 1 SGD: the step moved the weights, and differently per mode (a mode ignored would show)
    moved = {mode: (one[mode]["lm_head.weight"] - one["initial"]["lm_head.weight"]).abs().max() for mode in one}
    assert all(moved[mode] > 1e-3 for mode in ("seed", "token-mean", "seq-mean-token-mean")), moved
    weights = [one[mode]["lm_head.weight"] for mode in ("seed", "token-mean", "seq-mean-token-mean")]
    assert not (torch.equal(weights[0], weights[1]) or torch.equal(weights[1], weights[2]))


def test_a_rank_without_groups_still_steps_with_the_others(world, tmp_path):
    reports, _ = worker("starved_rank", world, tmp_path, nproc=2)
    zero, one = reports
    assert zero["steps"] == one["steps"] == 3 and zero["history"] == one["history"] == [1, 2, 3]
    # rank 0 alone fills each step (2 micro-batches x 1 group x 2 ranks = 4 groups: 4 rounds), rank 1 skips all
    assert zero["num_gen_batches"] == one["num_gen_batches"] == [4, 4, 4]
    assert zero["skipped_groups"] == one["skipped_groups"] == 12  # counted over both ranks
    assert (
        zero["rounds"] == one["rounds"] == 3
        and "3 sampling rounds" in zero["error"]
        and "3 sampling rounds" in one["error"]
    )


def train_py(world, out, *extra, nproc=2, check=True):
    model_dir, data_dir = world
    settings = dict(model_path=model_dir, data_path=data_dir, output_dir=out, device="cpu", max_generate_length=12)
    settings |= dict(eval_samples=4, eval_batch_size=4, num_generations=4, lr=1e-3, filter_metric="none")
    settings |= dict(eval_steps=10, save_steps=10)
    return run(["train.py", *(f"--{k}={v}" for k, v in settings.items()), *extra], nproc, check)


def test_train_py_under_torchrun_logs_once_and_resumes(world, tmp_path):
    out = str(tmp_path / "run")
    train_py(world, out, "--max_steps=20")
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 21))
    assert all(r["num_gen_batches"] == 2 for r in records)  # 4 groups a step: 2 rounds of 1 prompt on 2 ranks
    with open(os.path.join(out, "training_losses.txt")) as f:
        assert len(f.read().splitlines()) == 20 * 4  # 2 micro-steps on each of 2 ranks
    with open(os.path.join(out, "accuracy_losses.txt")) as f:
        assert [line.split(",")[0] for line in f.read().splitlines()] == ["0", "10", "20"]
    assert len(read_jsonl(os.path.join(out, "samples.jsonl"))) == 3 * 4
    assert os.path.exists(os.path.join(out, "curves.png")) and os.path.exists(os.path.join(out, "model.safetensors"))
    state = torch.load(os.path.join(out, "checkpoint_20", "trainer_state.pt"), weights_only=True)
    assert state["loop"]["world_size"] == 2 and len(state["loop"]["ranks"]) == 2

    # One process cannot continue a two-process run; it says how to.
    refused = run(["train.py", "--resume=latest", f"--output_dir={out}", "--max_steps=22"], check=False)
    assert refused.returncode != 0 and "torchrun --nproc_per_node=2" in refused.stderr

    train_py(world, out, "--resume=latest", "--max_steps=22")
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(1, 23))
