"""The engine's processes at normal CPU priority.

Ray starts its worker processes at niceness 15 (its ``worker_niceness``:
the workers yield to its own daemons). The engine's actors, and the Serve
replica in front of them, are the workload: a step thread at niceness 15
gives its core up to any normal process beside it (a load generator on the
same host, a data loader) and waits to get it back, a wait each step pays.
Each of them puts its threads back at niceness 0 where the process may
(root, or CAP_SYS_NICE); elsewhere it says so once, and
``RAY_worker_niceness=0`` in the environment of the process that starts the
cluster does the same for every worker (`specray serve`, ``LLM`` and batch
jobs set it for the Ray they start).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("specray.priority")
_warned = False


def normal_priority() -> None:
    """Every thread of this process that runs at a niceness above 0 back
    at 0 (a thread started later inherits its starter's)."""
    global _warned
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return  # not Linux: Ray's niceness is Linux's too
    for tid in map(int, tids):
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError:
            if not _warned:
                _warned = True
                log.warning("this process runs at niceness %d and may not lower it: under CPU load its steps wait "
                            "for a core (start the Ray cluster with RAY_worker_niceness=0)",
                            os.getpriority(os.PRIO_PROCESS, 0))
            return


def local_ray_env() -> None:
    """For a Ray this process is about to start: its workers at niceness 0."""
    os.environ.setdefault("RAY_worker_niceness", "0")
