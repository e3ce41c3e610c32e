"""A socket between a serving replica and rank 0's engine loop, beside the
Ray actor calls.

Through Ray, each request costs the replica two actor calls (``submit`` and
the output poll that brings its end), and each call spends ~1 ms each way
in Ray's own machinery on top of the work (CPU: a call reaches rank 0's
method 0.9-1.3 ms after it is made, its answer the replica 0.8-1.3 ms after
it returns). When the replica and rank 0 share a node, rank 0 also listens
on a loopback TCP port and the replica talks to it directly: requests and
aborts go in as frames, and a thread in rank 0 pushes the loop's outputs as
soon as ``EngineLoop.get_outputs`` hands them over, with the same batching
and the same packing (``output_wire``) as the poll. Only the async front
(the replica's streams) uses it; Ray calls stay for everything else. A
socket that breaks means rank 0's process is gone: its group is rebuilt
and the new group's rank 0 gets a channel of its own.

A frame is a 4-byte big-endian length and a pickle. The replica's first
frame is a secret it got from rank 0 through Ray, so other local processes
that find the port cannot submit. One connection at a time: a new one
(the replica's engine after a restart of its front) replaces the old.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import secrets
import socket
import struct
import threading

from specray.output_wire import pack

log = logging.getLogger("specray.engine_channel")

_LEN = struct.Struct(">I")
_MAX_FRAME = 1 << 30


class ChannelBroken(ConnectionError):
    """The socket to rank 0 closed or failed: rank 0's process is gone, and
    the front treats its group as lost (``async_engine._RayCore``)."""


def frame(obj) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the channel")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket):
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_FRAME:
        raise ConnectionError(f"a frame of {n} bytes is over the channel's limit")
    return pickle.loads(_recv_exact(sock, n))


class ChannelServer:
    """Rank 0's end, over its ``EngineLoop``: an accept thread, and per
    connection a reader (submit, abort) and a writer (the outputs)."""

    def __init__(self, loop, min_batch_s: float = 0.005, poll_s: float = 0.5):
        self.loop, self.min_batch_s, self.poll_s = loop, min_batch_s, poll_s
        self.secret = secrets.token_bytes(16)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._closed = False
        self.counts = {"connections": 0, "submit": 0, "abort": 0, "pushes": 0}
        threading.Thread(target=self._accept, name="specray-channel-accept", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            conn, self._conn = self._conn, None
        for s in (self._listener, conn):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="specray-channel-read", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.settimeout(5.0)
            if _recv_frame(conn) != self.secret:
                raise ConnectionError("a connection without the channel's secret")
            conn.settimeout(None)
        except (ConnectionError, OSError, pickle.UnpicklingError, EOFError) as e:
            log.warning("engine channel: refused a connection (%s)", e)
            conn.close()
            return
        with self._lock:
            old, self._conn = self._conn, conn
            self.counts["connections"] += 1
        if old is not None:
            old.close()  # its writer ends on the closed socket
        send_lock = threading.Lock()

        def send(obj) -> None:
            data = frame(obj)
            with send_lock:
                conn.sendall(data)

        threading.Thread(target=self._push, args=(conn, send), name="specray-channel-write", daemon=True).start()
        try:
            while True:
                kind, *args = _recv_frame(conn)
                if kind not in ("submit", "abort"):
                    raise ConnectionError(f"a frame of unknown kind {kind!r}")
                self.counts[kind] += 1
                if kind == "submit":
                    seq, items = args
                    send(("submitted", seq, self.loop.submit(items)))
                elif kind == "abort":
                    self.loop.abort(args[0])
        except (ConnectionError, OSError, EOFError):
            pass  # the replica went, or closed it
        finally:
            self._drop(conn)

    def _push(self, conn: socket.socket, send) -> None:
        """The loop's outputs, as the Ray poll gives them, for as long as
        this connection is the current one."""
        cursor = -1
        try:
            while self._conn is conn:
                try:
                    cursor, outs = self.loop.get_outputs(cursor, self.poll_s, self.min_batch_s)
                except RuntimeError as e:  # the loop ended and has nothing more to deliver
                    send(("gone", str(e)))
                    return
                if outs:
                    send(("outputs", pack(outs)))
                    self.counts["pushes"] += 1
        except OSError:
            pass
        finally:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            if self._conn is conn:
                self._conn = None
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()


class ChannelClient:
    """The replica's end, on its event loop. ``outputs()`` gives what rank 0
    pushed (packed), in order; ``submit`` answers as the Ray call does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._seq = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self._outputs: asyncio.Queue = asyncio.Queue()
        self.broken: BaseException | None = None
        self.loop = asyncio.get_running_loop()
        self._task = self.loop.create_task(self._read())

    @classmethod
    async def connect(cls, address: tuple[str, int], secret: bytes, timeout: float = 5.0) -> "ChannelClient":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(frame(secret))
        await writer.drain()
        return cls(reader, writer)

    async def submit(self, items) -> list:
        self._check()
        self._seq += 1
        fut = asyncio.get_running_loop().create_future()
        self._waiting[self._seq] = fut
        self._writer.write(frame(("submit", self._seq, items)))
        return await fut

    def abort(self, ids) -> None:
        self._check()
        self._writer.write(frame(("abort", list(ids))))

    async def outputs(self, timeout: float) -> bytes | None:
        """The next push, or None after ``timeout`` seconds without one;
        raises ChannelBroken, or RuntimeError with rank 0's reason when its
        loop has ended, once what came before is taken."""
        try:
            item = await asyncio.wait_for(self._outputs.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    def close(self) -> None:
        """From any thread (an engine's shutdown need not run on the loop
        that made the channel)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is not self.loop and self.loop.is_running():
            self.loop.call_soon_threadsafe(self._close)
        else:
            self._close()

    def _close(self) -> None:
        try:
            self._fail(ChannelBroken("the channel was closed"))
            self._task.cancel()
            self._writer.close()
        except RuntimeError:
            pass  # made on an event loop that has ended: its socket went with it

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _fail(self, err: BaseException) -> None:
        if self.broken is None:
            self.broken = err
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(err)
            self._waiting.clear()
            self._outputs.put_nowait(err)

    async def _read(self) -> None:
        try:
            while True:
                (n,) = _LEN.unpack(await self._reader.readexactly(_LEN.size))
                kind, *args = pickle.loads(await self._reader.readexactly(n))
                if kind == "outputs":
                    self._outputs.put_nowait(args[0])
                elif kind == "submitted":
                    fut = self._waiting.pop(args[0], None)
                    if fut is not None and not fut.done():
                        fut.set_result(args[1])
                elif kind == "gone":
                    self._fail(RuntimeError(args[0]))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # EOF, reset, a bad frame: rank 0 or its process is gone
            self._fail(ChannelBroken(f"the channel to rank 0 broke: {type(e).__name__}: {e}"))


def channel_wanted() -> bool:
    """``SPECRAY_ENGINE_CHANNEL=0`` keeps the replica on Ray calls alone."""
    return os.environ.get("SPECRAY_ENGINE_CHANNEL", "1") != "0"


class ReplicaChannel:
    """The replica's channel to the live group's rank 0: opened on first
    use in each epoch (and event loop), or none where rank 0 is on another
    node, the channel is turned off, or opening it failed (Ray calls then)."""

    def __init__(self):
        self.epoch: int | None = None
        self.client: ChannelClient | None = None
        self._loop = None
        self._lock: asyncio.Lock | None = None

    def current(self, epoch: int) -> ChannelClient | None:
        """The open channel of ``epoch`` on the running event loop, if any."""
        client = self.client
        if client is None or self.epoch != epoch or client.broken is not None or \
                client.loop is not asyncio.get_running_loop():
            return None
        return client

    async def get(self, epoch: int, driver) -> ChannelClient | None:
        loop = asyncio.get_running_loop()
        if self.epoch == epoch and self._loop is loop:
            return self.client
        if self._lock is None or self._loop is not loop:
            self._lock, self._loop = asyncio.Lock(), loop
            self.epoch = None
        async with self._lock:
            if self.epoch != epoch:
                self.close()
                self.client = await self._open(driver) if channel_wanted() else None
                self.epoch = epoch
        return self.client

    @staticmethod
    async def _open(driver) -> ChannelClient | None:
        from specray.actors.workers import node_id

        try:
            found = await driver.open_channel.remote(node_id())
            return None if found is None else await ChannelClient.connect(*found)
        except Exception as e:  # Ray calls serve this epoch instead
            log.warning("engine channel: not opened, Ray calls carry requests and outputs (%s: %s)",
                        type(e).__name__, e)
            return None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
