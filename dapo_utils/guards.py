"""What ends a run that can no longer learn, each in one line naming the step, what went wrong, its likely
causes and the last good checkpoint (train.main prints it: RunStopped):

    divergence   a non-finite loss or gradient norm, caught before the optimizer step takes it; non-finite
                 weights, caught before a checkpoint does (check_finite, check_weights)
    starvation   max_empty_rounds sampling rounds in a row that keep no group (check_rounds), with the causes
                 the rounds show: a near-zero temperature, rewards all equal or None, identical responses
    too few rows a training split that cannot fill one optimizer step, said before training (check_rows)
"""

import math

from tqdm.auto import tqdm

from dapo_utils.checkpoints import checkpoint_path, find_checkpoints, non_finite_weights
from dapo_utils.notices import warn

EMPTY_ROUNDS_WARNING = 20  # sampling rounds in a row without a valid group before a warning
NEAR_ZERO_TEMPERATURE = 0.1  # below this a group's G responses are mostly one response


class RunStopped(RuntimeError):
    """A run that cannot go on; its message is the one line that says why."""


def last_good_checkpoint(output_dir):
    steps = find_checkpoints(output_dir)
    return (
        f"the last good checkpoint: --resume={checkpoint_path(output_dir, max(steps))}"
        if steps
        else "no checkpoint yet"
    )


def divergence(args, step, what):
    """The line of a diverged run: its step, what is non-finite, the likely causes, the last good checkpoint."""
    causes = [f"too high a learning rate (lr={args.lr:g})", "rewards of a large scale (reward_weights)"]
    if args.bf16 and args.device.startswith("cuda"):
        causes.append("bf16 overflow (--bf16=false)")
    return (
        f"the run diverged at step {step}: {what}; likely causes: {', '.join(causes)}; "
        f"{last_good_checkpoint(args.output_dir)}"
    )


def check_finite(args, step, quantities):
    """Before optimizer step `step`: each of quantities {name: float} (loss, gradient norm) must be finite."""
    for name, value in quantities.items():
        if not math.isfinite(value):
            raise RunStopped(divergence(args, step, f"the {name} is {value}, stopped before the optimizer step"))


def check_weights(trainer):
    """After an optimizer step, before its checkpoint: every weight must be finite (on every rank: collective)."""
    bad = non_finite_weights(trainer.model)
    if trainer.world.any(bool(bad)):
        what = f"non-finite weights ({bad or 'in another rank'}), stopped before a checkpoint"
        raise RunStopped(divergence(trainer.args, trainer.state.update_steps, what))


def starvation_advice(args):
    rule = f"filter_metric={args.filter_metric!r} skips every group whose responses all score the same"
    return f"{rule}; check the reward functions, use an easier data set or a stronger model, or filter_metric='none'"


class NoTrainingStep(RunStopped):
    """The run ended without a single optimizer step."""


def check_data_ran_out(trainer, start_steps):
    """After the last epoch: a run that took no step since start_steps (every group skipped, to the end of the
    data) stops in one line with the rule and the fix; one that took fewer than the bar's bound says why."""
    state, args = trainer.state, trainer.args
    if state.update_steps == start_steps:
        raise NoTrainingStep(f"the data ran out before one optimizer step: {starvation_advice(args)}")
    if state.update_steps < trainer.global_steps:
        skipped = trainer.world.sum(state.skipped_groups)
        bound = f"{trainer.global_steps} was an upper bound; dynamic sampling skipped {skipped} groups"
        tqdm.write(f"the data ran out after {state.update_steps} steps: {bound}")


def check_rows(trainer, needed):
    """Before training: each epoch's rows fill at least one optimizer step's `needed` prompts (of every process), else
    no step could ever be taken (the buffer lives one epoch) whatever the filter keeps."""
    args, rows, processes = trainer.args, len(trainer.train_dataset), trainer.world.size
    if rows < needed:
        settings = "batch_size x gradient_accumulation_steps x steps_per_generation" + " x processes" * (processes > 1)
        raise RunStopped(
            f"the training split of {args.data_path!r} has {rows} row{'s' * (rows != 1)}, fewer than the {needed} "
            f"prompts one optimizer step takes ({settings}): add rows, lower these settings, or, where test rows "
            f"are held out of it, hold out fewer with --test_size (now {args.test_size})"
        )


def check_rounds(trainer, metrics):
    """Dynamic sampling that keeps too few groups: warn after EMPTY_ROUNDS_WARNING rounds in a row that kept
    none; stop after max_empty_rounds such rounds, naming what the rounds' metrics show; give up after
    max_num_gen_batches rounds for one step. Each says the rule and the fix."""
    args, state, empty = trainer.args, trainer.state, trainer.empty_rounds
    if empty == EMPTY_ROUNDS_WARNING:
        warn(f"the last {empty} sampling rounds kept no group: {starvation_advice(args)}")
    if args.max_empty_rounds and empty >= args.max_empty_rounds:
        seen = starvation_causes(args, metrics, groups=empty * args.batch_size)
        raise RunStopped(
            f"{empty} sampling rounds in a row kept no group after step {state.update_steps}: {seen}; "
            f"{last_good_checkpoint(args.output_dir)} (max_empty_rounds={args.max_empty_rounds}; 0 = no limit)"
        )
    if args.max_num_gen_batches and state.rounds >= args.max_num_gen_batches:  # rounds: over all ranks, as held
        needed = args.batch_size * args.gradient_accumulation_steps * args.steps_per_generation * trainer.world.size
        raise RunStopped(
            f"{state.rounds} sampling rounds gave only {trainer.world.sum(len(state.buffer))} of {needed} valid "
            f"groups: {starvation_advice(args)}, or raise max_num_gen_batches (0 = no limit)"
        )


def starvation_causes(args, metrics, groups):
    """What the last `groups` groups (of this step's metrics: generate_experiences') show, in words."""
    G = args.num_generations
    seen = [f"temperature={args.temperature:g} is near zero"] if args.temperature < NEAR_ZERO_TEMPERATURE else []
    identical = metrics["frac_identical_groups"][-groups:]
    if sum(identical) >= 0.9 * len(identical):
        seen.append(f"a collapsed policy ({sum(identical):.0f} of {len(identical)} groups: {G} identical responses)")
    for name in (key for key in metrics if key.startswith("rewards/")):
        if all(math.isnan(value) for value in metrics[name][-groups * G :]):
            seen.append(f"{name[8:]} returned None or NaN for every response")
    rewards = set(metrics["reward"][-groups * G :])
    seen += [f"every reward was {rewards.pop():g}"] if len(rewards) == 1 else []
    return f"seen: {', '.join(seen) or 'nothing unusual'}; {starvation_advice(args)}"
