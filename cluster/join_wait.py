"""When requests that may join a running chain (chain_admit.py) join it:
now, or after waiting for more to join with them.

A join cycle costs a fixed time beyond a plain cycle's, whatever it admits
(H100, embedded pair, c=64 T=1: 8.4 ms against 3.1, for ~1.8 requests),
and a speculative engine's rows finish apart, one or two a cycle, where an
autoregressive engine's same-length requests finish together. A joiner
that waits a cycle costs its place's share of that cycle (a row of
``rows`` riding as padding). ``JoinWait`` weighs the two as rent or buy:
the joiners wait while what waiting has cost so far stays below one join's
measured extra cost, at most ``max_steps`` cycles (their time to first
token) and no longer than ``JOIN_MAX`` of them may join at once. Until a
join and a plain cycle have been timed, joiners join at once. A fixed
``batch`` (``EngineConfig.join_batch``) waits for that many instead.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.1  # weight of the newest cycle in the moving means


@dataclass
class JoinWait:
    join_max: int  # most requests one join admits (chain_admit.JOIN_MAX)
    max_steps: int  # most cycles a joiner waits (EngineConfig.join_wait_steps)
    batch: int | None = None  # wait for this many instead (EngineConfig.join_batch); None: rent or buy
    join_ms: float | None = None  # a join cycle's wall time beyond a plain cycle's (moving mean)
    plain_ms: float | None = None  # a plain cycle's wall time (moving mean)
    waited: int = 0  # cycles the current joiners have waited
    wait_ms: float = 0.0  # what their waiting has cost, in cycle time

    def waits(self, joins: int, rows: int) -> bool:
        """Whether ``joins`` requests that may join a chain of ``rows`` rows
        now wait another cycle (counted as waited if so)."""
        if joins <= 0:
            return False
        want = min(self.batch or self.join_max, self.join_max)
        done = joins >= want or self.waited >= self.max_steps
        if self.batch is None:
            done = done or self.join_ms is None or self.wait_ms >= self.join_ms
        if done:
            self.reset()
            return False
        self.waited += 1
        self.wait_ms += joins * (self.plain_ms or 0.0) / max(rows, 1)
        return True

    def observe(self, wall_ms: float, joined: bool) -> None:
        """A cycle of the running chain took ``wall_ms``; requests joined in
        it or not."""
        if not joined:
            self.plain_ms = wall_ms if self.plain_ms is None else self.plain_ms + ALPHA * (wall_ms - self.plain_ms)
        elif self.plain_ms is not None:
            extra = max(0.0, wall_ms - self.plain_ms)
            self.join_ms = extra if self.join_ms is None else self.join_ms + ALPHA * (extra - self.join_ms)

    def reset(self) -> None:
        self.waited, self.wait_ms = 0, 0.0
