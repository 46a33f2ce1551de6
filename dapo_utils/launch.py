"""What `python train.py` does around a run: its modes (--plot, --check_rewards, --eval_only, --demo, --resume), the
output folder it holds while it writes there, the checks before anything loads, and the summary at the end. The
run itself is train.py's `run` (the seed's entry point: build the trainer, train, save the model); train.py's
`main` hands this module its pieces, so that the package never imports the script. Under torchrun (one node or
several) what must be one choice for the whole job is rank 0's, and every rank follows it (World.on_rank_0):
the checkpoint to resume, the output folder's lock and its preparation; a refusal ends every rank.
"""

import contextlib
import sys
import time

from dapo_utils import distributed
from dapo_utils.writes import WriteFailed
from dapo_utils.cli import check_before_loading, check_eval_only, command_settings, parse_cli, run_settings
from dapo_utils.curves import plot_command
from dapo_utils.evaluation import run_eval, run_summary
from dapo_utils.guards import RunStopped
from dapo_utils.rewards import check_rewards, reward_functions
from dapo_utils.run_dir import claim_output_dir, hold_output_dir, unshared_folder


def main(argv, arguments_class, build_args, build_trainer, run, rewards_module):
    """python train.py [mode] [--preset=NAME] [--field=value ...]. arguments_class: DapoArguments; build_args(preset,
    overrides) -> its instance; build_trainer(args, train=False) -> a trainer for --eval_only; run(args, checkpoint)
    -> the trained trainer; rewards_module: where --reward_funcs' bare names live (reward_func). Returns the trainer
    (--eval_only: {model: metrics}); a refused or failed run exits with one line."""
    cli, given = parse_cli(arguments_class, argv)
    if cli.plot:
        try:
            return print(plot_command(cli.plot))
        except WriteFailed as error:  # a full disk
            sys.exit(f"error: {error}")
    device = command_settings(cli, given).get("device", arguments_class.device)  # never a checkpoint's
    world = distributed.setup(device)  # torchrun: the process group first, so that rank 0 decides for all
    try:  # the command line over a checkpoint's settings over the demo's, under the preset
        overrides, checkpoint = run_settings(cli, given, arguments_class, world)
        args = build_args(cli.preset, overrides)
        reward_funcs = reward_functions(args, rewards_module)  # names and import paths resolved before anything loads
        status = check_rewards(args, reward_funcs) if cli.check_rewards else None  # no model, no output_dir
    except ValueError as error:
        sys.exit(f"error: {error}")
    if status is not None:
        sys.exit(status)
    if cli.eval_only:  # checked before anything loads
        models = check_eval_only(args, cli.compare)
    world = distributed.setup(args.device, args.num_threads)
    hold = (args.output_dir, cli.take_over_lock, bool(cli.resume))  # a resume (auto too) takes a dead lock
    with contextlib.ExitStack() as held:
        world.on_rank_0(lambda: held.enter_context(hold_output_dir(*hold)))  # rank 0 holds it for the run
        if cli.eval_only:  # no training: model_path (and --compare) on the test split, greedy unless --temperature
            return run_eval(args, models, build_trainer, temperature_given="temperature" in given)
        refusal = unshared_folder(world, args.output_dir)  # every rank reads the checkpoints rank 0 writes
        if refusal:
            sys.exit(refusal if world.is_main else 1)
        ready = (args, cli.demo and checkpoint is None, checkpoint is None, len(reward_funcs))
        args.model_path, args.data_path = world.on_rank_0(lambda: prepare_output_dir(*ready))
        try:
            trainer = run(args, checkpoint)
        except (ValueError, RunStopped, WriteFailed) as error:  # a refused resume, a diverged run, a full disk
            sys.exit(f"error: {error}")
        except KeyboardInterrupt:  # train() saved a checkpoint, or the final save kept the earlier files: said so
            sys.exit(130)
    if world.is_main:
        print(run_summary(args.output_dir, trainer.history if cli.demo else None, time.perf_counter() - cli.started))
    return trainer


def prepare_output_dir(args, fresh_demo, fresh, num_reward_funcs):
    """Rank 0's checks and preparations before anything loads: a fresh demo first builds its world in a folder of
    its own; the model and data folders exist; a fresh run claims output_dir (an earlier run's logs and
    checkpoints go, or the run is refused). Returns (model_path, data_path)."""
    if fresh_demo:
        from dapo_utils.tiny_world import demo_world

        args.model_path, args.data_path = demo_world(args.output_dir, args.system_prompt, args.overwrite_output_dir)
    check_before_loading(args, num_reward_funcs)
    if fresh:
        claim_output_dir(args.output_dir, args.overwrite_output_dir)
    return args.model_path, args.data_path
