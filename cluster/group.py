"""The Ray actors of one engine, rebuilt when a target rank is lost.

A lost rank (its process gone, or rank 0's step loop ended by a failed
collective) fails every request of the group: rank 0 ends them as the
engine's errors, or, rank 0 itself gone, the front does. ``EngineGroup``
then shuts the old group down (every actor killed, its placement group
removed) and starts a new one; each group is an *epoch*, and an output
cursor or a request belongs to the epoch it was made in. Callers wait for a
rebuild in progress (up to ``wait_s``); a group that cannot be rebuilt
(``max_attempts`` tries) leaves the engine ``failed``: every call raises
``EngineUnavailable``, and a Serve replica reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback

from specray.faults import EngineUnavailable, format_error

log = logging.getLogger("specray.group")


class EngineLost(EngineUnavailable):
    """The group of ``epoch`` is gone: its requests will not finish."""

    def __init__(self, epoch: int, message: str):
        super().__init__(message)
        self.epoch = epoch


class EngineGroup:
    def __init__(self, actors, start=None, wait_s: float = 180.0, max_attempts: int = 3):
        self.actors = actors
        self.epoch = 0
        self.start, self.wait_s, self.max_attempts = start, wait_s, max_attempts
        self.state = "ok"  # ok | rebuilding | failed | closed
        self.rebuilds = 0
        self.failure: str | None = None  # what lost the last group
        self.lost_at: float | None = None
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._ready.set()

    # ------------------------------------------------------------- state
    def lost(self, epoch: int, reason: str) -> None:
        """The group of ``epoch`` lost a worker: rebuild it (once, however
        many callers saw it)."""
        with self._lock:
            if epoch != self.epoch or self.state != "ok":
                return
            self.state, self.failure, self.lost_at = "rebuilding", reason, time.monotonic()
            self._ready.clear()
            old = self.actors
        log.error("engine group %d lost: %s; rebuilding", epoch, reason)
        threading.Thread(target=self._rebuild, args=(old,), name="specray-rebuild", daemon=True).start()

    def _rebuild(self, old) -> None:
        try:
            old.shutdown(timeout_s=5.0)
        except Exception:
            log.warning("shutting the lost group down failed:\n%s", traceback.format_exc())
        error = None
        for attempt in range(self.max_attempts if self.start is not None else 0):
            if self.state == "closed":
                return
            try:
                new = self.start()
            except Exception as e:
                error = format_error(e)
                log.error("rebuilding the engine failed (attempt %d):\n%s", attempt + 1, error)
                time.sleep(min(2.0 ** attempt, 10.0))
                continue
            with self._lock:
                if self.state == "closed":
                    new.shutdown(timeout_s=5.0)
                    return
                self.actors, self.epoch, self.state = new, self.epoch + 1, "ok"
                self.rebuilds += 1
                self._ready.set()
            log.warning("engine group %d is up (%.1f s after the loss)", self.epoch, time.monotonic() - self.lost_at)
            return
        with self._lock:
            if self.state != "closed":
                self.state = "failed"
                self.failure = f"{self.failure}\nrebuilding failed: {error or 'no way to start a group'}"
            self._ready.set()

    def _check(self) -> tuple[int, object]:
        if self.state == "failed":
            raise EngineUnavailable(f"the engine could not be rebuilt after a lost worker:\n{self.failure}")
        if self.state == "closed":
            raise RuntimeError("the engine has shut down")
        return self.epoch, self.actors

    def current(self) -> tuple[int, object]:
        """(epoch, actors) of the live group, waiting for a rebuild."""
        if not self._ready.wait(self.wait_s):
            raise EngineUnavailable(f"the engine is still being rebuilt after {self.wait_s:.0f} s")
        return self._check()

    async def acurrent(self) -> tuple[int, object]:
        end = time.monotonic() + self.wait_s
        while not self._ready.is_set():  # no thread per waiter: many requests may wait
            if time.monotonic() > end:
                raise EngineUnavailable(f"the engine is still being rebuilt after {self.wait_s:.0f} s")
            await asyncio.sleep(0.05)
        return self._check()

    def close(self):
        with self._lock:
            self.state = "closed"
            self._ready.set()
            return self.actors
