"""A stand-in for torchrun's process tree: a launcher whose workers leave its session.

Usage: ``python launcher_like.py PIDS_FILE [--exit]``

The launcher starts two workers in sessions of their own (as torchrun's elastic agent does);
each worker ignores SIGTERM, SIGINT and SIGHUP (as a rank blocked in a store reconnect loop
effectively does) and one of them starts a grandchild that does the same. Every pid is written
to PIDS_FILE (JSON list) once all are running. Then the launcher sleeps, or exits at once with
``--exit`` (leaving its workers behind). Only the standard library: it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

STUBBORN = (
    "import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP): "
    "signal.signal(s, signal.SIG_IGN)\n"
)


def _worker_code(with_grandchild: bool) -> str:
    code = STUBBORN
    if with_grandchild:
        code += (
            "import subprocess, sys\n"
            f"g = subprocess.Popen([sys.executable, '-c', {STUBBORN + 'time.sleep(600)'!r}], "
            "start_new_session=True)\n"
            "print(g.pid, flush=True)\n"
        )
    else:
        code += "print('-', flush=True)\n"
    return code + "time.sleep(600)\n"


def main() -> None:
    pids_file, exit_at_once = sys.argv[1], "--exit" in sys.argv[2:]
    pids = [os.getpid()]
    for i in range(2):
        worker = subprocess.Popen(
            [sys.executable, "-c", _worker_code(with_grandchild=i == 0)],
            start_new_session=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        pids.append(worker.pid)
        line = worker.stdout.readline().strip()  # the worker is running (and its grandchild too)
        if line != "-":
            pids.append(int(line))
    with open(pids_file + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(pids_file + ".tmp", pids_file)
    if exit_at_once:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(600)


if __name__ == "__main__":
    main()
