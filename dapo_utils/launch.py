"""What `python train.py` does around a run: its modes (--plot, --check_rewards, --eval_only, --demo, --resume,
--ablation: a run per rung and seed, ablation.py), the output folder it holds while it writes there, the checks
before anything loads, and the summary at the end. The run itself is train.py's `run` (the seed's entry point: build the trainer, train, save the model); train.py's
`main` hands this module its pieces, so that the package never imports the script.
"""

import sys
import time

from dapo_utils import distributed
from dapo_utils.writes import WriteFailed
from dapo_utils.cli import check_before_loading, check_eval_only, parse_cli, run_settings
from dapo_utils.curves import plot_command
from dapo_utils.evaluation import run_eval, run_summary
from dapo_utils.guards import RunStopped
from dapo_utils.rewards import check_rewards, reward_functions
from dapo_utils.run_dir import claim_output_dir, hold_output_dir


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
    try:  # the command line over a checkpoint's settings over the demo's, under the preset
        overrides, checkpoint = run_settings(cli, given, arguments_class)
        args = build_args(cli.preset, overrides)
        reward_funcs = reward_functions(args, rewards_module)  # names and import paths resolved before anything loads
        status = check_rewards(args, reward_funcs) if cli.check_rewards else None  # no model, no output_dir
    except ValueError as error:
        sys.exit(f"error: {error}")
    if status is not None:
        sys.exit(status)
    if cli.ablation:  # every rung and seed a `python train.py` of its own, once the checks a run makes first pass
        from dapo_utils.ablation import run_ablation

        if not cli.demo:
            check_before_loading(args, len(reward_funcs))
        return run_ablation(cli, given, build_args, sys.modules[arguments_class.__module__].__file__)
    if cli.eval_only:  # checked before anything loads
        models = check_eval_only(args, cli.compare)
    world = distributed.setup(args.device, args.num_threads)  # torchrun: rank 0 alone prepares the folders
    hold = (args.output_dir, cli.take_over_lock, world.is_main, checkpoint is not None)  # a resume takes a dead lock
    with hold_output_dir(*hold):  # rank 0 holds it for the run
        if cli.eval_only:  # no training: model_path (and --compare) on the test split, greedy unless --temperature
            return run_eval(args, models, build_trainer, temperature_given="temperature" in given)
        if world.is_main:  # a fresh demo first builds its world in a folder of its own
            if cli.demo and checkpoint is None:
                from dapo_utils.tiny_world import demo_world

                world_paths = demo_world(args.output_dir, args.system_prompt, args.overwrite_output_dir)
                args.model_path, args.data_path = world_paths
            check_before_loading(args, len(reward_funcs))
            if checkpoint is None:  # a fresh run: an earlier run's logs and checkpoints go, or the run is refused
                claim_output_dir(args.output_dir, args.overwrite_output_dir)
        args.model_path, args.data_path = world.from_rank_0((args.model_path, args.data_path))
        try:
            trainer = run(args, checkpoint)
        except (ValueError, RunStopped, WriteFailed) as error:  # a refused resume, a diverged run, a full disk
            sys.exit(f"error: {error}")
        except KeyboardInterrupt:  # train() saved a checkpoint, or the final save kept the earlier files: said so
            sys.exit(130)
    if world.is_main:
        print(run_summary(args.output_dir, trainer.history if cli.demo else None, time.perf_counter() - cli.started))
    return trainer
