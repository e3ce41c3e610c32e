"""Closed-loop load for the serving benchmark: N clients, each sending its
next request as soon as its previous one ends, against the OpenAI HTTP API
(SSE) or an AsyncEngine in this process; each request's timings are taken
as its tokens arrive, the same way on both paths."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class Job:
    """One request of the workload: a prompt-set row and its seed."""

    id: str
    messages: list[dict] | None  # a chat row
    prompt: str | None  # a plain-text row (/v1/completions)
    prompt_ids: list[int] | None  # what the in-process path submits
    seed: int


@dataclass
class RequestResult:
    id: str
    start: float = 0.0
    end: float | None = None
    # One entry per chunk that brought tokens: its arrival time and how many
    # tokens it carried (a speculative step emits several at once).
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    usage_tokens: int | None = None  # the server's own count (final usage chunk)
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    timed_out: bool = False  # the engine stopped answering: no use sending more
    # The engine's arrival / first_token / finished times (time.monotonic on
    # its host, which is perf_counter's clock: comparable on one host).
    engine_times: dict | None = None
    replica_times: dict | None = None  # the Serve replica's (responses.ChunkWriter): HTTP streams only

    def tokens(self, token_ids: list[int], text: str) -> None:
        if token_ids:
            self.chunk_times.append(time.perf_counter())
            self.chunk_tokens.append(len(token_ids))
            self.token_ids.extend(token_ids)
        self.text += text

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_ids)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def transport(self) -> dict[str, float] | None:
        """Where the request's time went outside the engine: ``inbound``
        (sent -> the engine took it), ``outbound`` (the engine's first token
        -> its chunk here), ``done`` (the engine ended it -> the stream's
        end here); None without the engine's times."""
        e = self.engine_times
        if not e or e.get("first_token") is None or not self.chunk_times or self.end is None:
            return None
        legs = {"inbound": e["arrival"] - self.start, "engine_ttft": e["first_token"] - e["arrival"],
                "outbound": self.chunk_times[0] - e["first_token"], "done": self.end - e["finished"]}
        rt = self.replica_times
        if rt and all(rt.get(k) is not None for k in ("received", "first_output", "finished_output")):
            # each leg split at the replica: client -> replica -> engine, and back
            legs.update({"to_replica": rt["received"] - self.start, "replica_to_engine": e["arrival"] - rt["received"],
                         "engine_to_replica": rt["first_output"] - e["first_token"],
                         "replica_to_client": self.chunk_times[0] - rt["first_output"],
                         "end_to_replica": rt["finished_output"] - e["finished"],
                         "end_replica_to_client": self.end - rt["finished_output"]})
        return legs

    def chunk_gaps(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def itl_per_token(self) -> list[float]:
        """Each token after the first chunk's: its chunk's gap shared out
        over the chunk's tokens (so a 4-token chunk after 8 ms is four
        2 ms intervals, and the list is as long as the tokens it covers)."""
        out = []
        for gap, n in zip(self.chunk_gaps(), self.chunk_tokens[1:]):
            out.extend([gap / n] * n)
        return out


Send = Callable[[Job], Awaitable[RequestResult]]


@dataclass
class LoopResult:
    results: list[RequestResult]  # in completion order
    wall_s: float  # from the first send to the last completion
    skipped: int = 0  # jobs never sent: the loop gave up
    aborted: str | None = None  # why it gave up

    @property
    def timed_out(self) -> bool:
        return any(r.timed_out for r in self.results)


async def closed_loop(send: Send, jobs: Iterable[Job], concurrency: int, max_errors: int | None = None) -> LoopResult:
    """Run the jobs with ``concurrency`` clients. Sending stops at the first
    timeout or the ``max_errors``-th failure: a broken engine then costs
    one timeout, not one per remaining request."""
    jobs = list(jobs)
    pending = iter(jobs)
    results: list[RequestResult] = []
    stop: list[str] = []

    async def client():
        for job in pending:  # a shared iterator: next() never awaits, so no job is taken twice
            r = await send(job)
            results.append(r)
            failed = [x for x in results if x.error]
            if r.timed_out or (max_errors is not None and len(failed) >= max_errors):
                stop.append(f"gave up after {len(failed)} failed request(s), the last: {r.error or failed[-1].error}")
            if stop:
                return

    t = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return LoopResult(results, time.perf_counter() - t, len(jobs) - len(results), stop[0] if stop else None)


@dataclass
class HttpTarget:
    url: str  # http://host:port
    model: str | None
    api_key: str | None
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    request_timeout_s: float = 600.0
    chunk_timeout_s: float = 120.0  # no byte for this long: the request fails

    def body(self, job: Job) -> dict:
        body = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": job.seed, "stream": True, "stream_options": {"include_usage": True},
                # per-chunk token ids: how many tokens each chunk brought
                "return_token_ids": True}
        if self.model:
            body["model"] = self.model
        if job.messages is not None:
            body["messages"] = job.messages
        else:
            body["prompt"] = job.prompt
        return body

    def endpoint(self, job: Job) -> str:
        return f"{self.url}/v1/chat/completions" if job.messages is not None else f"{self.url}/v1/completions"


async def http_request(session, target: HttpTarget, job: Job) -> RequestResult:
    """One streamed request; any failure (status, error event, timeout,
    connection) ends up in ``error``, never raised."""
    import aiohttp

    r = RequestResult(job.id)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else None
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s, sock_read=target.chunk_timeout_s)
    r.start = time.perf_counter()
    try:
        async with session.post(target.endpoint(job), json=target.body(job), headers=headers,
                                timeout=timeout) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                _read_chunk(r, json.loads(data))
                if r.error:
                    return r
            if not done:
                r.error = "the stream ended without [DONE]"
    except asyncio.TimeoutError:
        r.error = f"timed out (request {target.request_timeout_s:g} s, between chunks {target.chunk_timeout_s:g} s)"
        r.timed_out = True
    except Exception as e:  # connection refused / reset, bad JSON: a failed request, not a crashed run
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    return r


def _read_chunk(r: RequestResult, chunk: dict) -> None:
    if "error" in chunk:
        r.error = f"error event: {chunk['error'].get('message', chunk['error'])}"
        return
    for choice in chunk.get("choices") or ():
        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        r.tokens(choice.get("token_ids") or [], text or "")
        if choice.get("finish_reason"):
            r.finish_reason = choice["finish_reason"]
    if chunk.get("specray"):
        r.acceptance_lengths = list(chunk["specray"].get("acceptance_lengths") or [])
        r.engine_times = chunk["specray"].get("engine_times")
        r.replica_times = chunk["specray"].get("replica_times")
    if chunk.get("usage"):
        r.usage_tokens = chunk["usage"]["completion_tokens"]


async def inprocess_request(engine, params, job: Job, request_timeout_s: float = 600.0,
                            chunk_timeout_s: float = 120.0) -> RequestResult:
    """One request through ``AsyncEngine.generate``, timed as the HTTP
    client times a stream (an output that brings tokens = a chunk)."""
    import dataclasses

    from specray.request import engine_times

    r = RequestResult(job.id)
    r.start = time.perf_counter()
    deadline = r.start + request_timeout_s
    stream = engine.generate(job.prompt_ids if job.prompt_ids is not None else job.prompt,
                             dataclasses.replace(params, seed=job.seed))
    try:
        while True:
            wait = min(chunk_timeout_s, deadline - time.perf_counter())
            try:
                out = await asyncio.wait_for(anext(stream), max(wait, 0.0))
            except StopAsyncIteration:
                r.error = "the stream ended unfinished"
                break
            r.tokens(out.delta_token_ids, out.delta_text)
            if out.finished:
                r.finish_reason = out.finish_reason
                r.acceptance_lengths = list(out.metrics.acceptance_lengths)
                r.engine_times = engine_times([out])  # what an HTTP response's last chunk carries
                if out.finish_reason not in ("stop", "length"):
                    r.error = f"finished with {out.finish_reason}: {(out.error or '')[-300:]}"
                break
    except asyncio.TimeoutError:
        r.error = f"timed out (request {request_timeout_s:g} s, between outputs {chunk_timeout_s:g} s)"
        r.timed_out = True
    except Exception as e:
        r.error = f"{type(e).__name__}: {e}"
    finally:
        await stream.aclose()  # unfinished: aborts the engine request
    r.end = time.perf_counter()
    return r
