"""The lifetime of one admitted generation request in the Serve replica.

Disconnects: when a client goes, Serve's proxy cancels the request in the
replica (Starlette's own disconnect listener may get there first). The
engine stream is never consumed inside that request's task: a detached task
drives it into a queue, so neither the anyio cancel scope nor Ray's
recursive cancellation of the request's child calls can swallow the abort.
However the request ends (finished, error, client gone before or after its
first byte) the response's ``finally`` releases its lease: an explicit
``engine.abort`` if the stream still runs (the engine frees its KV blocks),
then the admission slot.
"""

import asyncio
import logging

from starlette.responses import StreamingResponse

from specray.request import take_queued

log = logging.getLogger("specray.serve")


class Lease:
    """One admitted generation request: its slot in the replica's bound and
    the task that drives its engine stream.

    The engine stream is consumed by a task of its own, never by the
    request's task: Serve and Starlette cancel the request's task when the
    client goes (Starlette through an anyio cancel scope, which re-cancels
    every await inside it), and an engine stream closed inside that
    cancellation would await its abort RPC cancelled (Ray then cancels the
    abort task itself). The request's task only reads a queue.

    ``release`` is idempotent and runs however the request ends (finished,
    failed, client gone before or after its first byte): it aborts the
    engine request if still running, waits for the driver task, and frees
    the slot."""

    def __init__(self, server, endpoint: str, reports: bool = True):
        self.server, self.endpoint = server, endpoint
        self.reports = reports  # counts the request in the metrics (one lease of a request's n)
        self.rid: str | None = None
        self.task: asyncio.Task | None = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self._held: BaseException | None = None  # an error met while taking queued outputs
        # until the request completes: the client went away
        self.status: int | str = "CANCELLED" if endpoint.startswith("grpc") else 499
        self._released = False

    def start(self, prompt, params, rid: str, timeout: float | None = None) -> None:
        self.rid = rid
        self.task = asyncio.get_running_loop().create_task(detached(self._drive(prompt, params, rid, timeout)))

    async def _drive(self, prompt, params, rid: str, timeout: float | None) -> None:
        try:
            async for out in self.server.engine.generate(prompt, params, request_id=rid, timeout=timeout):
                self.queue.put_nowait(out)
        except BaseException as e:  # a bad prompt (ValueError), a failed engine, cancellation
            self.queue.put_nowait(e)
            if not isinstance(e, Exception):
                raise

    async def next(self):
        """The request's next RequestOutput (those already queued as one);
        raises what the engine raised."""
        item, self._held = (self._held, None) if self._held is not None else (await self.queue.get(), None)
        if isinstance(item, BaseException):
            raise item
        item, self._held = take_queued(item, self.queue)
        return item

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self.task is not None and not self.task.done():
                try:
                    await self.server.engine.abort(self.rid)  # the engine ends the stream with "abort"
                except Exception:
                    log.warning("abort of %s failed", self.rid, exc_info=True)
                done, _ = await asyncio.wait([self.task], timeout=5.0)
                if not done:  # abort raced ahead of the submit: closing the stream aborts again
                    self.task.cancel()
                    await asyncio.wait([self.task], timeout=5.0)
        finally:
            self.server._release(self)


async def release_all(leases: list[Lease]) -> None:
    """Release a request's leases (its choices) together."""
    await asyncio.gather(*(lease.release() for lease in leases))


def set_status(leases: list[Lease], status) -> None:
    for lease in leases:
        lease.status = status


def detach_from_request() -> None:
    """Forget which Serve request this task runs for.

    A Ray async actor keeps the current request's Ray task id in a context
    variable that every task created under it inherits, and Ray files each
    actor call made under that id as a child of the request: when Serve
    cancels the request (the client left), Ray cancels those calls too
    (``ray.cancel`` is recursive), even ones issued from other asyncio
    tasks. Engine work that must outlive the request (driving its stream,
    aborting it, the AsyncEngine's shared output pump, which the first
    stream starts) runs detached."""
    try:
        import ray._raylet

        ray._raylet.async_task_id.set(None)
    except (ImportError, AttributeError):  # not inside a Ray worker / another Ray version
        pass


async def detached(coro):
    detach_from_request()
    return await coro


_background: set = set()


async def shielded(coro) -> None:
    """Run ``coro`` detached in a task of its own: a cancelled caller stops
    waiting, the work still completes."""
    task = asyncio.ensure_future(detached(coro))
    _background.add(task)
    task.add_done_callback(_background.discard)
    await asyncio.shield(task)


class EngineStream(StreamingResponse):
    """SSE response whose ASGI call always releases its leases (one per
    choice) on the way out, even if the body iterator never started (client
    gone before the first byte)."""

    def __init__(self, content, leases: list[Lease]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.leases = leases

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await shielded(release_all(self.leases))
