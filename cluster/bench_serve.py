"""``specray bench serve``: the serving benchmark, in the style of ``vllm
bench serve``. N closed-loop streaming clients send the prompt set's chat
requests to the OpenAI HTTP endpoint of ``specray serve`` (started here, a
server per drafter setting, or one already running: ``--url``), and the same
workload goes to an AsyncEngine in this process (no HTTP, no Ray), so that
HTTP / in-process isolates what the serving path costs and drafter on / off
what speculation gains there. Writes JSON (points + ratios) and a PNG plot,
and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from specray.cli import add_model_args, drafting_args

PATHS = ("http", "inprocess")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specray bench serve", description=__doc__)
    m = p.add_argument_group("model and engine (the started servers and the in-process engine alike)")
    add_model_args(m)
    m.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch")
    m.add_argument("--num-kv-blocks", type=int)
    m.add_argument("--kv-block-size", type=int, default=16)
    m.add_argument("--eager", action="store_true", help="no CUDA graphs")
    s = p.add_argument_group("server")
    s.add_argument("--url", help="benchmark this running server (e.g. http://127.0.0.1:8000) instead of starting "
                                 "one; its drafter setting is read from /v1/models")
    s.add_argument("--api-key", help="bearer key for --url (default: env SPECRAY_API_KEY)")
    s.add_argument("--serve-args", default="",
                   help="more `specray serve` flags for the servers started here, as one string, written with = "
                        "(--serve-args='--drafter-placement separate')")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", default="data/prompts/eval.jsonl", help="JSONL of chat `messages` (or `prompt`) rows")
    w.add_argument("--limit", type=int, help="the first N prompts of the set")
    w.add_argument("--num-requests", type=int,
                   help="timed requests per point (default: each prompt once; more cycle through the set)")
    w.add_argument("--max-tokens", type=int, default=128)
    w.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    w.add_argument("--top-p", type=float, default=1.0)
    w.add_argument("--seed", type=int, default=0, help="request i is sent with seed + i")
    w.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="concurrent clients, one point each")
    w.add_argument("--drafter-modes", nargs="+", choices=["on", "off"], default=["on", "off"],
                   help="speculative (the drafter) and/or autoregressive (--no-drafter, a server of its own)")
    w.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    w.add_argument("--requests-per-client", type=int,
                   help="each point sends at least this many requests per client, cycling through the set, so "
                        "that the first wave (all clients at once) and the last (clients running out) are a "
                        "small part of its time (default: 8 on CUDA, else 1)")
    w.add_argument("--warmup-requests", type=int,
                   help="untimed requests before each point, at its concurrency and temperature (default: on "
                        "CUDA the whole workload, so every graph size it meets is captured first; else one "
                        "per client)")
    t = p.add_argument_group("time bounds")
    t.add_argument("--server-timeout", type=float, default=900.0, help="seconds for a started server to be ready")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one request, whole")
    t.add_argument("--chunk-timeout", type=float, default=120.0, help="seconds without a chunk before a request fails")
    t.add_argument("--max-errors", type=int, default=3,
                   help="failed requests after which a point stops sending (a timeout stops it at once, and the "
                        "same engine's later points are not run)")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="JSON path (default: results/serve_load_<device>.json)")
    o.add_argument("--plot", help="PNG path (default: the JSON's path with .png)")
    o.add_argument("--save-outputs", action="store_true", help="store every request's text and token ids")
    o.add_argument("--note", help="free text stored in the JSON (where and how it ran)")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Every flag checked before a model loads or a server starts."""
    if not Path(args.prompts).is_file():
        p.error(f"--prompts {args.prompts}: no such file (the default is relative to the repository root)")
    for name in ("limit", "num_requests", "max_tokens", "max_num_seqs", "max_errors", "requests_per_client"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if any(c < 1 for c in args.concurrency):
        p.error(f"--concurrency values must be at least 1, got {args.concurrency}")
    if any(not 0 <= t <= 2 for t in args.temperatures):
        p.error(f"--temperatures must be in [0, 2], got {args.temperatures}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.warmup_requests is not None and args.warmup_requests < 0:
        p.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.no_drafter:
        if "on" in args.drafter_modes and args.drafter_modes != ["on", "off"]:
            p.error("--no-drafter and --drafter-modes on contradict each other")
        args.drafter_modes = ["off"]
    args.drafter_modes = list(dict.fromkeys(args.drafter_modes))
    args.paths = list(dict.fromkeys(args.paths))
    args.concurrency = sorted(set(args.concurrency))
    if args.url:
        if "http" not in args.paths:
            p.error("--url is the HTTP path's server: keep http in --paths")
        args.url = args.url.rstrip("/")
    if args.url and args.serve_args:
        p.error("--serve-args configures servers started here, not --url")
    try:
        shlex.split(args.serve_args)
    except ValueError as e:
        p.error(f"--serve-args: {e}")


def serve_flags(args, target: str, drafter: str | None) -> list[str]:
    """`specray serve` flags for the same engine as ``engine_config``."""
    f = ["--target", target] + (["--drafter", drafter] if drafter else ["--no-drafter"])
    for name in ("device", "dtype", "max_model_len", "num_speculative_tokens", "prompt_lookup_min",
                 "max_num_seqs", "num_kv_blocks", "kv_block_size"):
        v = getattr(args, name)
        if v is not None:
            f += [f"--{name.replace('_', '-')}", str(v)]
    for name in ("prompt_lookup_agree", "async_scheduling", "draft_tree"):
        v = getattr(args, name)
        if v is not None:
            f.append(f"--{'' if v else 'no-'}{name.replace('_', '-')}")
    if args.eager:
        f.append("--eager")
    return f + shlex.split(args.serve_args)


def engine_config(args, target: str, drafter: str | None):
    """The EngineConfig a server started with ``serve_flags`` runs (built
    the way `specray serve` builds it)."""
    from specray.serve.app import ServeArgs

    return ServeArgs(
        target=target, drafter=drafter, no_drafter=drafter is None, device=args.device, dtype=args.dtype,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, kv_block_size=args.kv_block_size,
        max_num_seqs=args.max_num_seqs,
        engine=dict(**drafting_args(args), num_speculative_tokens=args.num_speculative_tokens,
                    cuda_graphs=False if args.eager else None, async_scheduling=args.async_scheduling),
    ).engine_config()


def load_jobs(path: str, tokenizer, limit: int | None, num_requests: int | None, seed: int):
    from specray.detokenizer import chat_prompt_ids
    from specray.load_client import Job

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"{path}: no prompts")
    jobs = []
    for i in range(num_requests or len(rows)):
        row = rows[i % len(rows)]
        rid = str(row.get("id", i % len(rows))) + (f"#{i // len(rows)}" if i >= len(rows) else "")
        msgs = row.get("messages")
        if msgs is None and "prompt" not in row:
            raise ValueError(f"{path}: row {i % len(rows)} has neither messages nor prompt")
        ids = chat_prompt_ids(tokenizer, msgs) if msgs is not None else None
        jobs.append(Job(rid, msgs, row.get("prompt"), ids, seed + i))
    return jobs


def cycle(jobs: list, n: int) -> list:
    return [jobs[i % len(jobs)] for i in range(n)]


class Sweep:
    """Runs the points of one engine (a server or the in-process engine):
    every temperature x concurrency, each after its warm-up."""

    def __init__(self, args, jobs):
        self.args, self.jobs = args, jobs
        self.points, self.outputs = [], {}
        self.warmup = args.warmup_requests

    def timed_n(self, concurrency: int) -> int:
        per_client = self.args.requests_per_client or (8 if str(self.args.device).startswith("cuda") else 1)
        return max(len(self.jobs), per_client * concurrency)

    def warm_n(self, concurrency: int) -> int:
        if self.warmup is not None:
            return self.warmup
        return len(self.jobs) if str(self.args.device).startswith("cuda") else concurrency

    async def run(self, path: str, drafter: bool, make_send, stats) -> None:
        """``stats``: an async callable giving the engine's stats (or None),
        read around each timed run."""
        from specray.bench_serve_report import engine_counters, summarize
        from specray.load_client import LoopResult, closed_loop

        hung = None  # a timeout: this engine's remaining points are not sent
        for temp in self.args.temperatures:
            send = make_send(temp)
            for conc in self.args.concurrency:
                if hung:
                    run = LoopResult([], 0.0, self.timed_n(conc), f"not run: {hung}")
                else:
                    run = LoopResult([], 0.0)
                    if self.warm_n(conc):
                        warm = await closed_loop(send, cycle(self.jobs, self.warm_n(conc)), conc, self.args.max_errors)
                        if warm.aborted:
                            run = LoopResult([], 0.0, self.timed_n(conc), f"warm-up {warm.aborted}")
                            hung = run.aborted if warm.timed_out else None
                    before = None
                    if not run.aborted:
                        before = await stats()
                        run = await closed_loop(send, cycle(self.jobs, self.timed_n(conc)), conc,
                                                self.args.max_errors)
                        hung = run.aborted if run.timed_out else None
                p = summarize(path, drafter, temp, conc, run.results, run.wall_s, self.args.save_outputs,
                              run.skipped, run.aborted)
                p.load_average_1m = round(os.getloadavg()[0], 2)
                if self.args.url and urlsplit(self.args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
                    p.transport = None  # another host's clock
                p.engine = engine_counters(before, await stats() if before else None, run.wall_s)
                self.points.append(p)
                self.outputs[p.key()] = {r.id: r.token_ids for r in run.results if r.error is None}
                print(f"  {path:<9} drafter {'on ' if drafter else 'off'} T={temp:g} c={conc}: "
                      f"{p.output_tok_s:.1f} tok/s, {p.request_throughput:.2f} req/s, TTFT p50 "
                      f"{p.ttft_p50_ms:.1f} ms, accept {p.mean_acceptance_length:.2f}, errors {p.errors}"
                      + (f", engine busy {p.engine['busy']:.0%}" if p.engine else "")
                      + (", in/ttft/out/done p50 {inbound_ms:.1f}/{engine_ttft_ms:.1f}/{outbound_ms:.1f}/"
                         "{done_ms:.1f} ms".format(**p.transport) if p.transport else "")
                      + (" (at the replica: in {to_replica_ms:.1f}+{replica_to_engine_ms:.1f}, out "
                         "{engine_to_replica_ms:.1f}+{replica_to_client_ms:.1f}, done {end_to_replica_ms:.1f}+"
                         "{end_replica_to_client_ms:.1f})".format(**p.transport)
                         if p.transport and "to_replica_ms" in p.transport else "")
                      + (f" ({p.error_samples[0]})" if p.error_samples else "")
                      + (f"; ABORTED: {p.aborted}" if p.aborted else ""), flush=True)


async def run_http(sweep: Sweep, url: str, model: str | None, api_key: str | None, drafter: bool) -> None:
    import aiohttp

    from specray.load_client import HttpTarget, http_request

    a = sweep.args
    connector = aiohttp.TCPConnector(limit=max(100, 2 * max(a.concurrency)))
    async with aiohttp.ClientSession(connector=connector) as session:
        def make_send(temp):
            target = HttpTarget(url, model, api_key, a.max_tokens, temp, a.top_p, a.request_timeout, a.chunk_timeout)
            return lambda job: http_request(session, target, job)

        async def stats():
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            try:
                async with session.get(f"{url}/server_info", headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=30)) as r:
                    return (await r.json())["engine"] if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                return None  # a server without it (an older one, --url): no engine counters

        await sweep.run("http", drafter, make_send, stats)


async def run_inprocess(sweep: Sweep, engine, drafter: bool) -> None:
    from specray.load_client import inprocess_request
    from specray.sampling import SamplingParams

    a = sweep.args

    def make_send(temp):
        params = SamplingParams(max_tokens=a.max_tokens, temperature=temp, top_p=a.top_p)
        return lambda job: inprocess_request(engine, params, job, a.request_timeout, a.chunk_timeout)

    async def stats():
        try:
            return await asyncio.to_thread(engine.stats)
        except Exception:  # a failed engine: its points say so, without counters
            return None

    await sweep.run("inprocess", drafter, make_send, stats)


def machine_info(device: str) -> dict:
    import torch

    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": None,
            # a shared machine's other work shows here (1, 5, 15-minute means at the end of the run;
            # each point holds the 1-minute mean at its end)
            "load_average": [round(x, 2) for x in os.getloadavg()]}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)  # read last: it opens a CUDA context in this process
    return info


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # so that the finally blocks stop the servers and engines started here


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    from specray.cli import resolve_models
    from specray.detokenizer import load_tokenizer
    from specray.serve_process import ServerError

    t_start = time.perf_counter()
    args_on = argparse.Namespace(**{**vars(args), "no_drafter": False})
    target, drafter_dir = resolve_models(args_on)
    if "on" in args.drafter_modes and drafter_dir is None:
        p.error("--drafter-modes on needs a drafter (--drafter DIR, or the default target's)")
    jobs = load_jobs(args.prompts, load_tokenizer(target), args.limit, args.num_requests, args.seed)
    out = Path(args.out or f"results/serve_load_{str(args.device).replace(':', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_path = Path(args.plot) if args.plot else out.with_suffix(".png")
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)

    from specray.bench_serve_report import DEFINITIONS, plot, ratios, table

    sweep = Sweep(args, jobs)
    engines, failures = [], []
    modes = [(m, drafter_dir if m == "on" else None) for m in args.drafter_modes]
    print(f"specray bench serve: {len(jobs)} prompts, requests a point "
          f"{ {c: sweep.timed_n(c) for c in args.concurrency} }, max_tokens {args.max_tokens}, "
          f"concurrency {args.concurrency}, T {args.temperatures}, drafter {args.drafter_modes}, "
          f"paths {args.paths}", flush=True)
    # HTTP first: each server is a process tree that takes the device's
    # memory with it when it stops; the in-process engines come last.
    runs = []
    if "http" in args.paths:
        runs += [("http", None, lambda: _attached(sweep, args))] if args.url else \
            [("http", m, lambda d=d: _served(sweep, args, target, d)) for m, d in modes]
    if "inprocess" in args.paths:
        runs += [("inprocess", m, lambda d=d: _in_process(sweep, args, target, d)) for m, d in modes]
    interrupted = False
    for path, mode, run in runs:
        try:
            engines.append(run())
        except KeyboardInterrupt:  # what was measured is still written; everything started here is stopped
            print("specray bench serve: interrupted", file=sys.stderr, flush=True)
            failures.append({"path": path, "drafter": None if mode is None else mode == "on", "error": "interrupted"})
            interrupted = True
            break
        except Exception as e:  # one engine failing leaves the others' points to report
            what = f"{path}, drafter {mode}" if mode else path
            msg = str(e) if isinstance(e, ServerError) else f"{type(e).__name__}: {e}"
            print(f"specray bench serve: {what} failed: {msg}", file=sys.stderr, flush=True)
            failures.append({"path": path, "drafter": None if mode is None else mode == "on", "error": msg[-4000:]})

    rat = ratios(sweep.points, sweep.outputs)
    report = {
        "command": "specray bench serve " + shlex.join(argv),
        "note": args.note,
        "machine": machine_info(args.device),
        "settings": {"target": target, "drafter": drafter_dir, "device": args.device, "prompts": args.prompts,
                     "limit": args.limit, "requests_per_point": {c: sweep.timed_n(c) for c in args.concurrency},
                     "max_tokens": args.max_tokens,
                     "temperatures": args.temperatures, "top_p": args.top_p, "seed": args.seed,
                     "concurrency": args.concurrency, "drafter_modes": args.drafter_modes, "paths": args.paths,
                     "warmup_requests": {c: sweep.warm_n(c) for c in args.concurrency},
                     "max_num_seqs": args.max_num_seqs, "serve_args": args.serve_args, "url": args.url},
        "definitions": DEFINITIONS,
        "engines": engines,
        "failures": failures,
        "points": [pt.as_dict() for pt in sweep.points],
        "ratios": rat,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    if sweep.points:
        plot(sweep.points, str(plot_path), f"specray bench serve: {Path(target).name}, {args.device}, "
             f"{Path(args.prompts).name} ({len(jobs)} prompts), max_tokens {args.max_tokens}")
    print(table(sweep.points, rat))
    print(f"specray bench serve: wrote {out}" + (f" and {plot_path}" if sweep.points else "")
          + f" in {report['elapsed_s']:.0f} s", flush=True)
    bad = failures or any(pt.errors or pt.aborted for pt in sweep.points)
    return 130 if interrupted else 1 if bad else 0


def _attached(sweep: Sweep, args) -> dict:
    from specray.serve_process import get_json

    key = args.api_key or os.environ.get("SPECRAY_API_KEY")
    card = get_json(f"{args.url}/v1/models", 30, key)["data"][0]
    drafter = bool((card.get("specray") or {}).get("drafter"))
    print(f"specray bench serve: {args.url} serves {card['id']!r}, drafter {'on' if drafter else 'off'}", flush=True)
    asyncio.run(run_http(sweep, args.url, card["id"], key, drafter))
    return {"path": "http", "drafter": drafter, "url": args.url, "model": card}


def _served(sweep: Sweep, args, target: str, drafter: str | None) -> dict:
    from specray.serve_process import ServerProcess

    server = ServerProcess(serve_flags(args, target, drafter))
    key = os.environ.get("SPECRAY_API_KEY")
    print(f"specray bench serve: starting {shlex.join(server.cmd[1:])}", flush=True)
    try:
        t = time.perf_counter()
        card = server.start(args.server_timeout, key)
        start_s = time.perf_counter() - t
        print(f"specray bench serve: server ready in {start_s:.1f} s at {server.url}", flush=True)
        asyncio.run(run_http(sweep, server.url, card["id"], key, drafter is not None))
    finally:
        server.close()
    return {"path": "http", "drafter": drafter is not None, "start_s": round(start_s, 1),
            "command": shlex.join(["specray", *server.cmd[3:]]), "model": card}


def _in_process(sweep: Sweep, args, target: str, drafter: str | None) -> dict:
    from specray.async_engine import AsyncEngine

    t = time.perf_counter()
    engine = AsyncEngine.from_config(engine_config(args, target, drafter), backend="inprocess")
    load_s = time.perf_counter() - t
    print(f"specray bench serve: in-process engine (drafter {'on' if drafter else 'off'}) loaded in "
          f"{load_s:.1f} s", flush=True)
    try:
        features = engine.stats().get("features")
        asyncio.run(run_inprocess(sweep, engine, drafter is not None))
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # its GPU memory back before the next engine sizes its KV cache
        _empty_cuda_cache()
    return {"path": "inprocess", "drafter": drafter is not None, "load_s": round(load_s, 1), "features": features}


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
