"""What `python train.py` does around a run: its modes (--plot, --check_rewards, --eval_only, --demo, --resume,
--ablation: a run per rung and seed, ablation.py), the output folder it holds while it writes there, the checks
before anything loads, and the summary at the end. The run itself is train.py's `run` (the seed's entry point:
build the trainer, train, save the model); train.py's `main` hands this module its pieces, so that the package never imports the script. Under torchrun (one node or
several) what must be one choice for the whole job is rank 0's, and every rank follows it (World.on_rank_0):
the checkpoint to resume, the output folder's lock and its preparation; a refusal ends every rank. A resume holds
the lock before it chooses its checkpoint.

However the command ends, it ends in one line (--debug or DAPO_DEBUG=1: the traceback instead): a refused setting,
a diverged run, a full disk or a user's reward function that fails (with the checkpoint to continue from, or the
command that starts the run again), a torchrun worker that died (a line from each rank left), and Ctrl-C, SIGTERM
or SIGHUP before training (exit status 128 + the signal's number, the lock released). The project's warnings print
as one line each (notices.py).
"""

import contextlib
import errno
import inspect
import os
import shlex
import sys
import time

from dapo_utils import distributed
from dapo_utils.checkpoints import STARTING, Interrupted, resume_advice, stop_signals_raise
from dapo_utils.cli import check_before_loading, check_eval_only, command_settings, debugging, parse_cli
from dapo_utils.cli import run_settings
from dapo_utils.curves import plot_command
from dapo_utils.evaluation import accuracy_summary, run_eval
from dapo_utils.guards import RunStopped
from dapo_utils.notices import one_line_warnings
from dapo_utils.options import python_command, run_command
from dapo_utils.record import write_run_arguments
from dapo_utils.rewards import RewardFunctionError, check_rewards, reward_functions
from dapo_utils.run_dir import claim_output_dir, earlier_run, hold_output_dir, unshared_folder
from dapo_utils.writes import WriteFailed

READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)  # a write refused, not a disk that is full


def main(argv, arguments_class, build_args, build_trainer, run, rewards_module):
    """python train.py [mode] [--preset=NAME] [--field=value ...]. arguments_class: DapoArguments; build_args(preset,
    overrides) -> its instance; build_trainer(args, train=False) -> a trainer for --eval_only; run(args, checkpoint)
    -> the trained trainer; rewards_module: where --reward_funcs' bare names live (reward_func). Returns the trainer
    (--eval_only: {model: metrics}); a refused or failed run exits with one line."""
    cli, given = parse_cli(arguments_class, argv)
    cli.debug = debugging(cli)
    if cli.plot:
        try:
            return print(plot_command(cli.plot, python_command()))
        except WriteFailed as error:  # a full disk
            fail(error, cli.debug)
    # until training: a stop signal ends the start; lock: output_dir's, however the command ends
    with one_line_warnings(), stop_signals_raise(STARTING), contextlib.ExitStack() as lock:
        try:
            return command(cli, given, lock, arguments_class, build_args, build_trainer, run, rewards_module)
        except Interrupted as stop:  # before training (train.py's run stops later ones itself): nothing to resume
            if cli.debug or stop.phase != STARTING:
                raise
            say_once(f"stopped by {stop.name} while starting: nothing was trained; run the same command again")
            sys.exit(128 + stop.signum)


def command(cli, given, lock, arguments_class, build_args, build_trainer, run, rewards_module):
    """main's work once the command line is read: the settings, the checks, the output folder held (lock: an
    ExitStack that lets it go if the command ends before the run), the run."""
    settings = command_settings(cli, given)  # never a checkpoint's: the device and timeout are this machine's
    device, timeout = (settings.get(k, getattr(arguments_class, k)) for k in ("device", "ddp_timeout"))
    world = distributed.setup(device, timeout=timeout)  # torchrun: the process group first, rank 0 decides for all
    if cli.resume:  # held first: no other run writes there, and a killed one's cut-short checkpoint is complete
        hold = (resumed_output_dir(cli.resume, given, settings, arguments_class), cli.take_over_lock, True)
        world.on_rank_0(lambda: lock.enter_context(hold_output_dir(*hold)))
    try:  # the command line over a checkpoint's settings over the demo's, under the preset
        overrides, checkpoint = run_settings(cli, given, arguments_class, world)
        args = build_args(cli.preset, overrides)
        reward_funcs = reward_functions(args, rewards_module)  # names and import paths resolved before anything loads
        status = check_rewards(args, reward_funcs) if cli.check_rewards else None  # no model, no output_dir
    except ValueError as error:
        fail(error, cli.debug)
    if status is not None:
        sys.exit(status)
    if cli.ablation:  # every rung and seed a `python train.py` of its own, once the checks a run makes first pass
        from dapo_utils.ablation import run_ablation

        if not cli.demo:
            check_before_loading(args, len(reward_funcs))
        return run_ablation(cli, given, build_args, inspect.getsourcefile(run))
    if cli.eval_only:  # checked before anything loads
        models = check_eval_only(args, cli.compare)
    world = distributed.setup(args.device, args.num_threads, args.ddp_timeout)  # this run's threads
    with contextlib.ExitStack() as held:
        held.enter_context(lock.pop_all())  # a resume's, until the run ends
        if not cli.resume:
            hold = (args.output_dir, cli.take_over_lock)
            world.on_rank_0(lambda: held.enter_context(hold_output_dir(*hold)))  # rank 0 holds it for the run
        if cli.eval_only:  # no training: model_path (and --compare) on the test split, greedy unless --temperature
            try:
                return run_eval(args, models, build_trainer, temperature_given="temperature" in given)
            except ValueError as error:  # a reward function that fails on its trial rows
                fail(error, cli.debug)
        refusal = unshared_folder(world, args.output_dir)  # every rank reads the checkpoints rank 0 writes
        if refusal:
            sys.exit(refusal if world.is_main else 1)
        ready = (args, cli.demo and checkpoint is None, checkpoint is None and not cli.demo, len(reward_funcs))
        args.model_path, args.data_path = world.on_rank_0(lambda: prepare_output_dir(*ready, cli.debug))
        script = inspect.getsourcefile(run)  # train.py
        again = python_command(script)  # how this folder's shell runs train.py again
        launcher = run_command(world.size, args.fsdp, script)  # this interpreter, with torch's launcher if it ran
        restart, start = launcher + " --demo" * cli.demo, f"{launcher} {shlex.join(cli.argv)}"  # resume; relaunch
        record = f"{again} {shlex.join(cli.argv)}", reward_funcs, os.path.dirname(script)

        def on_start(trainer):  # loaded, before it samples: the command its stop line prints; dapo_args.json
            trainer.command = restart
            if world.is_main:
                write_run_arguments(args, *record)

        trainer = run_to_the_end(args, checkpoint, run, on_start, cli.debug, restart, start)
    if world.is_main:  # the demo's commands run with this interpreter, activated venv or not
        if cli.demo:
            from dapo_utils.tiny_world import demo_summary

            wall = time.perf_counter() - cli.started
            print(demo_summary(trainer.history, args, wall, checkpoint, again, restart))
        else:
            print(accuracy_summary(args.output_dir))
    return trainer


def resumed_output_dir(resume, given, settings, arguments_class):
    """The output_dir a --resume run writes to, known before its checkpoint is chosen (run_settings): --output_dir
    as given, else the folder of --resume=FOLDER/checkpoint_N, else the one --resume=auto and latest look in (the
    demo's, or the default: settings, command_settings')."""
    if resume in ("auto", "latest") or "output_dir" in given:
        return settings.get("output_dir", arguments_class.output_dir)
    return os.path.dirname(os.path.abspath(resume))


def prepare_output_dir(args, fresh_demo, fresh, num_reward_funcs, debug):
    """Rank 0's checks and preparations before anything loads: a fresh demo first builds its world in a folder of
    its own, which it claims; the model and data folders exist; a fresh run claims output_dir (an earlier run's
    logs and checkpoints go, or the run is refused). Returns (model_path, data_path)."""
    if fresh_demo:
        from dapo_utils.tiny_world import demo_world

        try:
            args.model_path, args.data_path = demo_world(args.output_dir, args.system_prompt, args.overwrite_output_dir)
        except WriteFailed as error:  # a full disk
            fail(error, debug, "free space, then run the same command again")
    check_before_loading(args, num_reward_funcs)
    if fresh:
        claim_output_dir(args.output_dir, args.overwrite_output_dir)
    return args.model_path, args.data_path


def run_to_the_end(args, checkpoint, run, on_start, debug, restart, start):
    """run(args, checkpoint, on_start), whose failures end in one line; those that stop a run in its course also
    name the newest checkpoint and the command (restart: its interpreter, launcher and mode) that continues from it
    once the cause is fixed, or, with none, the command that starts the run again (start: this one's)."""

    def advice(fix):  # read once the run has stopped: the checkpoints and logs it left decide the command
        return resume_advice(args.output_dir, fix, restart, start_again(args, start))

    try:
        return run(args, checkpoint, on_start)
    except RewardFunctionError as error:  # the user's reward function: fix it, continue from the newest checkpoint
        fail(error, debug, advice("fix it"))
    except WriteFailed as error:  # a full disk
        fix = "make it writable" if getattr(error.__cause__, "errno", None) in READ_ONLY else "free space"
        fail(error, debug, advice(fix))
    except (ValueError, RunStopped) as error:  # a refused resume, a diverged run (it names its checkpoint)
        fail(error, debug)
    except Interrupted as stop:  # a second Ctrl-C, or one while the final model is written
        if debug or stop.phase == STARTING:
            raise
        say_once(f"stopped by {stop.name} {stop.phase}; {advice('')}")
        sys.exit(128 + stop.signum)
    except KeyboardInterrupt:  # train() saved a checkpoint and printed the command that continues from it
        sys.exit(130)
    except RuntimeError as error:  # torchrun: another rank's process ended; a line from each rank still here
        if debug or not distributed.peer_lost(error):
            raise
        sys.exit(distributed.peer_lost_line(advice("")))


def start_again(args, start):
    """The command that starts a run without a checkpoint again: its own (start), with --overwrite_output_dir=true
    once it has written logs to output_dir, where a fresh run refuses an earlier run's (run_dir.claim_output_dir)."""
    clear = earlier_run(args.output_dir) and not args.overwrite_output_dir
    return f"{start} --overwrite_output_dir=true" if clear else start


def fail(error, debug, advice=""):
    """End the command with error's one line (and advice: what to do next); with --debug, with its traceback."""
    if debug:
        raise error
    sys.exit(f"error: {error}" + (f"; {advice}" if advice else ""))


def say_once(line):
    """A line on stderr from one process (torchrun's rank 0: every rank gets the signal); a terminal that is gone
    (SIGHUP) is no error."""
    if os.environ.get("RANK", "0") == "0":
        try:
            print(line, file=sys.stderr)
        except OSError:
            pass
