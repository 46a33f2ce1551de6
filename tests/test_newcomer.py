"""What a newcomer reads: `--help` (the modes first, the fields in their sections, one switch per bool), and the one
line that points to the right folder when `--plot` or `--resume=latest` finds nothing where it looks."""

import dataclasses
import inspect
import re

import pytest

from dapo_utils.cli import field_sections, parse_cli
from train import DapoArguments, main


def help_text(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_shows_the_modes_first_then_the_fields_in_their_sections(monkeypatch, capsys):
    text = help_text(monkeypatch, capsys)
    headings = re.findall(r"^(\S.*):$", text, flags=re.M)
    titles = re.findall(r"^    # --- (.+) ---$", inspect.getsource(DapoArguments), flags=re.M)
    assert titles[:2] == ["paths and run", "optimisation (seed: plain Adam, constant lr)"] and len(titles) == 7
    assert headings == ["options", "modes (none: train with the settings below)", *titles]
    assert text.startswith(
        "usage: train.py [--demo | --eval_only [--compare=MODEL] | --resume=CHECKPOINT | --plot DIR... | --check_rewards "
        "| --ablation] [--preset=NAME] [--field=value ...]\n"
    )
    modes = text.split("modes (none: train with the settings below):\n")[1].split("\n\n")[0]
    options = re.findall(r"^  (--\w+)", modes, flags=re.M)
    assert options == [
        "--demo",
        "--eval_only",
        "--compare",
        "--resume",
        "--plot",
        "--check_rewards",
        "--preset",
        "--ablation",
        "--seeds",
        "--variants",
        "--jobs",
        "--take_over_lock",
    ]
    sections = field_sections(DapoArguments)  # each field in the group of its section, in the class's order
    assert list(sections) == titles and sum(sections.values(), []) == [
        f.name for f in dataclasses.fields(DapoArguments)
    ]
    speed = text.split("speed and memory:\n")[1]
    assert re.findall(r"^  (--\w+)", speed, flags=re.M)[:3] == ["--bf16", "--tf32", "--num_threads"]
    # --bf16 / --no_bf16: one switch, one line; both spellings still parse
    assert (
        "  --bf16 [BF16]         on CUDA, autocast forward passes to bf16 (weights stay float32); "
        "--no_bf16 = --bf16=false (default: True)\n"
    ) in text
    assert text.count("--no_bf16") == 1 and "--no-bf16" not in text
    for argv in (["--no_bf16"], ["--bf16=false"], ["--no-bf16"]):
        assert parse_cli(DapoArguments, argv)[1] == {"bf16": False}
    assert parse_cli(DapoArguments, ["--bf16"])[1] == {"bf16": True}


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
        f"python train.py --plot={tmp_path}/output/demo"
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
