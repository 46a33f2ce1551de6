"""report_to: metrics to TensorBoard, Weights & Biases or Trackio. Each package is imported only when named."""

import importlib
import os


def make_tracker(report_to, output_dir, config):
    """A tracker with log(record) and close(); records are metrics.jsonl's dicts with a "step"."""
    if report_to == "tensorboard":
        return TensorBoard(os.path.join(output_dir, "runs"))
    if report_to in ("wandb", "trackio"):  # the same init / log / finish interface
        return RunTracker(importlib.import_module(report_to), config)
    return NoTracker()


def scalars(record):
    return {key: value for key, value in record.items() if key != "step" and isinstance(value, (int, float))}


class NoTracker:
    def log(self, record):
        pass

    def close(self):
        pass


class TensorBoard:
    def __init__(self, log_dir):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir)

    def log(self, record):
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self):
        self.writer.close()


class RunTracker:
    def __init__(self, module, config):
        self.module = module
        module.init(project="dapo", config=config)

    def log(self, record):
        self.module.log(scalars(record), step=record["step"])

    def close(self):
        self.module.finish()
