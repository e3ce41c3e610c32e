"""AsyncEngine: stream outputs as tokens are accepted, abort by id.

The same front drives an EngineLoop in this process (``backend="inprocess"``)
or the one inside target rank 0 of a Ray deployment (``backend="ray"``).
Requests go in through ``submit``; one background task long-polls
``get_outputs`` and routes each output to its request's queue, so one call
carries the outputs of many steps.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import AsyncIterator

from specray.config import ConfigError, EngineConfig
from specray.engine_channel import ChannelBroken, ReplicaChannel
from specray.faults import EngineUnavailable
from specray.output_wire import OutputUnpacker
from specray.request import PromptsRefused, RequestOutput, take_queued
from specray.sampling import SamplingParams


class _LocalCore:
    epoch = 0  # an in-process engine is never rebuilt

    def __init__(self, loop):
        self.loop = loop
        self.cursor = -1  # of the blocking callers (generate_sync)

    def submit(self, items):
        return self.loop.submit(items)

    def abort(self, ids):
        self.loop.abort(ids)

    def get_outputs(self, cursor, timeout):
        return self.loop.get_outputs(cursor, timeout)

    def check_workers(self, timeout: float = 0.0) -> None:
        pass  # no worker runs apart from the loop

    async def asubmit(self, items):
        # Off the event loop: submitting tokenizes (long prompts take seconds).
        return 0, await asyncio.to_thread(self.submit, items)

    async def aabort(self, ids):
        self.abort(ids)

    async def aget_outputs(self, epoch, cursor, timeout):
        return (0, *await asyncio.to_thread(self.loop.get_outputs, cursor, timeout))

    def stats(self) -> dict:
        return self.loop.stats()

    def health(self) -> dict:
        return {"engine": "ok", "rebuilds": 0, **self.loop.stats()}

    def shutdown(self):
        self.loop.stop()


class _RayCore:
    """The front of a Ray engine; rebuilds its actor group when a target
    rank is lost (``group.EngineGroup``)."""

    def __init__(self, actors, start=None):
        import ray
        from ray.exceptions import RayActorError

        from specray.group import EngineGroup

        self.ray = ray
        self._dead = (RayActorError,)
        self.group = EngineGroup(actors, start)
        self.cursor = -1  # of the blocking callers (generate_sync), in epoch _sync_epoch
        self._sync_epoch = 0
        self._unpackers: dict[str, tuple[int, OutputUnpacker]] = {}  # by caller: (epoch, its unpacker)
        self.channel = ReplicaChannel()  # the streams' socket to rank 0, where it shares the node

    def _unpack(self, caller: str, epoch: int, data: bytes) -> list[RequestOutput]:
        """Rank 0's packed outputs (``output_wire``), rebuilt against what
        this caller applied before, in this epoch of the group."""
        held = self._unpackers.get(caller)
        if held is None or held[0] != epoch:
            held = self._unpackers[caller] = (epoch, OutputUnpacker())
        return held[1].unpack(data)

    @property
    def actors(self):
        return self.group.actors

    @property
    def driver(self):
        return self.group.actors.driver

    @property
    def epoch(self) -> int:
        return self.group.epoch

    def _lost(self, epoch: int, e: BaseException):
        """Record the loss of ``epoch``'s group (it is rebuilt) and the
        error its callers get."""
        from specray.group import EngineLost

        reason = f"{type(e).__name__}: {e}"
        self.group.lost(epoch, reason)
        return EngineLost(epoch, f"the engine lost a worker and is being rebuilt ({reason})")

    @staticmethod
    def _unavailable(errors) -> bool:
        """Rank 0's loop ended on a lost worker (not shut down on purpose)."""
        return bool(errors) and any(isinstance(e, RuntimeError) and "unavailable" in str(e) for e in errors)

    def submit(self, items):
        for _ in range(2):
            epoch, actors = self.group.current()
            try:
                errors = self.ray.get(actors.driver.submit.remote(items))
            except self._dead as e:
                self._lost(epoch, e)
                continue
            if self._unavailable(errors):
                self._lost(epoch, errors[0])
                continue
            if epoch != self._sync_epoch:
                self.cursor, self._sync_epoch = -1, epoch
            return errors
        raise EngineUnavailable("the engine lost a worker twice while taking requests")

    def abort(self, ids):
        if self.group.state != "ok":
            return  # a lost group holds them no more
        epoch, actors = self.group.epoch, self.group.actors
        try:
            self.ray.get(actors.driver.abort.remote(ids))
        except self._dead as e:
            self._lost(epoch, e)

    def get_outputs(self, cursor, timeout):
        epoch = self._sync_epoch
        if self.group.epoch != epoch or self.group.state != "ok":
            from specray.group import EngineLost

            raise EngineLost(epoch, "the engine lost a worker; its requests ended")
        try:
            cursor, data = self.ray.get(self.group.actors.driver.get_outputs.remote(cursor, timeout))
            return cursor, self._unpack("sync", epoch, data)
        except self._dead as e:
            raise self._lost(epoch, e) from None
        except self.ray.exceptions.RayTaskError as e:
            if self.group.state == "closed" or "unavailable" not in str(e):
                raise
            raise self._lost(epoch, e) from None

    def check_workers(self, timeout: float = 0.0) -> None:
        """Raise the error of a follower whose serve loop ended (those loops
        end only at shutdown, or when the follower is lost): its own
        traceback, or that it died, says more than what rank 0 saw of it.
        A lost drafter is rank 0's to replace."""
        epoch, actors = self.group.epoch, self.group.actors
        loops = actors.loops[: len(actors.ranks) - 1]
        if not loops or self.group.state != "ok":
            return
        done, _ = self.ray.wait(loops, num_returns=1, timeout=timeout)
        if done:
            try:
                self.ray.get(done[0])
            except Exception as e:
                self._lost(epoch, e)
                raise
            self._lost(epoch, RuntimeError("a worker of the engine stopped serving"))
            raise RuntimeError("a worker of the engine stopped serving")

    async def asubmit(self, items):
        for _ in range(2):
            epoch, actors = await self.group.acurrent()
            try:
                channel = await self.channel.get(epoch, actors.driver)
                errors = await (channel.submit(items) if channel else actors.driver.submit.remote(items))
            except (*self._dead, ChannelBroken) as e:
                self._lost(epoch, e)
                continue
            if self._unavailable(errors):
                self._lost(epoch, errors[0])
                continue
            return epoch, errors
        raise EngineUnavailable("the engine lost a worker twice while taking requests")

    async def aabort(self, ids):
        actors, channel = self.group.actors, self.channel.current(self.group.epoch)
        try:
            if channel is not None:
                return channel.abort(ids)
            await actors.driver.abort.remote(ids)
        except self._dead:
            pass  # its requests are gone with it
        except Exception:
            if self.group.state == "ok":
                raise  # a lost group's requests are gone with it

    async def aget_outputs(self, epoch, cursor, timeout):
        """``epoch`` None: the live group's (after a rebuild, if one runs)."""
        from specray.group import EngineLost

        live, actors = await self.group.acurrent()
        if epoch is not None and epoch != live:
            raise EngineLost(epoch, "the engine lost a worker; its requests ended")
        try:
            channel = await self.channel.get(live, actors.driver)
            if channel is None:
                cursor, data = await actors.driver.get_outputs.remote(cursor, timeout)
            else:  # pushed as rank 0's loop gives them: the cursor is rank 0's writer's
                data = await channel.outputs(timeout)
                if data is None:
                    return live, cursor, []
        except (*self._dead, ChannelBroken) as e:
            # a broken channel is rank 0's process gone: what it had sent is not asked for again
            raise self._lost(live, e) from None
        except (self.ray.exceptions.RayTaskError, RuntimeError) as e:
            if self.group.state == "closed" or "unavailable" not in str(e):
                raise
            raise self._lost(live, e) from None
        return live, cursor, self._unpack("async", live, data)

    def stats(self) -> dict:
        epoch, actors = self.group.current()
        try:
            return self.ray.get(actors.driver.stats.remote())
        except self._dead as e:
            raise self._lost(epoch, e) from None

    def health(self, timeout: float = 10.0) -> dict:
        """The group's state and rank 0's loop stats (liveness, drafter);
        a lost worker found here starts the rebuild."""
        g = self.group
        base = {"engine": g.state, "rebuilds": g.rebuilds, "failure": g.failure, "epoch": g.epoch,
                "rebuilding_s": time.monotonic() - g.lost_at if g.state == "rebuilding" else 0.0}
        if g.state != "ok":
            return base
        epoch, actors = g.epoch, g.actors
        try:
            self.check_workers()  # a follower found gone is recorded there
            stats = self.ray.get(actors.driver.stats.remote(), timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            return {**base, "engine": "unresponsive"}
        except self._dead as e:
            self._lost(epoch, e)
            return {**base, "engine": g.state, "failure": g.failure}
        except Exception:
            if g.state == "ok":
                raise
            return {**base, "engine": g.state, "failure": g.failure}
        if stats.get("loop") == "failed":
            self._lost(epoch, RuntimeError(stats.get("failure") or "rank 0's step loop failed"))
            return {**base, **stats, "engine": g.state}
        return {**base, **stats}

    def shutdown(self):
        self.channel.close()
        self.group.close().shutdown()


def make_core(config: EngineConfig, backend: str = "inprocess", tensor_parallel_size: int = 1,
              drafter_placement: str = "auto", shared_drafter=None):
    """``shared_drafter``: a ``shared_drafter.DrafterShare`` (Ray backend):
    the engine's drafter is an actor serving other replicas too."""
    if shared_drafter is not None and backend != "ray":
        raise ConfigError("shared_drafter needs backend='ray'")
    if backend == "inprocess":
        from specray.engine_loop import EngineLoop
        from specray.llm import build_engine

        if tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs backend='ray'")
        from specray.actors.drafter_restart import local_drafter_restart

        engine = build_engine(config)
        restart = local_drafter_restart(engine) if engine.drafter is not None else None
        return _LocalCore(EngineLoop(engine, restart_drafter=restart, restart_inline=True))
    if backend == "ray":
        from specray.placement import start_engine_actors

        def start():
            return start_engine_actors(config, tensor_parallel_size, drafter_placement,
                                       shared_drafter=shared_drafter)

        return _RayCore(start(), start)
    raise ValueError(f"backend must be 'inprocess' or 'ray', got {backend!r}")


class AsyncEngine:
    def __init__(self, core):
        self.core = core
        self._queues: dict[str, asyncio.Queue] = {}
        self._epochs: dict[str, int] = {}  # the engine group each request runs in
        self._pump: asyncio.Task | None = None
        self._epoch: int | None = None  # the pump's cursor's group
        self._cursor = -1

    @classmethod
    def from_config(cls, config: EngineConfig, backend: str = "inprocess", tensor_parallel_size: int = 1,
                    drafter_placement: str = "auto", shared_drafter=None) -> "AsyncEngine":
        return cls(make_core(config, backend, tensor_parallel_size, drafter_placement, shared_drafter))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time the request gains tokens (with
        ``delta_text`` / ``delta_token_ids``), the last one ``finished``.
        Closing the iterator early (a client gone) aborts the request.
        ``timeout``: seconds the request may take; the engine then ends it
        with an error (kind "timeout"), and should the engine not answer,
        ``RequestTimeout`` is raised a moment later."""
        rid = request_id or uuid.uuid4().hex
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        deadline = None if timeout is None else time.monotonic() + timeout + _TIMEOUT_GRACE_S
        try:
            item = (prompt, params or SamplingParams(), rid) + ((timeout,) if timeout is not None else ())
            # The output pump polls while the request is submitted: a pump
            # started after the submit's answer (an idle engine's first
            # request) added its own start and a poll's trip to the first token.
            self._ensure_pump()
            epoch, errors = await self.core.asubmit([item])
            err = errors[0]
            if err is not None:
                finished = True
                raise err
            self._epochs[rid] = epoch
            held = None  # an error met while taking queued outputs: the next item
            while True:
                try:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    out = held if held is not None else await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    raise RequestTimeout(f"the request did not finish within its timeout of {timeout:g} s") from None
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                out, held = take_queued(out, queue)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self._epochs.pop(rid, None)
            if not finished:
                await self._detached(self.core.aabort([rid]))

    async def abort(self, request_id: str) -> None:
        await self._detached(self.core.aabort([request_id]))

    @staticmethod
    def _detached(coro):
        """Run ``coro`` in a task with a fresh context and shield it: under
        Ray Serve a request's context makes every actor call a child of the
        request, cancelled with it, and an abort must survive exactly that."""
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        return asyncio.shield(task)

    def stats(self) -> dict:
        return self.core.stats()

    def health(self) -> dict:
        return self.core.health()

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            # A fresh context: the pump serves every request, it must not
            # die with the one that happened to start it.
            self._pump = asyncio.get_running_loop().create_task(
                self._pump_outputs(), context=contextvars.Context()
            )

    async def _pump_outputs(self) -> None:
        from specray.group import EngineLost

        while self._queues:
            try:
                self._epoch, self._cursor, outs = await self.core.aget_outputs(self._epoch, self._cursor, 0.5)
            except EngineLost as e:
                # That group is gone, and its requests with it; the others
                # (sent to the group that replaces it) go on.
                for rid, q in list(self._queues.items()):
                    if self._epochs.get(rid, e.epoch) <= e.epoch:
                        q.put_nowait(e)
                self._epoch, self._cursor = None, -1
                continue
            except Exception as e:  # the engine died: fail every stream
                err = e if isinstance(e, EngineUnavailable) else RuntimeError(f"engine failure: {e}")
                for q in self._queues.values():
                    q.put_nowait(err)
                return
            for o in outs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)

    def shutdown(self) -> None:
        self.core.shutdown()


class RequestTimeout(RuntimeError):
    """A request's timeout passed without the engine ending it."""


# How long past a request's timeout the front waits for the engine's own
# timeout error before giving up on it.
_TIMEOUT_GRACE_S = 5.0


def generate_sync(core, prompts: list, params: list[SamplingParams], errors: str = "raise") -> list[RequestOutput]:
    """Blocking batch generation through a core (in-process or Ray).
    ``errors="return"``: a request that failed alone comes back with
    ``finish_reason="error"`` instead of raising (the others still ran);
    a lost engine raises ``EngineUnavailable`` either way."""
    ids = [uuid.uuid4().hex for _ in prompts]
    refused = core.submit(list(zip(prompts, params, ids)))
    dead = next((e for e in refused if isinstance(e, RuntimeError)), None)
    if dead is not None:
        raise dead
    bad = [(i, str(e)) for i, e in enumerate(refused) if e is not None]
    if bad:
        core.abort([ids[i] for i, e in enumerate(refused) if e is None])
        raise PromptsRefused(bad)
    wanted = set(ids)
    done: dict[str, RequestOutput] = {}
    try:
        while len(done) < len(ids):
            core.cursor, outs = core.get_outputs(core.cursor, 1.0)
            if not outs:  # a quiet second: a failed worker may have left rank 0 waiting on it
                core.check_workers()
            for o in outs:
                if o.finished and o.request_id in wanted:
                    if o.finish_reason == "error" and (errors == "raise" or o.error_kind == "engine"):
                        # What made the step fail, if a worker did (a moment
                        # for its failure to be recorded), else the step's.
                        kind = EngineUnavailable if o.error_kind == "engine" else RuntimeError
                        try:
                            core.check_workers(timeout=2.0)
                        except Exception as e:
                            raise kind(f"a worker of the engine failed under this generate call:\n{e}") from e
                        raise kind(f"the engine failed a step of this generate call:\n{o.error}")
                    done[o.request_id] = o
    except BaseException:  # interrupted or failed: the engine must not keep generating them
        try:
            core.abort([i for i in ids if i not in done])
        except Exception:
            pass  # a lost engine holds them no more
        raise
    return [done[i] for i in ids]
