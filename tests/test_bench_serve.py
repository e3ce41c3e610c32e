"""``specray bench serve``: the load client's timing and SSE reading against
a canned server, the figures, the flags; and the whole benchmark end to end
on the embedded pair (a `specray serve` child and the in-process engine)."""

import asyncio
import json
import time

import pytest

from specray.bench_serve_report import engine_counters, percentile, ratios, summarize
from specray.load_client import HttpTarget, Job, RequestResult, closed_loop, http_request

pytest.importorskip("aiohttp")


def test_itl_shares_a_chunks_gap_over_its_tokens():
    r = RequestResult("a", start=0.0, end=1.0)
    r.chunk_times, r.chunk_tokens = [0.1, 0.3, 0.35], [1, 4, 1]
    r.token_ids = list(range(6))
    assert r.ttft == pytest.approx(0.1)
    assert r.chunk_gaps() == pytest.approx([0.2, 0.05])
    assert r.itl_per_token() == pytest.approx([0.05] * 4 + [0.05])
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    p = summarize("http", True, 0.0, 1, [r, RequestResult("b", error="HTTP 500: x")], 2.0)
    assert p.errors == 1 and p.output_tokens == 6 and p.output_tok_s == 3.0 and p.request_throughput == 0.5
    assert p.ttft_p50_ms == pytest.approx(100) and p.tokens_per_chunk == 2
    assert p.tpot_mean_ms == pytest.approx(180) and p.error_samples == ["HTTP 500: x"]


def test_ratios_pair_paths_and_drafters():
    def point(path, drafter, tok_s):
        r = RequestResult("x", start=0.0, end=1.0)
        r.chunk_times, r.chunk_tokens, r.token_ids = [0.5], [1], [7]
        p = summarize(path, drafter, 0.0, 4, [r], 1.0)
        p.output_tok_s = tok_s
        return p

    pts = [point("http", True, 90.0), point("inprocess", True, 100.0), point("http", False, 45.0),
           point("inprocess", False, 50.0)]
    outputs = {pts[0].key(): {"a": [1, 2], "b": [3]}, pts[1].key(): {"a": [1, 2], "b": [4]}}
    rat = ratios(pts, outputs)
    on = next(r for r in rat["http_over_inprocess"] if r["drafter"])
    assert on["output_tok_s"] == 0.9 and on["identical_outputs"] == 1 and on["compared"] == 2
    assert {(r["path"], r["output_tok_s"]) for r in rat["spec_over_ar"]} == {("http", 2.0), ("inprocess", 2.0)}


def _chunk(choice, **extra):
    return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": choice and [choice],
                                  **extra}) + "\n\n"


def _sse_app(stalls: bool = False):
    from aiohttp import web

    async def chat(request):
        arrival = time.monotonic()
        body = await request.json()
        if body["messages"][0]["content"] == "refuse":
            return web.json_response({"error": {"message": "nope"}}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        assert body["stream"] and body["return_token_ids"] and body["stream_options"]["include_usage"]
        parts = [_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}),
                 _chunk({"index": 0, "delta": {"content": "Hi"}, "token_ids": [5], "finish_reason": None}),
                 _chunk({"index": 0, "delta": {"content": " there you"}, "token_ids": [6, 7, 8],
                         "finish_reason": None}),
                 None,  # the finish chunk, with the times of what came before it
                 _chunk([], usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}),
                 "data: [DONE]\n\n"]
        first = None
        for i, part in enumerate(parts):
            if stalls and i == 2:
                await asyncio.sleep(2)
            if part is None:
                times = {"arrival": arrival, "first_token": first, "finished": time.monotonic()}
                # a replica in front of the engine: it took the request before the engine did, saw the
                # first tokens and the end after it
                replica = {"received": arrival - 0.002, "first_output": first + 0.001,
                           "finished_output": times["finished"] + 0.001}
                part = _chunk({"index": 0, "delta": {}, "finish_reason": "length"},
                              specray={"acceptance_lengths": [3], "mean_acceptance_length": 3.0,
                                       "engine_times": times, "replica_times": replica})
            first = first or (time.monotonic() if i == 1 else None)
            await resp.write(part.encode())
            await asyncio.sleep(0.01)
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _serve_canned(stalls: bool, contents: list[str], concurrency: int, max_errors=None):
    import aiohttp
    from aiohttp import web

    from specray.serve_process import free_port

    async def go():
        runner = web.AppRunner(_sse_app(stalls))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        target = HttpTarget(f"http://127.0.0.1:{port}", "m", None, 4, 0.0, chunk_timeout_s=0.5)
        jobs = [Job(f"j{i}", [{"role": "user", "content": c}], None, None, i) for i, c in enumerate(contents)]
        try:
            async with aiohttp.ClientSession() as session:
                return await closed_loop(lambda j: http_request(session, target, j), jobs, concurrency, max_errors)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_engine_counters_split_a_points_time_by_step_kind():
    before = {"num_steps": 10, "num_async_steps": 8, "chain_joins": 1, "step_time_s": 0.02, "async_wall_s": 0.012,
              "async_gpu_s": 0.0, "cycle_costs": {"16a": [8, 0.012, 0.0, 128]}}
    after = {"num_steps": 30, "num_async_steps": 26, "chain_joins": 3, "step_time_s": 0.07, "async_wall_s": 0.042,
             "async_gpu_s": 0.0, "cycle_costs": {"16a": [24, 0.036, 0.0, 384], "16a+join": [2, 0.006, 0.0, 30]}}
    e = engine_counters(before, after, wall_s=0.1)
    assert (e["steps"], e["async_steps"], e["chain_joins"], e["busy"]) == (20, 18, 2, 0.5)
    assert e["step_ms"] == 2.5 and e["sync_step_ms"] == 10.0 and e["async_gpu_ms"] is None
    # per kind: count, mean wall ms, mean GPU ms, tokens; kinds the point did not run are left out
    assert e["cycles"] == {"16a": [16, 1.5, 0.0, 256], "16a+join": [2, 3.0, 0.0, 30]}


def test_http_client_reads_a_stream():
    run = _serve_canned(False, ["hi", "hi", "refuse"], 2)
    by = {r.id: r for r in run.results}
    assert by["j2"].error.startswith("HTTP 429") and "nope" in by["j2"].error
    assert run.aborted is None and run.skipped == 0 and run.wall_s > 0
    r = by["j0"]
    assert r.error is None and r.text == "Hi there you" and r.token_ids == [5, 6, 7, 8]
    assert r.chunk_tokens == [1, 3] and r.output_tokens == 4 and r.acceptance_lengths == [3]
    assert r.finish_reason == "length" and r.ttft > 0 and len(r.itl_per_token()) == 3
    # the server's times, on this host's clock: where the TTFT went
    t = r.transport()
    assert t["inbound"] >= 0 and t["engine_ttft"] >= 0.009 and t["outbound"] >= 0 and t["done"] >= 0, t
    assert abs(t["inbound"] + t["engine_ttft"] + t["outbound"] - r.ttft) < 1e-9
    assert t["inbound"] < r.ttft and t["outbound"] < r.ttft
    # each leg split at the replica
    assert t["replica_to_engine"] == pytest.approx(0.002) and t["engine_to_replica"] == pytest.approx(0.001)
    assert t["end_to_replica"] == pytest.approx(0.001)
    for leg, (a, b) in {"inbound": ("to_replica", "replica_to_engine"), "outbound": ("engine_to_replica",
                        "replica_to_client"), "done": ("end_to_replica", "end_replica_to_client")}.items():
        assert t[a] + t[b] == pytest.approx(t[leg]), leg


def test_a_point_gives_up_at_a_timeout_or_after_max_errors():
    """A server that stops answering costs one chunk timeout, not one per
    remaining request; failures that come back fast stop at --max-errors."""
    run = _serve_canned(True, ["hi", "hi", "hi", "hi"], 2)
    assert run.timed_out and run.skipped == 2 and "timed out" in run.aborted
    assert all(r.timed_out and "timed out" in r.error for r in run.results)
    run = _serve_canned(False, ["refuse"] * 5, 1, max_errors=2)
    assert len(run.results) == 2 and run.skipped == 3 and "HTTP 429" in run.aborted and not run.timed_out


def test_a_hung_engines_later_points_are_not_run():
    from specray.bench_serve import Sweep, build_parser

    args = build_parser().parse_args(["--concurrency", "1", "2", "--temperatures", "0", "1",
                                      "--warmup-requests", "0"])
    sweep = Sweep(args, [Job(f"j{i}", [], None, None, i) for i in range(3)])

    async def hangs(job):
        return RequestResult(job.id, start=0.0, end=1.0, error="timed out", timed_out=True)

    async def no_stats():
        return None

    asyncio.run(sweep.run("http", True, lambda temp: hangs, no_stats))
    first, *rest = sweep.points
    assert first.engine is None
    assert (first.num_requests, first.errors, first.skipped) == (1, 1, 2) and "timed out" in first.aborted
    assert len(rest) == 3 and all(p.aborted.startswith("not run") and p.skipped == 3 for p in rest)


def test_bad_flags_are_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    from specray import bench_serve

    monkeypatch.setattr(bench_serve, "load_jobs", lambda *a, **k: pytest.fail("got as far as the prompts"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for argv, msg in ((["--concurrency", "0"], "--concurrency values must be at least 1"),
                      (["--temperatures", "3"], "--temperatures must be in [0, 2]"),
                      (["--no-drafter", "--drafter-modes", "on"], "contradict"),
                      (["--paths", "inprocess", "--url", "http://127.0.0.1:1"], "keep http in --paths"),
                      (["--serve-args", "'unclosed"], "--serve-args"),
                      (["--prompts", str(tmp_path / "none.jsonl")], "no such file")):
        with pytest.raises(SystemExit) as e:
            bench_serve.main(["--prompts", str(prompts), *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv


def test_the_servers_flags_match_the_in_process_engine(tmp_path):
    import argparse

    from specray.bench_serve import build_parser, serve_flags

    args = build_parser().parse_args(["--device", "cuda", "--no-draft-tree", "--max-num-seqs", "16",
                                      "--serve-args", "--drafter-placement separate"])
    flags = serve_flags(args, "/t", None)
    assert flags[:3] == ["--target", "/t", "--no-drafter"]
    assert "--no-draft-tree" in flags and flags[-2:] == ["--drafter-placement", "separate"]
    assert flags[flags.index("--max-num-seqs") + 1] == "16" and flags[flags.index("--device") + 1] == "cuda"
    from specray.serve.cli import build_parser as serve_parser

    served = serve_parser().parse_args(flags)  # every flag is one `specray serve` takes
    assert isinstance(served, argparse.Namespace) and served.draft_tree is False


@pytest.mark.slow
def test_bench_serve_end_to_end_on_the_embedded_pair(tmp_path):
    """A `specray serve` child with the drafter and the in-process engine,
    concurrency 1 and 2: greedy outputs through HTTP are the in-process
    engine's, token for token and in text."""
    pytest.importorskip("ray")
    pytest.importorskip("matplotlib")
    from specray.bench_serve import main

    out = tmp_path / "serve.json"
    argv = ["--limit", "3", "--max-tokens", "8", "--concurrency", "1", "2", "--temperatures", "0",
            "--drafter-modes", "on", "--warmup-requests", "0", "--requests-per-client", "2", "--save-outputs",
            "--out", str(out), "--note", "test"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert report["note"] == "test" and report["machine"]["cpu_count"] >= 1 and not report["failures"]
    assert report["command"].startswith("specray bench serve --limit 3")
    served = [e for e in report["engines"] if e["path"] == "http"]  # the default path: the replica serves HTTP
    assert [e["model"]["specray"]["http_ingress"] for e in served] == ["direct"], served
    points = {(p["path"], p["concurrency"]): p for p in report["points"]}
    assert set(points) == {(path, c) for path in ("http", "inprocess") for c in (1, 2)}
    for p in points.values():
        # the set once, and at c=2 two requests a client: the set cycled to 4
        assert p["num_requests"] == max(3, 2 * p["concurrency"]), p
        # the engine's counters over the run, through /server_info for HTTP
        e = p["engine"]
        assert e["steps"] > 0 and 0 < e["busy"] <= 1.01 and e["step_ms"] > 0, p
        assert p["drafter"] is True and p["temperature"] == 0.0 and p["errors"] == 0
        assert p["output_tok_s"] > 0 and p["request_throughput"] > 0 and p["output_tokens"] > 0
        assert p["ttft_p50_ms"] > 0 and p["itl_p50_ms"] > 0 and p["mean_acceptance_length"] >= 1
        for k in ("ttft_p99_ms", "itl_p99_ms", "chunk_gap_p50_ms"):
            assert p[k] > 0
        # the engine's times against the client's (one host, one clock): each part of the TTFT non-negative
        t = p["transport"]
        assert min(t.values()) >= 0 and t["engine_ttft_ms"] > 0 and t["inbound_ms"] < p["ttft_p99_ms"], p
        # HTTP's legs also split at the replica (its clock is the host's too)
        assert ("to_replica_ms" in t and "end_replica_to_client_ms" in t) == (p["path"] == "http"), t
    for c in (1, 2):
        http, local = points["http", c]["requests"], points["inprocess", c]["requests"]
        assert [r["id"] for r in http] == [r["id"] for r in local]
        for a, b in zip(http, local):
            assert a["text"] and a["text"] == b["text"] and a["token_ids"] == b["token_ids"]
            assert a["output_tokens"] == len(a["token_ids"])  # the usage chunk's count is the tokens streamed
    rat = report["ratios"]["http_over_inprocess"]
    assert [(r["concurrency"], r["identical_outputs"]) for r in rat] == [(1, 3), (2, 3)]
