"""The serving benchmark's figures: one point per (path, drafter,
temperature, concurrency) from its requests' timings, the ratios between
points, the printed table and the plot."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from specray.load_client import RequestResult
from specray.phase_timer import per_cycle

# What the latency figures mean (stored in the JSON beside them).
DEFINITIONS = {
    "ttft": "request sent -> first chunk that carries tokens",
    "itl": "per token: each chunk's gap since the previous token-bearing chunk, divided by the tokens it "
           "carries, counted once per token (a speculative step sends several tokens in one chunk)",
    "chunk_gap": "per chunk: gap between consecutive token-bearing chunks (vLLM's ITL)",
    "tpot": "per request: (latency - ttft) / (output tokens - 1), averaged over requests",
    "output_tok_s": "output tokens of all requests / wall seconds from the first send to the last completion",
    "output_tokens": "HTTP: the final usage chunk's completion_tokens; in process: tokens generated",
    "mean_acceptance_length": "tokens per decode step over all steps of all requests (accepted drafts + 1)",
    "transport": "p50 over requests, ms, from the engine's own times (its host's monotonic clock, the client's "
                 "too when both run on one host): inbound = sent -> the engine took it, engine_ttft = taken -> "
                 "first token, outbound = first token -> its chunk at the client, done = the engine ended it -> "
                 "the stream's end at the client; null where the server sent no times. HTTP streams split each "
                 "leg at the Serve replica (its times in the last chunk's specray.replica_times): to_replica + "
                 "replica_to_engine = inbound, engine_to_replica + replica_to_client = outbound, end_to_replica + "
                 "end_replica_to_client = done",
    "engine": "the engine's own counters over the timed run (HTTP: GET /server_info before and after): steps, "
              "busy = time in steps / wall time, step_ms = mean step wall time, async_gpu_ms = GPU time of an "
              "asynchronous step where timed, sync_step_ms = mean wall time of the synchronous steps, cycles = "
              "the asynchronous cycles by the kind and padded size of the step they applied (8a: autoregressive "
              "at 8 rows, 8s: the whole block, 8s3: 3 drafts; +join: requests joined in it): count, mean wall "
              "ms, mean GPU ms (0: not timed), tokens emitted",
}


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float) -> float:
    return round(x * 1e3, 3) if not math.isnan(x) else x


@dataclass
class Point:
    path: str  # "http" | "inprocess"
    drafter: bool
    temperature: float
    concurrency: int
    num_requests: int
    errors: int
    output_tokens: int
    duration_s: float
    request_throughput: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_mean_ms: float
    chunk_gap_p50_ms: float
    chunk_gap_p99_ms: float
    tpot_mean_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    tokens_per_chunk: float
    mean_acceptance_length: float
    decode_steps: int
    load_average_1m: float | None = None  # the machine's, at the point's end (a shared machine's noise)
    skipped: int = 0  # requests never sent: the point gave up (see aborted)
    aborted: str | None = None
    error_samples: list[str] = field(default_factory=list)
    requests: list[dict] | None = None  # per request, with --save-outputs
    engine: dict | None = None  # the engine's own counters over the timed run (engine_counters)
    transport: dict | None = None  # DEFINITIONS["transport"]

    def key(self) -> tuple:
        return self.path, self.drafter, self.temperature, self.concurrency

    def as_dict(self) -> dict:
        d = asdict(self)
        if d["requests"] is None:
            del d["requests"]
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def summarize(path: str, drafter: bool, temperature: float, concurrency: int, results: list[RequestResult],
              wall_s: float, save_outputs: bool = False, skipped: int = 0, aborted: str | None = None) -> Point:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itl_per_token()]
    gaps = [x for r in ok for x in r.chunk_gaps()]
    lats = [r.latency for r in ok if r.latency is not None]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
             if r.ttft is not None and r.latency is not None and r.output_tokens > 1]
    steps = [a for r in ok for a in r.acceptance_lengths]
    chunks = sum(len(r.chunk_tokens) for r in ok)
    tokens = sum(r.output_tokens for r in ok)
    point = Point(
        path=path, drafter=drafter, temperature=temperature, concurrency=concurrency,
        num_requests=len(results), errors=len(results) - len(ok), output_tokens=tokens,
        duration_s=round(wall_s, 4),
        request_throughput=round(len(ok) / wall_s, 4) if wall_s > 0 else 0.0,
        output_tok_s=round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        ttft_p50_ms=_ms(percentile(ttfts, 50)), ttft_p99_ms=_ms(percentile(ttfts, 99)),
        ttft_mean_ms=_ms(sum(ttfts) / len(ttfts) if ttfts else math.nan),
        itl_p50_ms=_ms(percentile(itls, 50)), itl_p99_ms=_ms(percentile(itls, 99)),
        itl_mean_ms=_ms(sum(itls) / len(itls) if itls else math.nan),
        chunk_gap_p50_ms=_ms(percentile(gaps, 50)), chunk_gap_p99_ms=_ms(percentile(gaps, 99)),
        tpot_mean_ms=_ms(sum(tpots) / len(tpots) if tpots else math.nan),
        latency_p50_ms=_ms(percentile(lats, 50)), latency_p99_ms=_ms(percentile(lats, 99)),
        tokens_per_chunk=round(sum(len(r.token_ids) for r in ok) / chunks, 4) if chunks else 0.0,
        mean_acceptance_length=round(sum(steps) / len(steps), 4) if steps else 0.0,
        decode_steps=len(steps), skipped=skipped, aborted=aborted,
        error_samples=list(dict.fromkeys(r.error for r in results if r.error))[:5],
        transport=transport_p50(ok),
    )
    if save_outputs:
        point.requests = [{"id": r.id, "output_tokens": r.output_tokens, "text": r.text, "token_ids": r.token_ids,
                           "ttft_ms": _ms(r.ttft) if r.ttft is not None else None,
                           "latency_ms": _ms(r.latency) if r.latency is not None else None, "error": r.error}
                          for r in sorted(results, key=lambda r: r.id)]
    return point


def transport_p50(results: list[RequestResult]) -> dict | None:
    parts = [t for t in (r.transport() for r in results) if t is not None]
    if not parts:
        return None
    keys = dict.fromkeys(k for t in parts for k in t)  # the replica's legs: HTTP streams only
    return {f"{k}_ms": _ms(percentile([t[k] for t in parts if k in t], 50)) for k in keys}


def engine_counters(before: dict | None, after: dict | None, wall_s: float) -> dict | None:
    """What the engine did over a point's timed run, from its stats
    (``EngineLoop.stats()``) before and after: its steps, the share of the
    run's wall time it spent in them (``busy``: below the in-process
    engine's, it waited on the serving path for work), a step's mean wall
    time, and its asynchronous steps' GPU time where they are timed."""
    if not before or not after or wall_s <= 0:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0)
         for k in ("num_steps", "num_async_steps", "chain_joins", "step_time_s", "async_wall_s", "async_gpu_s")}
    steps, async_steps = d["num_steps"], d["num_async_steps"]
    sync_steps = steps - async_steps
    return {"steps": steps, "async_steps": async_steps, "chain_joins": d["chain_joins"],
            "busy": round(d["step_time_s"] / wall_s, 4),
            "step_ms": round(1e3 * d["step_time_s"] / steps, 4) if steps else None,
            "async_gpu_ms": round(1e3 * d["async_gpu_s"] / async_steps, 4) if async_steps and d["async_gpu_s"] else None,
            "sync_step_ms": round(1e3 * (d["step_time_s"] - d["async_wall_s"]) / sync_steps, 4) if sync_steps else None,
            "cycles": cycle_deltas(before.get("cycle_costs") or {}, after.get("cycle_costs") or {}),
            # Ray backend: rank 0's actor methods called over the point (none where the engine channel carries it)
            "actor_calls": {k: n - (before.get("calls") or {}).get(k, 0) for k, n in after["calls"].items()}
            if after.get("calls") else None,
            # with SPECRAY_PHASES=1 in the engine's environment: host ms per step() call by kind and function
            "phases": per_cycle(after["phases"], before.get("phases")) if after.get("phases") else None}


def cycle_deltas(before: dict, after: dict) -> dict:
    """The async cycles of a point by kind (``EngineCore._count_cycle``):
    count, mean wall and GPU ms, tokens emitted."""
    out = {}
    for key, (n, wall, gpu, tokens) in sorted(after.items()):
        n0, wall0, gpu0, tokens0 = before.get(key, (0, 0.0, 0.0, 0))
        if n > n0:
            out[key] = [n - n0, round(1e3 * (wall - wall0) / (n - n0), 4), round(1e3 * (gpu - gpu0) / (n - n0), 4),
                        tokens - tokens0]
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def ratios(points: list[Point], outputs: dict[tuple, dict[str, list[int]]]) -> dict:
    """``http_over_inprocess`` per (drafter, temperature, concurrency), with
    how many requests got the same tokens on both paths; ``spec_over_ar``
    per (path, temperature, concurrency)."""
    by = {p.key(): p for p in points if not p.aborted}
    http_in, spec_ar = [], []
    for (path, drafter, temp, conc), p in sorted(by.items()):
        if path == "http" and ("inprocess", drafter, temp, conc) in by:
            q = by["inprocess", drafter, temp, conc]
            a, b = outputs.get(p.key(), {}), outputs.get(q.key(), {})
            same = sum(a[i] == b[i] for i in a.keys() & b.keys())
            http_in.append({"drafter": drafter, "temperature": temp, "concurrency": conc,
                            "output_tok_s": _ratio(p.output_tok_s, q.output_tok_s),
                            "identical_outputs": same, "compared": len(a.keys() & b.keys())})
        if drafter and (path, False, temp, conc) in by:
            q = by[path, False, temp, conc]
            spec_ar.append({"path": path, "temperature": temp, "concurrency": conc,
                            "output_tok_s": _ratio(p.output_tok_s, q.output_tok_s)})
    return {"http_over_inprocess": http_in, "spec_over_ar": spec_ar}


def table(points: list[Point], rat: dict) -> str:
    head = (f"{'path':<9} {'drafter':<7} {'T':>4} {'conc':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>8} "
            f"{'p99':>8} {'ITL p50':>8} {'p99':>8} {'gap p50':>8} {'accept':>6} {'reqs':>4} {'err':>3}")
    lines = [head + "   (ms)", "-" * len(head)]
    for p in sorted(points, key=lambda p: (p.temperature, p.path, not p.drafter, p.concurrency)):
        lines.append(f"{p.path:<9} {'on' if p.drafter else 'off':<7} {p.temperature:>4g} {p.concurrency:>4} "
                     f"{p.request_throughput:>7.2f} {p.output_tok_s:>9.1f} {_f(p.ttft_p50_ms)} {_f(p.ttft_p99_ms)} "
                     f"{_f(p.itl_p50_ms)} {_f(p.itl_p99_ms)} {_f(p.chunk_gap_p50_ms)} "
                     f"{p.mean_acceptance_length:>6.2f} {p.num_requests:>4} {p.errors:>3}"
                     + ("  ABORTED" if p.aborted else ""))
    for r in rat["http_over_inprocess"]:
        lines.append(f"http / inprocess  drafter {'on ' if r['drafter'] else 'off'} T={r['temperature']:g} "
                     f"c={r['concurrency']}: {_x(r['output_tok_s'])}  (same tokens {r['identical_outputs']}/"
                     f"{r['compared']})")
    for r in rat["spec_over_ar"]:
        lines.append(f"spec / AR  {r['path']:<9} T={r['temperature']:g} c={r['concurrency']}: "
                     f"{_x(r['output_tok_s'])}")
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return f"{x:>8.1f}" if x is not None and not math.isnan(x) else f"{'-':>8}"


def _x(r: float | None) -> str:
    return f"{r:.3f}x" if r is not None else "-"


def plot(points: list[Point], path: str, title: str) -> None:
    """Output tok/s against concurrency, a line per (path, drafter), a
    panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({p.temperature for p in points})
    fig, axes = plt.subplots(1, len(temps), figsize=(max(7.0, 5.5 * len(temps)), 4.4), squeeze=False)
    styles = {("http", True): ("C0", "-"), ("inprocess", True): ("C0", "--"),
              ("http", False): ("C1", "-"), ("inprocess", False): ("C1", "--")}
    for ax, temp in zip(axes[0], temps):
        for (path_, drafter), (color, ls) in styles.items():
            pts = sorted((p for p in points if p.temperature == temp and p.path == path_ and p.drafter == drafter),
                         key=lambda p: p.concurrency)
            if pts:
                ax.plot([p.concurrency for p in pts], [p.output_tok_s for p in pts], color=color, linestyle=ls,
                        marker="o", label=f"{path_}, drafter {'on' if drafter else 'off'}")
        concs = sorted({p.concurrency for p in points})
        if len(concs) > 1 and concs[-1] / concs[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"T = {temp:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
