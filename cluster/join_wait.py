"""When requests that may join a running chain (chain_admit.py) join it:
now, or after waiting for more to join with them.

A join cycle costs a fixed time beyond a plain cycle's, whatever it admits
(H100, embedded pair, c=64 T=1: 8.4 ms against 3.1, for ~1.8 requests),
and a speculative engine's rows finish apart, one or two a cycle, where an
autoregressive engine's same-length requests finish together. A joiner
that waits a cycle costs its place's share of that cycle, ``w = plain /
rows``. Joining every ``k`` arrivals costs ``J / k`` a request in joins and
about ``w (k - 1) / (2 lambda)`` in waiting, ``lambda`` the requests that
join a cycle: the sum is least at ``k = sqrt(2 J lambda / w)``, the batch
``JoinWait`` waits for (at most ``join_max``, at least 1). Under light
load that is 1 (join at once: no one else is coming soon); under heavy
load the joiners wait for a few more. ``J``, the plain cycle and
``lambda`` are moving means of the engine's own cycles; until they are
known, joiners join at once. A joiner waits ``max_steps`` cycles at most
(its time to first token). A fixed ``batch`` (``EngineConfig.join_batch``)
waits for that many instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.1  # weight of the newest cycle in the moving means of cycle times
ALPHA_ARRIVALS = 0.02  # and in the mean of requests joining a cycle (most cycles admit none)


@dataclass
class JoinWait:
    join_max: int  # most requests one join admits (chain_admit.JOIN_MAX)
    max_steps: int  # most cycles a joiner waits (EngineConfig.join_wait_steps)
    batch: int | None = None  # wait for this many instead (EngineConfig.join_batch); None: the cost model
    join_ms: float | None = None  # J: a join cycle's wall time beyond a plain cycle's (moving mean)
    plain_ms: float | None = None  # a plain cycle's wall time (moving mean)
    arrivals: float = 0.0  # lambda: requests that join a cycle (moving mean)
    waited: int = 0  # cycles the current joiners have waited

    def want(self, rows: int) -> int:
        """How many requests a join of a chain of ``rows`` rows waits for."""
        if self.batch is not None:
            return min(self.batch, self.join_max)
        if self.join_ms is None or not self.plain_ms or self.arrivals <= 0:
            return 1
        place_ms = self.plain_ms / max(rows, 1)
        k = math.sqrt(2 * self.join_ms * self.arrivals / place_ms)
        return max(1, min(self.join_max, round(k)))

    def waits(self, joins: int, rows: int) -> bool:
        """Whether ``joins`` requests that may join a chain of ``rows`` rows
        now wait another cycle (counted as waited if so)."""
        if joins <= 0:
            return False
        if joins >= self.want(rows) or self.waited >= self.max_steps:
            self.reset()
            return False
        self.waited += 1
        return True

    def observe(self, wall_ms: float, joined: int) -> None:
        """A cycle of the running chain took ``wall_ms``; ``joined``
        requests joined in it."""
        self.arrivals += ALPHA_ARRIVALS * (joined - self.arrivals)
        if not joined:
            self.plain_ms = wall_ms if self.plain_ms is None else self.plain_ms + ALPHA * (wall_ms - self.plain_ms)
        elif self.plain_ms is not None:
            extra = max(0.0, wall_ms - self.plain_ms)
            self.join_ms = extra if self.join_ms is None else self.join_ms + ALPHA * (extra - self.join_ms)

    def reset(self) -> None:
        self.waited = 0
