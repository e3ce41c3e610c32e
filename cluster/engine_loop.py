"""EngineLoop: an EngineCore stepping in its own thread, fed through a
thread-safe inbox and drained through an outbox.

It is the same object in-process (behind the async engine) and inside the
rank-0 actor of a Ray deployment (behind three actor methods). Callers submit
and abort in batches and collect outputs in batches, so the step loop itself
never waits on a caller and makes no RPC.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
import traceback

from specray.engine import EngineCore
from specray.faults import FaultHandler, GroupLost, format_error
from specray.phase_timer import PhaseTimer
from specray.request import RequestOutput, coalesce
from specray.sampling import SamplingParams

log = logging.getLogger("specray.engine_loop")


def freeze_startup_heap() -> None:
    """What the process holds once the engine is built (models,
    tokenizers, graphs: ~300k objects for the embedded pair) is left out of
    the collector's full collections, which traversed it all (~100 ms)
    mid-stream whenever enough new objects had survived; ``gc.unfreeze()``
    gives it back."""
    gc.collect()
    gc.freeze()


def set_switch_interval() -> None:
    """``SPECRAY_SWITCH_INTERVAL_US``: how long (microseconds) the step
    thread, busy on the host between launches, may keep the GIL while the
    process's RPC and output threads wait for it (CPython's default is
    5 000)."""
    us = os.environ.get("SPECRAY_SWITCH_INTERVAL_US")
    if not us:
        return
    if not us.isdigit() or int(us) == 0:
        raise ValueError(f"SPECRAY_SWITCH_INTERVAL_US must be a positive whole number of microseconds, not {us!r}")
    sys.setswitchinterval(int(us) / 1e6)


class EngineLoop:
    """``restart_drafter`` / ``restart_inline``: how a lost drafter is
    replaced (``faults.FaultHandler``)."""

    def __init__(self, engine: EngineCore, on_stop=None, restart_drafter=None, restart_inline: bool = False):
        set_switch_interval()  # first: a bad value fails the start before anything is held
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._outbox: list[RequestOutput] = []
        self._base = 0  # sequence number of _outbox[0]
        self._live: set[str] = set()  # ids submitted and not yet finished
        self._stopped = False
        self._closed = False  # the loop thread has ended: nothing more will be output
        self._on_stop = on_stop
        self.num_steps = 0
        self.step_time_s = 0.0
        self.model_time_s = 0.0
        self.features = engine.features()
        log.info("engine features: %s", ", ".join(
            f"{k} on" if v["on"] else f"{k} off ({v['reason']})" for k, v in self.features.items()))
        self.faults = FaultHandler(engine, restart_drafter, restart_inline, wake=self._wake)
        self.failure: str | None = None  # what ended the loop, when a lost worker did
        self._step_started: float | None = None
        # Diagnostics: the host time of each step's phases, in stats()
        self.phases = PhaseTimer(engine) if os.environ.get("SPECRAY_PHASES") == "1" else None
        freeze_startup_heap()
        self._thread = threading.Thread(target=self._run, name="specray-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ callers
    def submit(self, items: list[tuple]) -> list[Exception | None]:
        """``items``: ``(prompt, params, request_id)``, or with a fourth
        element, the seconds the request may take (None: no limit). Returns,
        per item, None when queued or the error that rejected it (its type
        tells the serving layer which HTTP error it is; it pickles across
        Ray)."""
        errors: list[Exception | None] = []
        accepted = []
        for item in items:
            try:
                prompt, params, request_id, timeout = (*item, None) if len(item) == 3 else item
                if isinstance(params, dict):
                    params = SamplingParams(**params)
                if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
                    raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
                req = self.engine.make_request(prompt, params, request_id)
                if timeout is not None:
                    req.timeout_s, req.deadline = float(timeout), time.monotonic() + timeout
                with self._cv:
                    if req.request_id in self._live:
                        raise ValueError(f"request id {req.request_id!r} is already in use")
                    self._live.add(req.request_id)
                accepted.append(req)
                errors.append(None)
            except (ValueError, TypeError) as e:
                errors.append(e.with_traceback(None))
        with self._cv:
            if self._stopped:
                return [RuntimeError(self._gone()) for _ in items]
            self._inbox.extend(("add", r) for r in accepted)
            self._cv.notify_all()
        return errors

    def abort(self, request_ids: list[str]) -> None:
        with self._cv:
            self._inbox.extend(("abort", rid) for rid in request_ids)
            self._cv.notify_all()

    def get_outputs(
        self, cursor: int = -1, timeout: float = 1.0, min_batch_s: float = 0.0
    ) -> tuple[int, list[RequestOutput]]:
        """Outputs numbered ``cursor`` and later, and the cursor to pass
        next time. Outputs before ``cursor`` are dropped: delivery is
        acknowledged by asking for what follows, so a poll whose answer was
        lost (a caller gone mid-call) loses nothing. ``cursor=-1`` takes
        whatever is there. Waits up to ``timeout`` for the first output,
        then up to ``min_batch_s`` more so that one call carries several
        steps, until a request's first tokens or its end are waiting: those
        set time to first token and, in a closed loop, when the next request
        starts, so they go at once."""
        deadline = time.monotonic() + timeout
        with self._cv:
            if cursor >= 0:
                drop = min(max(cursor - self._base, 0), len(self._outbox))
                del self._outbox[:drop]
                self._base += drop
            while not self._outbox and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._base, []
                self._cv.wait(left)
            if not self._outbox:
                # Stopped with nothing left to deliver: pollers (a stream's
                # pump, generate_sync) must end, not spin on empty answers.
                raise RuntimeError(self._gone())
            # Batching waits for more steps, but not past one that brings a
            # request's first tokens or its end (a closed-loop client at
            # c=1 waited ~2.5 ms a request for its end when this slept).
            until, seen = time.monotonic() + min_batch_s, 0
            while not self._closed and not any(map(_urgent, self._outbox[seen:])):
                seen = len(self._outbox)
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self._base + len(self._outbox), coalesce(self._outbox)

    def stats(self) -> dict:
        """Steps and their time, free/total blocks of each pool, queue sizes
        (read without stopping the loop: a snapshot, not a transaction)."""
        sched = self.engine.scheduler
        pools = {"target": (sched.target_pool.num_free, sched.target_pool.capacity)}
        if sched.draft_pool is not None:
            pools["drafter"] = (sched.draft_pool.num_free, sched.draft_pool.capacity)
        started = self._step_started
        return {
            "num_steps": self.num_steps,
            "num_async_steps": self.engine.num_async_steps,
            "chain_joins": self.engine.num_chain_joins,  # requests admitted into a running chain
            "prefill_chains": self.engine.num_prefill_chains,  # chains launched from a prefill's device tokens
            "async_wall_s": self.engine.async_wall_s,
            "async_gpu_s": self.engine.async_gpu_s,
            "cycle_costs": {k: list(v) for k, v in self.engine.cycle_costs.items()},
            "step_time_s": self.step_time_s,
            "model_time_s": self.model_time_s,
            "pools": pools,
            "num_unfinished": self.num_unfinished(),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "features": self.features,
            "speculation": self.engine.policy.snapshot() | {"drafter_rest": self.engine.rest.snapshot()}
            if self.engine.policy is not None else None,
            # liveness: how long the step now running has run (0: none runs)
            "step_running_s": 0.0 if started is None else time.monotonic() - started,
            "loop": "failed" if self.failure else ("stopped" if self._closed else "running"),
            "failure": self.failure,
            "drafter": self.faults.drafter.as_dict(),
            "phases": self.phases.totals() if self.phases is not None else None,
        }

    def num_unfinished(self) -> int:
        with self._cv:
            return len(self._live)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        gc.unfreeze()  # the engine's memory may be collected once it is dropped

    # --------------------------------------------------------------- loop
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._close()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _gone(self) -> str:
        if self.failure:
            return f"the engine is unavailable (a worker was lost):\n{self.failure}"
        return "the engine has shut down"

    def _loop(self) -> None:
        engine, faults = self.engine, self.faults
        while True:
            with self._cv:
                while not self._inbox and not engine.has_unfinished() and not self._stopped and \
                        not faults.restart_ready():
                    self._cv.wait()
                if self._stopped:
                    break
                commands, self._inbox = self._inbox, []
            outputs: list[RequestOutput] = []
            for kind, arg in commands:
                if kind == "add":
                    engine.admit(arg)
                else:
                    out = engine.abort_request(arg)
                    if out is not None:
                        outputs.append(out)
            try:
                outputs.extend(faults.expire())
                if engine.has_unfinished():
                    t = self._step_started = time.monotonic()
                    outputs.extend(faults.step())
                    self.step_time_s += time.monotonic() - t
                    self.model_time_s += engine.last_step.propose + engine.last_step.verify
                    self.num_steps += 1
                else:
                    outputs.extend(faults.maintain())
            except GroupLost as e:
                # A rank of the target is gone: no step can run. Its
                # requests fail as the engine's (retry elsewhere); the
                # loop ends, and whoever owns the group rebuilds it.
                with self._cv:
                    self.failure, self._stopped = format_error(e), True
                log.error("the target's process group failed:\n%s", self.failure)
                for out in self._abort_all():
                    out.finish_reason, out.error, out.error_kind = "error", self.failure, "engine"
                    outputs.append(out)
                self._publish(outputs)
                return
            except Exception:
                # Outside any step (bookkeeping): fail what was in flight,
                # keep serving. The traceback travels with the outputs: in a
                # Ray actor the log is not where the caller looks.
                error = traceback.format_exc()
                log.error("engine step failed:\n%s", error)
                for out in self._abort_all():
                    out.finish_reason, out.error, out.error_kind = "error", error, "engine"
                    outputs.append(out)
            finally:
                self._step_started = None
            self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            with self._cv:
                for o in outputs:
                    if o.finished:
                        self._live.discard(o.request_id)
                self._outbox.extend(outputs)
                self._cv.notify_all()

    def _close(self) -> None:
        # Requests still in flight end as aborted, so their streams finish
        # with the tokens they had rather than wait on an engine that is gone.
        aborted = []
        try:
            aborted = self._abort_all()
        except Exception:
            log.error("aborting in-flight requests at shutdown failed:\n%s", traceback.format_exc())
        with self._cv:
            self._stopped = self._closed = True
            self._live.clear()
            self._outbox.extend(aborted)
            self._cv.notify_all()
        self.faults.close()
        if self.phases is not None:
            self.phases.close()
        if self._on_stop is not None:
            try:
                self._on_stop()
            except Exception as e:  # a lost worker cannot be told to stop
                log.warning("stopping the workers failed: %s", str(e).splitlines()[0] if str(e) else repr(e))

    def _abort_all(self) -> list[RequestOutput]:
        """End every request the engine holds; their final outputs."""
        outs = (self.engine.abort_request(rid) for rid in list(self.engine.requests))
        return [o for o in outs if o is not None]


def _urgent(out: RequestOutput) -> bool:
    """A request's end, or its first tokens."""
    return out.finished or len(out.token_ids) == len(out.delta_token_ids)
