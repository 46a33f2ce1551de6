"""The project's warnings (DapoWarning, raised with warn): each prints as one line, `warning: message`, without the
file, line number and source line that Python's format adds, while `python train.py` runs (one_line_warnings).

Scoped on purpose: only DapoWarning changes form, and only inside launch.main; every other package's warnings
print as Python prints them, and a program that imports train.py as a library keeps Python's format throughout.
A DapoWarning is a UserWarning: `-W ignore::UserWarning` and pytest's filters still apply to it.
"""

import contextlib
import warnings


class DapoWarning(UserWarning):
    """A warning of this project: its message is the whole line, naming the problem and the fix."""


def warn(message):
    """Raise a DapoWarning (one line under one_line_warnings)."""
    warnings.warn(message, DapoWarning, stacklevel=2)


@contextlib.contextmanager
def one_line_warnings():
    """While the block runs, a DapoWarning prints as `warning: message`; other warnings as before (the format in
    place is kept and called for them)."""
    python_format = warnings.formatwarning

    def format_warning(message, category, filename, lineno, line=None):
        if issubclass(category, DapoWarning):
            return f"warning: {message}\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning
    try:
        yield
    finally:
        warnings.formatwarning = python_format
