"""Starts a pool, records the pids, then waits to be killed (see tests/harness/test_orphans.py)."""

from __future__ import annotations

import json
import os
import time

from harness import get_pool
from tests.harness import rank_fns


def test_hold_a_pool_until_killed() -> None:
    pool = get_pool(2)
    assert pool.run(rank_fns.all_reduce_sum, 1) == [3.0, 3.0]
    forkserver = [
        int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) for pid in pool.pids
    ]
    info = {
        "pytest_pid": os.getpid(),
        "rank_pids": pool.pids,
        "forkserver_pids": sorted(set(forkserver)),
    }
    path = os.environ["HARNESS_TEST_PIDS_FILE"]
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    time.sleep(120)
