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
    """One line at the end of output_dir/name (a log of LOG_FILES), whole or not at all: a write that fails part
    way (a full disk) is cut back off, so that the log ends in its last whole line."""
    path = os.path.join(output_dir, name)
    with writing("the log", path, "; its last line was not written, the lines before are whole"):
        os.makedirs(output_dir, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size, data = os.fstat(descriptor).st_size, (line + "\n").encode()
        try:
            while data:  # os.write may write part of it and return the count
                data = data[os.write(descriptor, data) :]
        except OSError:
            os.ftruncate(descriptor, size)
            raise
        finally:
            os.close(descriptor)
