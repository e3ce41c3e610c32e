"""Surviving faults inside one engine (the step loop's side; the Ray front's
rebuild of a lost target group is ``group.py``).

* **Drafter loss.** The drafter sits behind ``GuardedDrafter``: a propose
  that fails (a dead process, a channel timeout, an exception) raises
  ``DrafterLost`` before the step has changed anything, a failed context
  store is recorded and swallowed; inside a step graph the drafter's parts
  raise ``DrafterLost`` too (``drafter_part``). ``FaultHandler`` then
  steps without a drafter (verify blocks of one row: autoregressive
  steps, whose tokens are the target's as a speculative step's are),
  starts a new drafter (``restart``), and once it is up re-seeds its
  context KV with the tapped hidden states of every computed position of
  the running requests (a target forward over their tokens whose K/V
  writes go to the reserved slot 0: the target's own cache keeps the bits
  its decode steps wrote), into the slots the scheduler's
  ``draft_blocks`` already name.
* **One bad request.** An exception in a request's own host code (append,
  detokenize, stop strings) fails that request in ``EngineCore._apply``
  (``fail_request``). Any other exception of a step (and non-finite
  logits) is retried on halves of the running requests, the rest set
  aside, down to the one request whose step fails again: it fails alone,
  the others advanced in the retried steps. A failure of the target's
  process group (a TP rank gone) is ``GroupLost``: no request caused it.
* **Deadlines.** A request past its deadline fails with kind "timeout".
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specray.actors.kv_cache import block_table_tensor
from specray.plan import AttentionMetadata, TargetBatch
from specray.request import RequestMetrics, RequestOutput, Status

log = logging.getLogger("specray.faults")


class EngineUnavailable(RuntimeError):
    """The engine cannot serve this request now (a lost worker, a rebuild
    in progress or failed): retry later or elsewhere (HTTP 503, gRPC
    UNAVAILABLE)."""


class DrafterLost(RuntimeError):
    """The drafter failed or stopped answering; the step changed nothing."""


class GroupLost(RuntimeError):
    """The target's process group failed (a rank died or left)."""


class NonFiniteLogits(RuntimeError):
    """The target's logits hold NaN or infinity."""


@contextmanager
def drafter_part(what: str):
    """The drafter's part of a step graph (its propose, its context store,
    the exchange with a drafter in another process): a failure there is the
    drafter's loss, which the step survives without it, not a failed step,
    which would be retried on halves of the batch (and, the drafter failing
    again in each, fail every request)."""
    try:
        yield
    except DrafterLost:
        raise
    except Exception as e:
        raise DrafterLost(f"the drafter failed in {what}: {e}") from e


def is_group_failure(e: BaseException) -> bool:
    """Errors of torch.distributed (a collective whose peer is gone), as
    opposed to errors of a request or of this process's own code."""
    import torch.distributed as dist

    if isinstance(e, DrafterLost):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                            "NCCL error", "ProcessGroupNCCL", "ProcessGroupGloo"))


def format_error(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def fail_request(engine, r, error: str, kind: str = "request") -> RequestOutput:
    """End ``r`` alone with ``finish_reason="error"`` (its blocks freed) and
    return its final output; ``kind``: "request" (its own failure),
    "timeout" (its deadline), "engine" (the engine failed under it)."""
    if not r.finished:
        engine.scheduler.finish(r, "error")
    r.finish_reason = "error"
    r.metrics.finished_time = time.monotonic()
    engine.requests.pop(r.request_id, None)
    try:
        out = engine._output(r)
    except Exception:  # the request's own state is what broke
        out = RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, "", list(r.output_token_ids), True, "error",
                            r.metrics if isinstance(r.metrics, RequestMetrics) else RequestMetrics())
    out.finished, out.finish_reason, out.error, out.error_kind = True, "error", error, kind
    return out


# ---------------------------------------------------------------- workers
class GuardedDrafter:
    """A drafter whose failures become ``DrafterLost`` (propose) or a mark
    (store_context); everything else is the drafter's own."""

    _GUARDED = ("propose", "store_context")

    def __init__(self, inner):
        self.__dict__.update(inner=inner, lost=None, _patches={}, _inside=False)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name, value):
        # The engine sets the drafter's draft-tree universe; callers (tests,
        # benches) patch the guarded methods they see, and the patch runs
        # inside the guard in place of the drafter's own method.
        if name in ("inner", "lost"):
            self.__dict__[name] = value
        elif name in self._GUARDED:
            self._patches[name] = value
        else:
            setattr(self.inner, name, value)

    def __delattr__(self, name):  # a patch undone
        if name in self._GUARDED:
            self._patches.pop(name, None)
        else:
            delattr(self.inner, name)

    def _call(self, name: str, *args):
        if self._inside:
            # A patch that wraps the method it saw (the guard's) calls back in.
            return getattr(self.inner, name)(*args)
        self.__dict__["_inside"] = True
        try:
            return self._patches.get(name, getattr(self.inner, name))(*args)
        finally:
            self.__dict__["_inside"] = False

    def propose(self, batch):
        if self.lost is not None:
            raise DrafterLost(self.lost)
        try:
            return self._call("propose", batch)
        except Exception as e:
            self.lost = format_error(e)
            raise DrafterLost(f"the drafter failed in propose: {e}") from e

    def store_context(self, hidden, positions, slots) -> None:
        if self.lost is not None:
            return
        try:
            self._call("store_context", hidden, positions, slots)
        except Exception as e:
            self.lost = format_error(e)


class GuardedTarget:
    """The target, its logits checked for NaN / infinity (``check_logits``),
    with the test hooks of ``fault_injection`` in front (``before``,
    ``after``)."""

    def __init__(self, inner, check_logits: bool, before=None, after=None):
        self.__dict__.update(inner=inner, check_logits=check_logits, before=before, after=after, _run=inner.execute)

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name, value):
        # Callers (tests, benches) patch the target they see: the patch
        # belongs to the model's forward, which the checks stay around.
        if name == "execute":
            self.__dict__["_run"] = self.inner.execute if getattr(value, "__self__", None) is self else value
        else:
            setattr(self.inner, name, value)

    def __delattr__(self, name):  # a patch undone
        if name == "execute":
            self.__dict__["_run"] = self.inner.execute
        else:
            delattr(self.inner, name)

    @property
    def worker(self):
        """What the step graphs run: the model's own worker."""
        return getattr(self.inner, "worker", self.inner)

    def execute(self, batch):
        if self.__dict__.get("_inside"):
            # A patch that wraps the execute it saw (this one) calls back in.
            return self.inner.execute(batch)
        self.__dict__["_inside"] = True
        try:
            logits = self._checked(batch)
        finally:
            self.__dict__["_inside"] = False
        return logits

    def _checked(self, batch):
        if self.before is not None:
            self.before(batch)
        logits = self._run(batch)
        if self.after is not None and logits is not None:
            logits = self.after(logits)
        if self.check_logits and logits is not None and logits.numel() and not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits("the target's logits hold NaN or infinity")
        return logits


# -------------------------------------------------------------- re-seeding
def reseed(engine, drafter) -> int:
    """Store the context of every computed position of the running requests
    into ``drafter`` (a new one: its cache holds nothing yet); returns the
    positions stored. The target re-runs their tokens with every K/V write
    pointed at the reserved slot 0; attention reads the cache, which holds
    what the decode steps wrote."""
    target = getattr(engine.target, "inner", engine.target)
    budget = max(1, engine.config.max_num_batched_tokens)
    pieces = []  # (request, start, end)
    for r in engine.scheduler.running:
        n = min(r.num_computed, r.num_tokens)
        for a in range(0, n, budget):
            pieces.append((r, a, min(n, a + budget)))
    total = 0
    while pieces:
        batch, rows = [], 0
        while pieces and (not batch or rows + pieces[0][2] - pieces[0][1] <= budget):
            r, a, b = pieces.pop(0)
            batch.append((r, a, b))
            rows += b - a
        ids, positions, starts, seq_lens, tables, slots = [], [], [0], [], [], []
        for r, a, b in batch:
            ids.extend(r.all_token_ids[a:b])
            positions.extend(range(a, b))
            starts.append(len(ids))
            seq_lens.append(b)
            tables.append(r.target_blocks.blocks)
            slots.extend(r.draft_blocks.slots(a, b))
        n = len(ids)
        attn = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.zeros(n, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=block_table_tensor(tables),
            max_query_len=max(b - a for _, a, b in batch),
            max_seq_len=max(seq_lens),
        )
        target.execute(TargetBatch(torch.tensor(ids, dtype=torch.int64), attn,
                                   torch.tensor([n - 1], dtype=torch.int64), want_hidden=True))
        drafter.store_context(target.hidden_rows(None), attn.positions, torch.tensor(slots, dtype=torch.int64))
        total += n
    return total


# ------------------------------------------------------- drafter lifecycle
@dataclass
class DrafterState:
    """What /health and the metrics say of the drafter."""

    state: str = "up"  # up | down (autoregressive steps, a new drafter on its way) | failed (given up) | none
    losses: int = 0
    restarts: int = 0
    reseeded: int = 0  # positions whose context the last new drafter was given
    since: float = field(default_factory=time.monotonic)
    error: str | None = None

    def as_dict(self) -> dict:
        return {"state": self.state, "losses": self.losses, "restarts": self.restarts, "reseeded": self.reseeded,
                "for_s": round(time.monotonic() - self.since, 3), "error": self.error}


class FaultHandler:
    """Steps an EngineCore through drafter losses and bad requests.

    ``restart``: a callable returning a new drafter (its cache allocated,
    its channel connected), or None where none can be made. It runs in a
    thread of its own unless ``restart_inline`` (a drafter in this process:
    built between steps, not beside them). ``wake`` is called when a new
    drafter is ready to install. At most ``max_restarts`` losses are
    restarted within ``restart_window_s``; then steps stay autoregressive."""

    def __init__(self, engine, restart=None, restart_inline: bool = False, wake=None, max_restarts: int = 5,
                 restart_window_s: float = 600.0, check_logits: bool | None = None):
        from specray.fault_injection import hooks

        self.engine = engine
        self.restart, self.restart_inline, self.wake = restart, restart_inline, wake
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.drafter = DrafterState("up" if engine.drafter is not None else "none")
        self._loss_times: deque[float] = deque()
        self._pending = None  # a restart: {"thread", "result", "error"}
        if engine.drafter is not None and not isinstance(engine.drafter, GuardedDrafter):
            engine.drafter = GuardedDrafter(engine.drafter)
        before, after = hooks(engine)
        if check_logits is None:
            check_logits = engine.config.check_logits
        if check_logits is None:
            check_logits = engine.device.type == "cpu"  # on a GPU it would cost a sync a step
        if check_logits or before or after:
            engine.target = GuardedTarget(engine.target, check_logits, before, after)
        self._async = engine.config.async_scheduling

    # ------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """One engine step; raises ``GroupLost`` only."""
        outputs = self.maintain()
        try:
            outputs += self._step()
        except GroupLost:
            raise
        except Exception as e:
            outputs += self._isolate(e)
        return outputs

    def _step(self) -> list[RequestOutput]:
        engine = self.engine
        try:
            try:
                outputs = engine.step()
            except DrafterLost as e:
                self._lose(str(e.__cause__ or e))
                outputs = engine.step()
        except Exception as e:
            if is_group_failure(e):
                raise GroupLost(str(e)) from e
            raise
        guard = engine.drafter
        if isinstance(guard, GuardedDrafter) and guard.lost is not None:
            self._lose(guard.lost)  # its context store failed: this step's tokens stand
        return outputs

    def _isolate(self, exc: Exception) -> list[RequestOutput]:
        """Retry the failed step on halves of the running requests until the
        one whose step fails again is found; it fails alone."""
        engine = self.engine
        engine._inflight = None  # its rows are recomputed by the retried steps
        suspects = list(engine.scheduler.running)
        log.warning("engine step failed; isolating the request among %d:\n%s", len(suspects), format_error(exc))
        if not suspects:
            raise exc
        outputs: list[RequestOutput] = []
        while len(suspects) > 1:
            half, rest = suspects[: len(suspects) // 2], suspects[len(suspects) // 2:]
            try:
                outputs += self._step_only(half)
                suspects = [r for r in rest if r.status == Status.RUNNING]
            except GroupLost:
                raise
            except Exception:
                suspects = half
        for r in suspects:
            if r.status != Status.RUNNING:
                continue
            try:
                outputs += self._step_only([r])
            except GroupLost:
                raise
            except Exception as e:
                error = format_error(e)
                log.error("request %s failed alone:\n%s", r.request_id, error)
                outputs.append(fail_request(engine, r, f"the engine failed a step of this request:\n{error}"))
        return outputs

    def _step_only(self, subset: list) -> list[RequestOutput]:
        """A step of ``subset`` alone: the other requests wait aside."""
        sched = self.engine.scheduler
        keep = {id(r) for r in subset}
        order = list(sched.running)
        parked_waiting = list(sched.waiting)
        sched.running = [r for r in order if id(r) in keep]
        sched.waiting = deque()
        try:
            return self._step()
        finally:
            extra = [r for r in sched.running if r not in order]
            sched.running = [r for r in order if r.status == Status.RUNNING] + extra
            sched.waiting = deque(list(sched.waiting) + parked_waiting)

    # ----------------------------------------------------- the drafter's life
    def _lose(self, error: str, drafter=None) -> None:
        """Step without the drafter (``drafter``: a new one not installed
        yet) from now on, and start a new one."""
        from specray.step_wait import abort_lost_drafter

        engine = self.engine
        log.error("drafter lost; decoding without it until a new one is up:\n%s", error)
        # Its NCCL exchanges still queued would hold the stream forever.
        abort_lost_drafter(engine, engine.drafter if drafter is None else drafter)
        self.drafter.losses += 1
        self.drafter.error = error
        self.drafter.since = time.monotonic()
        engine.drafter = None
        engine._inflight = None
        engine._step_graphs.clear()  # they hold the lost drafter
        engine.forget_step_graph_state()  # what the host knew of their buffers
        engine.scheduler.block_size = 1
        engine.config.async_scheduling = False  # step graphs need a drafter in this process
        now = time.monotonic()
        self._loss_times.append(now)
        while self._loss_times and now - self._loss_times[0] > self.restart_window_s:
            self._loss_times.popleft()
        if self.restart is None or len(self._loss_times) > self.max_restarts:
            self.drafter.state = "failed"
            log.error("no new drafter will be started (%d losses within %.0f s)", len(self._loss_times),
                      self.restart_window_s)
            return
        self.drafter.state = "down"
        self._start_restart()

    def _start_restart(self) -> None:
        box = {"result": None, "error": None}

        def run():
            try:
                box["result"] = self.restart()
            except BaseException as e:
                box["error"] = format_error(e)
            if self.wake is not None:
                self.wake()

        if self.restart_inline:
            box["thread"] = None
            run()
        else:
            box["thread"] = threading.Thread(target=run, name="specray-drafter-restart", daemon=True)
            box["thread"].start()
        self._pending = box

    def restart_ready(self) -> bool:
        p = self._pending
        return p is not None and (p["thread"] is None or not p["thread"].is_alive())

    def maintain(self) -> list[RequestOutput]:
        """Between steps: install a new drafter that is ready."""
        if not self.restart_ready():
            return []
        box, self._pending = self._pending, None
        if box["error"] is not None:
            self._lose(f"starting a new drafter failed:\n{box['error']}")
            return []
        engine, guard = self.engine, GuardedDrafter(box["result"])
        t = time.monotonic()
        try:
            n = reseed(engine, guard)  # the new drafter's failures are the guard's mark
        except Exception as e:
            if is_group_failure(e):
                raise GroupLost(str(e)) from e
            self._lose(f"re-seeding the new drafter failed:\n{format_error(e)}", guard)
            return []
        if guard.lost is not None:
            self._lose(f"the new drafter failed while re-seeded:\n{guard.lost}", guard)
            return []
        if engine.tree is not None:
            guard.tree = engine.tree
        engine.drafter = guard
        engine.scheduler.block_size = engine.block_size
        engine.config.async_scheduling = self._async
        self.drafter.state, self.drafter.since = "up", time.monotonic()
        self.drafter.restarts += 1
        self.drafter.reseeded = n
        log.warning("a new drafter is up: %d positions of %d requests re-seeded in %.2f s", n,
                    len(engine.scheduler.running), time.monotonic() - t)
        return []

    def close(self) -> None:
        """The engine stops: a drafter still starting is not waited for."""
        self._pending = None

    # ----------------------------------------------------------- deadlines
    def expire(self, now: float | None = None) -> list[RequestOutput]:
        """Fail the requests whose deadline passed."""
        now = time.monotonic() if now is None else now
        late = [r for r in self.engine.requests.values() if r.deadline is not None and now >= r.deadline]
        return [fail_request(self.engine, r, f"the request did not finish within its timeout of "
                                              f"{r.timeout_s:g} s", kind="timeout") for r in late]
