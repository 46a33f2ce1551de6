"""Files a run writes: a write that fails (a full disk, a quota, a read-only folder) becomes WriteFailed, whose
one line names what was being written, where, why, and what the run keeps; train.main prints it and exits."""

import contextlib
import os

import safetensors

WRITE_ERRORS = (OSError, RuntimeError, safetensors.SafetensorError)  # torch: RuntimeError "[enforce fail ...]"


class WriteFailed(RuntimeError):
    """A file of the run could not be written (a full disk, a quota, a read-only folder); train.main ends the run
    with its one line: what, where, why, and what is intact."""


def why(error):
    """An error's cause in a few words: the OS's ("No space left on device") or the first line of its message."""
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return reason.strip().splitlines()[0]


@contextlib.contextmanager
def writing(what, path, intact=""):
    """Turn a failed write of `what` at `path` into WriteFailed (one line); intact: what the run keeps."""
    try:
        yield
    except WRITE_ERRORS as error:
        raise WriteFailed(f"could not write {what} {path} ({why(error)}){intact}") from error


def append_log(output_dir, name, line):
    """One line at the end of output_dir/name (a log of LOG_FILES)."""
    path = os.path.join(output_dir, name)
    with writing("the log", path, "; the checkpoints are intact"):
        os.makedirs(output_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
