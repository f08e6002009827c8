"""A torchrun rank that records its pid (PIDS_FILE.<rank>) and sleeps; no torch import."""

from __future__ import annotations

import os
import sys
import time

path = f"{sys.argv[1]}.{os.environ['RANK']}"
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(600)
