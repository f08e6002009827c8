"""Process lifetime helpers: parent-death signals, liveness checks, and the parent's exit hooks.

No rank process may outlive the pytest process that owns it, whatever way that process ends:

* normal end: the pytest plugin shuts every pool down at session finish, and an ``atexit`` hook
  does it again for scripts;
* SIGTERM / SIGHUP: :func:`install_parent_hooks` installs handlers that shut the pools down and
  then let the signal do what it did before (SIGINT already becomes KeyboardInterrupt, which runs
  the session-finish and atexit paths);
* SIGKILL, a crashed xdist worker: nothing runs in the parent, so the ranks look after themselves:
  ``PR_SET_PDEATHSIG`` (see :func:`set_parent_death_signal`) and a watchdog thread in each rank
  that exits when the control connection closes or the owning pid goes away.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (a zombie has exited; only its entry remains)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no procfs: kill(0) is all we know
    # The state field follows the parenthesised command name, which may itself contain spaces.
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def signal_name(returncode: int | None) -> str:
    """Human wording for a process exit code (negative = killed by a signal)."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


_shutdown_callbacks: list[Callable[[], None]] = []
_hooks_installed = False
_hooks_lock = threading.Lock()


def _run_shutdown_callbacks() -> None:
    for callback in list(_shutdown_callbacks):
        try:
            callback()
        except Exception:  # a failing shutdown must not stop the others
            pass


def _make_handler(signum: int, previous: Any) -> Callable[[int, FrameType | None], None]:
    def handler(sig: int, frame: FrameType | None) -> None:
        _run_shutdown_callbacks()
        if callable(previous):
            previous(sig, frame)
            return
        if previous == signal.SIG_IGN:
            return
        # Default action: restore it and re-deliver, so the exit status says "killed by SIGTERM".
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler


def install_parent_hooks(shutdown: Callable[[], None]) -> None:
    """Run ``shutdown`` at interpreter exit and on SIGTERM / SIGHUP (once per process).

    Signal handlers can only be installed from the main thread; from another thread only the
    ``atexit`` hook is installed (the ranks' own watchdogs still cover the rest).
    """
    global _hooks_installed
    with _hooks_lock:
        if shutdown not in _shutdown_callbacks:
            _shutdown_callbacks.append(shutdown)
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(_run_shutdown_callbacks)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous = signal.getsignal(signum)
            signal.signal(signum, _make_handler(signum, previous))
        except (ValueError, OSError):
            pass
