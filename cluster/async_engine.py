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
import uuid
from collections.abc import AsyncIterator

from specray.config import EngineConfig
from specray.request import PromptsRefused, RequestOutput
from specray.sampling import SamplingParams


class _LocalCore:
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
        return await asyncio.to_thread(self.submit, items)

    async def aabort(self, ids):
        self.abort(ids)

    async def aget_outputs(self, cursor, timeout):
        return await asyncio.to_thread(self.loop.get_outputs, cursor, timeout)

    def stats(self) -> dict:
        return self.loop.stats()

    def shutdown(self):
        self.loop.stop()


class _RayCore:
    def __init__(self, actors):
        import ray

        self.ray = ray
        self.actors = actors
        self.driver = actors.driver
        self.cursor = -1  # of the blocking callers (generate_sync)

    def submit(self, items):
        return self.ray.get(self.driver.submit.remote(items))

    def abort(self, ids):
        self.ray.get(self.driver.abort.remote(ids))

    def get_outputs(self, cursor, timeout):
        return self.ray.get(self.driver.get_outputs.remote(cursor, timeout))

    def check_workers(self, timeout: float = 0.0) -> None:
        """Raise the error of a follower or drafter whose serve loop ended
        (those loops end only at shutdown): its own traceback, or that it
        died, says more than what rank 0 saw of it."""
        loops = self.actors.loops
        if not loops:
            return
        done, _ = self.ray.wait(loops, num_returns=1, timeout=timeout)
        if done:
            self.ray.get(done[0])
            raise RuntimeError("a worker of the engine stopped serving")

    async def asubmit(self, items):
        return await self.driver.submit.remote(items)

    async def aabort(self, ids):
        await self.driver.abort.remote(ids)

    async def aget_outputs(self, cursor, timeout):
        return await self.driver.get_outputs.remote(cursor, timeout)

    def stats(self) -> dict:
        return self.ray.get(self.driver.stats.remote())

    def shutdown(self):
        self.actors.shutdown()


def make_core(config: EngineConfig, backend: str = "inprocess", tensor_parallel_size: int = 1,
              drafter_placement: str = "auto"):
    if backend == "inprocess":
        from specray.engine_loop import EngineLoop
        from specray.llm import build_engine

        if tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs backend='ray'")
        return _LocalCore(EngineLoop(build_engine(config)))
    if backend == "ray":
        from specray.placement import start_engine_actors

        return _RayCore(start_engine_actors(config, tensor_parallel_size, drafter_placement))
    raise ValueError(f"backend must be 'inprocess' or 'ray', got {backend!r}")


class AsyncEngine:
    def __init__(self, core):
        self.core = core
        self._queues: dict[str, asyncio.Queue] = {}
        self._pump: asyncio.Task | None = None
        self._cursor = -1

    @classmethod
    def from_config(cls, config: EngineConfig, backend: str = "inprocess", tensor_parallel_size: int = 1,
                    drafter_placement: str = "auto") -> "AsyncEngine":
        return cls(make_core(config, backend, tensor_parallel_size, drafter_placement))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput each time the request gains tokens (with
        ``delta_text`` / ``delta_token_ids``), the last one ``finished``.
        Closing the iterator early (a client gone) aborts the request."""
        rid = request_id or uuid.uuid4().hex
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            err = (await self.core.asubmit([(prompt, params or SamplingParams(), rid)]))[0]
            if err is not None:
                finished = True
                raise err
            self._ensure_pump()
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
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

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            # A fresh context: the pump serves every request, it must not
            # die with the one that happened to start it.
            self._pump = asyncio.get_running_loop().create_task(
                self._pump_outputs(), context=contextvars.Context()
            )

    async def _pump_outputs(self) -> None:
        while self._queues:
            try:
                self._cursor, outs = await self.core.aget_outputs(self._cursor, 0.5)
            except Exception as e:  # the engine died: fail every stream
                for q in self._queues.values():
                    q.put_nowait(RuntimeError(f"engine failure: {e}"))
                return
            for o in outs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)

    def shutdown(self) -> None:
        self.core.shutdown()


def generate_sync(core, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
    """Blocking batch generation through a core (in-process or Ray)."""
    ids = [uuid.uuid4().hex for _ in prompts]
    errors = core.submit(list(zip(prompts, params, ids)))
    dead = next((e for e in errors if isinstance(e, RuntimeError)), None)
    if dead is not None:
        raise dead
    bad = [(i, str(e)) for i, e in enumerate(errors) if e is not None]
    if bad:
        core.abort([ids[i] for i, e in enumerate(errors) if e is None])
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
                    if o.finish_reason == "error":
                        # What made the step fail, if a worker did (a moment
                        # for its failure to be recorded), else the step's.
                        core.check_workers(timeout=2.0)
                        raise RuntimeError(f"the engine failed a step of this generate call:\n{o.error}")
                    done[o.request_id] = o
    except BaseException:  # interrupted or failed: the engine must not keep generating them
        core.abort([i for i in ids if i not in done])
        raise
    return [done[i] for i in ids]
