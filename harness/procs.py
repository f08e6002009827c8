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

Processes a test starts itself (``torchrun``, a nested pytest, a benchmark script) may start
processes of their own, which can leave their parent's session and outlive it (torchrun's
ranks do both). :class:`ProcessTree` / :func:`run_tree` run such a command under a small
supervisor that keeps the whole tree together and kills all of it with the test:

* the supervisor is a Linux *child subreaper* (``PR_SET_CHILD_SUBREAPER``): a process of the
  tree whose parent exits is re-parented to the supervisor, not to init, so every descendant
  stays findable through ``/proc``, whatever session or process group it moved to;
* the owner's every exit path kills the tree: leaving the ``with`` block (normal end, an
  exception, a timeout, KeyboardInterrupt), SIGTERM / SIGHUP of the owner (through
  :func:`install_parent_hooks`) and interpreter exit; a SIGKILLed owner is noticed by the
  supervisor (it watches its parent pid) and the supervisor then kills the tree itself;
* when the command exits, descendants it left behind get ``linger`` seconds to exit by
  themselves and are then killed (and reported in :attr:`ProcessTree.leftovers`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import IO, Any

__all__ = [
    "ProcessTree",
    "descendants",
    "install_parent_hooks",
    "pid_alive",
    "pytest_command",
    "run_tree",
    "set_parent_death_signal",
    "signal_name",
]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent thread exits; False elsewhere."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


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


# ---------------------------------------------------------------------- process trees


def _process_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, state letter) of every process in /proc."""
    table: dict[int, tuple[int, bytes]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int, *, include_zombies: bool = False) -> list[int]:
    """Every process below ``pid`` (children first), from /proc; [] where there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    table = _process_table()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = [c for p in frontier for c in children.get(p, ())]
        found.extend(nxt)
        frontier = nxt
    return [p for p in found if include_zombies or table[p][1] not in (b"Z", b"X")]


def _kill_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# Signals a command under the supervisor starts with in their default disposition: an ignored
# or blocked signal survives exec, and the owner (an xdist worker, say) may have either.
_RESET_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGPIPE,
    signal.SIGCHLD,
)
_WATCHED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Supervisor:
    """The process that runs one command as a tree (runs as ``python procs.py --supervise``)."""

    def __init__(self, status_fd: int, owner: int, linger: float, grace: float, argv: list[str]):
        self.status_fd, self.owner, self.linger, self.grace, self.argv = (
            status_fd,
            owner,
            linger,
            grace,
            argv,
        )
        self.me = os.getpid()
        self.child = 0
        self.status: int | None = None  # the command's wait status

    def report(self, line: str) -> None:
        try:
            os.write(self.status_fd, (line + "\n").encode())
        except OSError:
            pass  # the owner is gone; the tree is killed all the same

    def reap(self) -> None:
        """Collect every exited child (the command and re-parented orphans) without blocking."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.child and self.status is None:
                self.status = status
                self.report(f"exit {_returncode(status)}")

    def kill_tree(self, grace: float) -> list[int]:
        """SIGTERM every descendant, SIGKILL what is left after ``grace`` seconds, reap all."""
        victims = descendants(self.me)
        _kill_all(victims, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and descendants(self.me):
            self.reap()
            time.sleep(0.02)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # repeat: a process may fork while being killed
            left = descendants(self.me)
            if not left:
                break
            _kill_all(left, signal.SIGKILL)
            victims.extend(p for p in left if p not in victims)
            time.sleep(0.02)
            self.reap()
        while descendants(self.me, include_zombies=True) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.02)
        return victims

    def run(self) -> int:
        """Run the command and look after its tree; the command's wait status."""
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        os.set_inheritable(
            self.status_fd, False
        )  # the tree must not hold the owner's status stream
        signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
        if os.getppid() != self.owner:
            return 1 << 8  # the owner died before we started: start nothing
        try:
            self.child = os.posix_spawnp(
                self.argv[0], self.argv, dict(os.environ), setsigmask=(), setsigdef=_RESET_SIGNALS
            )
        except OSError as exc:
            os.write(2, f"process tree: cannot start {self.argv[0]!r}: {exc}\n".encode())
            self.report("exit 127")
            return 127 << 8
        self.report(f"pid {self.child}")
        # Our copies of the output pipes must not keep the owner's reads open.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        linger_until: float | None = None
        while True:
            self.reap()
            if self.status is not None:
                if linger_until is None:
                    linger_until = time.monotonic() + self.linger
                if not descendants(self.me, include_zombies=True):
                    break
                if time.monotonic() >= linger_until:
                    left = self.kill_tree(0.0)
                    if left:
                        self.report("killed " + " ".join(map(str, left)))
                    break
            if os.getppid() != self.owner:
                self.kill_tree(self.grace)  # the owner died without killing us (SIGKILL)
                break
            got = signal.sigtimedwait(_WATCHED, 0.1)
            if got is not None and got.si_signo != signal.SIGCHLD:
                self.kill_tree(self.grace)
                break
        self.reap()
        return self.status if self.status is not None else (128 + signal.SIGKILL) << 8

    def exit(self, status: int) -> None:
        """Exit the way the command did, so the owner sees the same code or signal."""
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            os.kill(os.getpid(), sig)
        os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _returncode(status: int) -> int:
    """subprocess's convention: the exit code, or minus the signal that killed the process."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


_live_trees: set[ProcessTree] = set()


def _kill_live_trees() -> None:
    for tree in list(_live_trees):
        tree.kill()


class ProcessTree:
    """A command run as a process tree that dies with its owner (see the module docstring).

    ``ProcessTree(argv, stdout=..., ...)`` takes :class:`subprocess.Popen`'s I/O arguments
    (``cwd``, ``env``, ``stdin``, ``stdout``, ``stderr``, ``text``); the command starts with
    SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE and SIGCHLD in their default disposition and
    nothing blocked. Use it as a context manager: leaving the block kills whatever of the tree
    is still running.

    ``linger``: seconds the command's descendants may outlive it before they are killed.
    ``grace``: seconds between SIGTERM and SIGKILL when the tree is killed.
    """

    def __init__(
        self, argv: Sequence[str], *, linger: float = 0.0, grace: float = 2.0, **popen_kwargs: Any
    ):
        self.argv = list(argv)
        self.grace = grace
        self.leftovers: list[int] = []
        self._returncode: int | None = None
        self._pid: int | None = None
        self._buffer = b""
        for forbidden in ("start_new_session", "preexec_fn", "pass_fds", "process_group"):
            if forbidden in popen_kwargs:
                raise TypeError(f"ProcessTree sets {forbidden} itself")
        read_fd, write_fd = os.pipe()
        try:
            self._popen = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    os.path.abspath(__file__),
                    "--supervise",
                    str(write_fd),
                    str(os.getpid()),
                    repr(float(linger)),
                    repr(float(grace)),
                    "--",
                    *self.argv,
                ],
                pass_fds=(write_fd,),
                # the terminal's Ctrl-C reaches the owner, which kills the tree
                start_new_session=True,
                **popen_kwargs,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._status_fd = read_fd
        _live_trees.add(self)
        install_parent_hooks(_kill_live_trees)

    # -- status from the supervisor

    def _read_status(self, timeout: float | None) -> bool:
        """Read what the supervisor reported within ``timeout``; False on end of stream."""
        if self._status_fd < 0:
            return False
        ready, _, _ = select.select([self._status_fd], [], [], timeout)
        if not ready:
            return True
        data = os.read(self._status_fd, 4096)
        if not data:
            os.close(self._status_fd)
            self._status_fd = -1
            return False
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            kind, _, value = line.decode().partition(" ")
            if kind == "pid":
                self._pid = int(value)
            elif kind == "exit":
                self._returncode = int(value)
            elif kind == "killed":
                self.leftovers.extend(int(p) for p in value.split())
        return True

    def _poll_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            if not self._read_status(remaining):
                return done()
        return True

    @property
    def pid(self) -> int:
        """The command's pid (not the supervisor's)."""
        if not self._poll_until(lambda: self._pid is not None, 60.0) or self._pid is None:
            raise RuntimeError(
                f"process tree: {self.argv[0]!r} did not start (supervisor "
                f"{signal_name(self._popen.poll())})"
            )
        return self._pid

    @property
    def returncode(self) -> int | None:
        """The command's exit code (negative: the signal that killed it), None while it runs."""
        self._read_status(0)
        return self._returncode

    @property
    def stdout(self) -> IO[Any] | None:
        return self._popen.stdout

    @property
    def stderr(self) -> IO[Any] | None:
        return self._popen.stderr

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command (not its descendants) to exit; its return code."""
        if not self._poll_until(lambda: self._returncode is not None, timeout):
            raise subprocess.TimeoutExpired(self.argv, timeout or 0.0)
        if self._returncode is None:  # the supervisor died without reporting
            self._returncode = self._popen.wait()
        return self._returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Like Popen.communicate: returns once the command and every descendant are done."""
        out, err = self._popen.communicate(input, timeout)
        self._poll_until(lambda: False, None)  # drain the status stream to its end
        if self._returncode is None:
            self._returncode = self._popen.returncode
        return out, err

    def kill(self) -> None:
        """Kill every process of the tree that still runs, and the supervisor; idempotent."""
        sup = self._popen
        if sup.poll() is None:
            try:
                sup.send_signal(signal.SIGTERM)
                sup.wait(timeout=self.grace + 5.0)
            except subprocess.TimeoutExpired:
                # The supervisor is stuck: kill below it ourselves, then it.
                _kill_all(descendants(sup.pid), signal.SIGKILL)
                sup.kill()
                sup.wait()
        _live_trees.discard(self)

    def close(self) -> None:
        self.kill()
        for stream in (self._popen.stdin, self._popen.stdout, self._popen.stderr):
            if stream is not None:
                stream.close()
        self._read_status(0)  # the last reports (a return code, leftovers killed)
        if self._status_fd >= 0:
            os.close(self._status_fd)
            self._status_fd = -1

    def __enter__(self) -> ProcessTree:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_tree(
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    input: Any = None,
    check: bool = False,
    capture_output: bool = False,
    linger: float = 0.0,
    **popen_kwargs: Any,
) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` for a command that may start processes of its own: the whole tree
    is killed on a timeout, an exception or KeyboardInterrupt, and the call returns only once
    every process of the tree is gone (descendants left by the command are killed after
    ``linger`` seconds)."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen_kwargs.setdefault("stdin", subprocess.PIPE)
    with ProcessTree(argv, linger=linger, **popen_kwargs) as tree:
        try:
            out, err = tree.communicate(input, timeout)
        except subprocess.TimeoutExpired:
            tree.kill()
            out, err = tree._popen.communicate()
            raise subprocess.TimeoutExpired(
                list(argv), timeout or 0.0, output=out, stderr=err
            ) from None
        code = tree.returncode
    assert code is not None
    if check and code:
        raise subprocess.CalledProcessError(code, list(argv), out, err)
    return subprocess.CompletedProcess(list(argv), code, out, err)


def pytest_command(*args: str) -> list[str]:
    """``pytest -q <args>`` as this interpreter's module (the environment under test, whatever
    ``pytest`` is on PATH) and with no cache: runs that share the tree never share a cache."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def _supervise_main(args: list[str]) -> None:
    status_fd, owner, linger, grace = int(args[0]), int(args[1]), float(args[2]), float(args[3])
    assert args[4] == "--"
    supervisor = _Supervisor(status_fd, owner, linger, grace, args[5:])
    supervisor.exit(supervisor.run())


if __name__ == "__main__" and sys.argv[1:2] == ["--supervise"]:
    _supervise_main(sys.argv[2:])
