"""Soak: N concurrent streaming clients against a ``specray serve`` for a
while, then the server's memory and KV pool against where they started.

    python bench/soak.py --out results/cpu_soak.json                 # starts its own server, 64 clients, 600 s
    python bench/soak.py --url http://127.0.0.1:8000 --ray-address 127.0.0.1:6379 --app-name specray

Server: a server this script starts is ``specray serve`` with its defaults
(the embedded pair on the CPU, ``--max-num-seqs 64``, ``--max-queued 64``),
so 64 clients all run in the batch and none is ever answered 429. A 429 (or
any status but 200) therefore counts as an error here, as does a stream that
does not end with every choice's finish reason, its usage and ``[DONE]``,
one that carries an error event, or a request past ``--timeout``.

Each client loops: a prompt from the prompt sets (chat messages; every
fourth request as a plain completion of the first message's text),
``max_tokens`` drawn from ``--max-tokens``, greedy or sampled in turn,
streamed. A warm-up (``--warmup`` s, every client) comes first; then the
engine drains and the start figures are taken: the resident memory of the
app's processes (the replica and the engine actors, found in Ray's actor
table) and the engine's KV pools (``engine_stats`` through a Serve handle).
After ``--duration`` s the clients stop, the engine drains and the end
figures are taken the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serving  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPTS = [os.path.join(ROOT, "data/prompts/dev.jsonl"), os.path.join(ROOT, "data/prompts/eval.jsonl")]


def load_prompts(paths: list[str]) -> list[list[dict]]:
    out = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    out.append(row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}])
    return out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))], 3)


class Stats:
    def __init__(self):
        self.latency, self.ttft, self.tokens = [], [], 0
        self.requests = self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.examples: list[str] = []
        self.statuses: dict[str, int] = {}

    def error(self, kind: str, detail: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail[:300]}")


async def one_request(session, url: str, api_key: str | None, model: str, messages: list[dict], chat: bool,
                      max_tokens: int, temperature: float, timeout: float, stats: Stats | None) -> None:
    import aiohttp

    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = messages
        path = "/v1/chat/completions"
    else:
        body["prompt"] = messages[0]["content"]
        path = "/v1/completions"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.monotonic()
    ttft = None
    try:
        async with session.post(url + path, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if stats is not None:
                stats.statuses[str(resp.status)] = stats.statuses.get(str(resp.status), 0) + 1
            if resp.status != 200:
                if stats is not None:
                    stats.requests += 1
                    stats.error(f"status_{resp.status}", (await resp.text())[:300])
                return
            finish, usage, done, err = None, None, False, None
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    err = json.dumps(chunk["error"])
                    continue
                for c in chunk.get("choices") or []:
                    text = c.get("delta", {}).get("content") if chat else c.get("text")
                    if text and ttft is None:
                        ttft = time.monotonic() - t0
                    if c.get("finish_reason"):
                        finish = c["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except asyncio.TimeoutError:
        if stats is not None:
            stats.requests += 1
            stats.error("timeout", f"no end after {timeout:.0f} s")
        return
    except Exception as e:  # connection reset, bad JSON in the stream, ...
        if stats is not None:
            stats.requests += 1
            stats.error(type(e).__name__, str(e))
        return
    if stats is None:
        return
    stats.requests += 1
    if err is not None:
        stats.error("error_event", err)
    elif not done:
        stats.error("no_done", "stream ended without [DONE]")
    elif finish not in ("stop", "length"):
        stats.error("no_finish_reason", f"finish_reason {finish!r}")
    elif usage is None:
        stats.error("no_usage", "no usage chunk")
    else:
        stats.latency.append(time.monotonic() - t0)
        if ttft is not None:
            stats.ttft.append(ttft)
        stats.tokens += usage["completion_tokens"]


async def run_clients(url, api_key, model, prompts, clients: int, seconds: float, max_tokens: tuple[int, int],
                      timeout: float, stats: Stats | None, seed: int) -> float:
    import aiohttp

    stop_at = time.monotonic() + seconds

    async def client(i: int):
        rng = random.Random(seed * 1000 + i)
        k = i
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < stop_at:
                messages = prompts[(k * 7 + i) % len(prompts)]
                await one_request(session, url, api_key, model, messages, chat=k % 4 != 3,
                                  max_tokens=rng.randint(*max_tokens), temperature=0.0 if k % 2 == 0 else 0.7,
                                  timeout=timeout, stats=stats)
                k += 1

    t = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return time.monotonic() - t


def snapshot(app: str) -> dict:
    pids = serving.app_processes(app)
    st = serving.engine_stats(app)
    rss = serving.rss_mb(pids)
    return {"time": time.time(), "rss_mb": rss, "rss_total_mb": round(sum(v for v in rss.values() if v), 1),
            "pids": pids, "pools": {k: {"free": v[0], "total": v[1]} for k, v in st["pools"].items()},
            "in_flight": st.get("in_flight"), "running": st.get("running"), "waiting": st.get("waiting"),
            "num_unfinished": st.get("num_unfinished"), "num_steps": st.get("num_steps")}


def drain(app: str, timeout: float = 180.0) -> dict:
    """Until nothing is in flight and every KV block is free (or timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        st = serving.engine_stats(app)
        idle = (st.get("in_flight") == 0 and st.get("num_unfinished") == 0 and st.get("running") == 0
                and all(free == cap for free, cap in st["pools"].values()))
        if idle or time.monotonic() > deadline:
            return {"idle": idle, "waited_s": round(timeout - (deadline - time.monotonic()), 1)}
        time.sleep(0.5)


async def sampler(app: str, every: float, out: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            s = await asyncio.to_thread(snapshot, app)
            out.append({**{k: s[k] for k in ("time", "rss_total_mb", "pools", "in_flight", "running", "waiting")},
                        "loadavg_1m": round(os.getloadavg()[0], 2)})
        except Exception as e:
            out.append({"time": time.time(), "error": f"{type(e).__name__}: {e}"})
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def soak(args, url: str, model: str, prompts) -> dict:
    stats = Stats()
    timeline: list = []
    stop = asyncio.Event()
    task = asyncio.create_task(sampler(args.app_name, args.sample_every, timeline, stop))
    wall = await run_clients(url, args.api_key, model, prompts, args.clients, args.duration, tuple(args.max_tokens),
                             args.timeout, stats, args.seed)
    stop.set()
    await task
    return {"stats": stats, "wall": wall, "timeline": timeline}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback); default: start one")
    ap.add_argument("--ray-address", help="with --url: the Ray cluster that runs it (default: auto)")
    ap.add_argument("--app-name", default=serving.APP)
    ap.add_argument("--api-key", default=os.environ.get("SPECRAY_API_KEY"))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=600.0, help="measured seconds")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of the same load before the start figures")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"))
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds a request may take (64 streams on two shared cores took up to 295 s each)")
    ap.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    ap.add_argument("--sample-every", type=float, default=15.0, help="seconds between memory / KV samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-arg", action="append", default=[], help="more `specray serve` arguments")
    ap.add_argument("--out", help="write the report (JSON) here")
    args = ap.parse_args(argv)

    prompts = load_prompts(args.prompts)
    server = None
    if args.url:
        serving.connect(args.ray_address)
        url = args.url.rstrip("/")
    else:
        log = os.path.join(tempfile.gettempdir(), f"specray_soak_serve_{os.getpid()}.log")
        server = serving.LocalServer(args.serve_arg, log, api_key=args.api_key)
        url = server.url
    try:
        import urllib.request

        req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {args.api_key}"}
                                     if args.api_key else {})
        card = json.loads(urllib.request.urlopen(req, timeout=30).read())["data"][0]
        model = card["id"]
        t = time.monotonic()
        asyncio.run(run_clients(url, args.api_key, model, prompts, args.clients, args.warmup, tuple(args.max_tokens),
                                args.timeout, None, args.seed + 1))
        warm_drain = drain(args.app_name)
        start = snapshot(args.app_name)
        start_load = round(os.getloadavg()[0], 2)
        print(f"soak: warmed up in {time.monotonic() - t:.0f} s; start RSS {start['rss_mb']} MB, KV {start['pools']}",
              flush=True)
        run = asyncio.run(soak(args, url, model, prompts))
        end_drain = drain(args.app_name)
        end = snapshot(args.app_name)
    finally:
        if server is not None:
            server.stop()
    stats: Stats = run["stats"]
    growth = {k: round(100 * (end["rss_mb"][k] / v - 1), 2) for k, v in start["rss_mb"].items()
              if v and end["rss_mb"].get(k)}
    report = {
        "command": "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "server": {"url": url, "started_here": server is not None,
                   "serve_command": " ".join(server.command) if server else None, "model": model,
                   "max_model_len": card.get("max_model_len"), "specray": card.get("specray")},
        "machine": f"{platform.node()}: {os.cpu_count()} cores shared with other engineers' work (CPU, fp32)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load": {"clients": args.clients, "duration_s": args.duration, "warmup_s": args.warmup,
                 "max_tokens": args.max_tokens, "stream": True, "mix": "3/4 chat, 1/4 completions; greedy and "
                 "temperature 0.7 in turn", "prompts": [os.path.relpath(p, ROOT) for p in args.prompts],
                 "timeout_s": args.timeout},
        "requests": stats.requests, "errors": stats.errors, "error_kinds": stats.error_kinds,
        "error_examples": stats.examples, "statuses": stats.statuses,
        "ok_requests": len(stats.latency), "wall_s": round(run["wall"], 1),
        "requests_per_s": round(len(stats.latency) / run["wall"], 3),
        "completion_tokens": stats.tokens, "tokens_per_s": round(stats.tokens / run["wall"], 2),
        "latency_s": {"p50": pct(stats.latency, 50), "p90": pct(stats.latency, 90), "p99": pct(stats.latency, 99),
                      "max": pct(stats.latency, 100),
                      "mean": round(statistics.fmean(stats.latency), 3) if stats.latency else None},
        "ttft_s": {"p50": pct(stats.ttft, 50), "p90": pct(stats.ttft, 90), "p99": pct(stats.ttft, 99),
                   "max": pct(stats.ttft, 100)},
        "loadavg_1m": {"start": start_load, "end": round(os.getloadavg()[0], 2),
                       "max_sampled": max((t.get("loadavg_1m", 0) for t in run["timeline"]), default=None)},
        "start": start, "end": end, "drain": {"after_warmup": warm_drain, "after_load": end_drain},
        "rss_growth_pct": growth,
        "rss_total_growth_pct": round(100 * (end["rss_total_mb"] / start["rss_total_mb"] - 1), 2),
        "kv_all_free_at_end": all(p["free"] == p["total"] for p in end["pools"].values()),
        "timeline": run["timeline"],
    }
    print(f"soak: {report['requests']} requests, {report['errors']} errors, p50/p99 latency "
          f"{report['latency_s']['p50']}/{report['latency_s']['p99']} s, TTFT p99 {report['ttft_s']['p99']} s, "
          f"RSS growth {growth} (total {report['rss_total_growth_pct']} %), KV end {end['pools']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    rep = main()
    sys.exit(0 if rep["errors"] == 0 and rep["kv_all_free_at_end"] else 1)
