"""Time limits for code that may hang (a user's reward function, a math-verify check): `with time_limit(seconds,
SomeExpired):` raises SomeExpired in the block once it runs past its seconds. SIGALRM interrupts Python code
wherever it is (a thread cannot be stopped from outside); only the main thread receives it, so elsewhere a block
runs without a limit. Blocks nest, each with its own deadline, on one interval timer.
"""

import contextlib
import signal
import threading
import time


class TimeLimitExpired(BaseException):
    """A time_limit block ran past its limit. A BaseException, so that the code it interrupts (a user's
    `except Exception`, math-verify's) does not swallow it."""


DEADLINES = []  # the open time_limit blocks, innermost last: (monotonic deadline, TimeLimitExpired class)


@contextlib.contextmanager
def time_limit(seconds, expired=TimeLimitExpired):
    """Raise `expired` in the block once it runs past `seconds` (0: no limit). The alarm is SIGALRM's, which only the
    main thread receives: in other threads the block runs without a limit. Blocks nest (a check's limit inside a
    reward call's): each expires at its own deadline, the outer one first when both have passed."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, raise_expired) if not DEADLINES else None
    DEADLINES.append((time.monotonic() + seconds, expired))
    arm_alarm()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        DEADLINES.pop()
        if DEADLINES:
            arm_alarm()
        else:
            signal.signal(signal.SIGALRM, previous)


def arm_alarm():
    """SIGALRM at the nearest open deadline (at once if it has passed)."""
    signal.setitimer(signal.ITIMER_REAL, max(min(d for d, _ in DEADLINES) - time.monotonic(), 1e-4))


def raise_expired(signum, frame):
    passed = [expired for deadline, expired in DEADLINES if deadline <= time.monotonic()]
    if passed:
        raise passed[0]()
    arm_alarm()  # early (a clock's rounding): wait for the deadline
