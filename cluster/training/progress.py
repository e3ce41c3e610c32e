"""Log lines stamped with the run's elapsed time, and progress bars: the
bars go to stderr and only to a terminal, the lines to stdout above them
(a run's stdout is its record)."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

_start = time.time()


def reset_clock() -> None:
    global _start
    _start = time.time()


def elapsed() -> float:
    return time.time() - _start


def log(msg: str) -> None:
    tqdm.write(f"[{elapsed():7.1f}s] {msg}", file=sys.stdout)
    sys.stdout.flush()


def bar(**kwargs) -> tqdm:
    # disable=None: no bar where stderr is not a terminal (logs, CI).
    return tqdm(file=sys.stderr, disable=None, dynamic_ncols=True, **kwargs)
