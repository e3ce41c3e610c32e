"""Serving metrics through ``ray.util.metrics``.

Ray exports application metrics from every node's metrics agent at
``http://<node>:<metrics_export_port>/metrics`` (``ray start
--metrics-export-port=PORT``; ``ray.nodes()[i]["MetricsExportPort"]`` tells
the port when Ray chose it). Ray's Prometheus exporter puts its own ``ray_``
namespace in front of every name, so ``specray_requests`` is scraped as
``ray_specray_requests_total``. Every metric carries a ``model`` tag.

The speculative counters mirror vLLM's ``vllm:spec_decode_*`` family:
drafts (decode steps that verified drafts), draft tokens, accepted tokens,
and accepted tokens per draft position (``position`` tag, 0-based).
"""

from __future__ import annotations

from specray.request import RequestOutput

TTFT_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


class ServeMetrics:
    def __init__(self, model: str):
        from ray.util import metrics as m

        self.model = model
        tags = {"model": model}
        self.requests = m.Counter(
            "specray_requests", "Requests finished, by endpoint and status (HTTP code or gRPC code name).",
            tag_keys=("model", "endpoint", "status"))
        self.ttft = m.Histogram(
            "specray_time_to_first_token_seconds", "Time from receiving a request to its first token.",
            boundaries=TTFT_BUCKETS, tag_keys=("model",))
        self.tpot = m.Histogram(
            "specray_time_per_output_token_seconds",
            "Mean time between output tokens of a request (after the first).",
            boundaries=TPOT_BUCKETS, tag_keys=("model",))
        self.in_flight = m.Gauge(
            "specray_num_requests_in_flight", "Generation requests admitted by this replica and not finished.",
            tag_keys=("model",))
        self.waiting = m.Gauge(
            "specray_num_requests_waiting", "Requests queued in the engine's scheduler (not yet running).",
            tag_keys=("model",))
        self.running = m.Gauge(
            "specray_num_requests_running", "Requests in the engine's running batch.", tag_keys=("model",))
        self.rejected = m.Counter(
            "specray_requests_rejected", "Requests refused by backpressure (HTTP 429 / RESOURCE_EXHAUSTED).",
            tag_keys=("model", "endpoint"))
        self.num_drafts = m.Counter(
            "specray_spec_decode_num_drafts", "Decode steps that verified drafted tokens.", tag_keys=("model",))
        self.num_draft_tokens = m.Counter(
            "specray_spec_decode_num_draft_tokens", "Drafted tokens verified by the target.", tag_keys=("model",))
        self.num_accepted_tokens = m.Counter(
            "specray_spec_decode_num_accepted_tokens", "Drafted tokens the target accepted.", tag_keys=("model",))
        self.num_lookup_drafts = m.Counter(
            "specray_spec_decode_num_lookup_drafts",
            "Decode steps whose drafts came from prompt lookup instead of the drafter.", tag_keys=("model",))
        self.accepted_per_pos = m.Counter(
            "specray_spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each draft position (0 = first draft token).",
            tag_keys=("model", "position"))
        self.generation_tokens = m.Counter(
            "specray_generation_tokens", "Tokens generated.", tag_keys=("model",))
        self.prompt_tokens = m.Counter(
            "specray_prompt_tokens", "Prompt tokens of admitted requests.", tag_keys=("model",))
        self.drafter_up = m.Gauge(
            "specray_drafter_up", "1 while the drafter serves, 0 while steps run without it (degraded).",
            tag_keys=("model",))
        self.engine_up = m.Gauge(
            "specray_engine_up", "1 while the engine serves, 0 while it is rebuilt or cannot serve.",
            tag_keys=("model",))
        self.drafter_losses = m.Counter(
            "specray_drafter_losses", "Drafters lost (dead, stopped answering or failed).", tag_keys=("model",))
        self.engine_rebuilds = m.Counter(
            "specray_engine_rebuilds", "Target groups rebuilt after a lost rank.", tag_keys=("model",))
        self._seen = {"losses": 0, "rebuilds": 0}
        for metric in (self.drafter_up, self.engine_up, self.drafter_losses, self.engine_rebuilds,
                       self.ttft, self.tpot, self.in_flight, self.waiting, self.running, self.num_drafts,
                       self.num_draft_tokens, self.num_accepted_tokens, self.num_lookup_drafts, self.generation_tokens,
                       self.prompt_tokens):
            metric.set_default_tags(tags)
        self.in_flight.set(0)

    def request_done(self, endpoint: str, status: int | str) -> None:
        self.requests.inc(1, {"model": self.model, "endpoint": endpoint, "status": str(status)})

    def rejected_request(self, endpoint: str) -> None:
        self.rejected.inc(1, {"model": self.model, "endpoint": endpoint})

    def engine_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def engine_health(self, h: dict) -> None:
        """Gauges and counters from ``AsyncEngine.health()``."""
        self.engine_up.set(1 if h.get("engine", "ok") == "ok" and h.get("loop", "running") == "running" else 0)
        drafter = h.get("drafter") or {}
        if drafter.get("state", "none") != "none":
            self.drafter_up.set(1 if drafter["state"] == "up" else 0)
        for key, counter, value in (("losses", self.drafter_losses, drafter.get("losses", 0)),
                                    ("rebuilds", self.engine_rebuilds, h.get("rebuilds", 0))):
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
            self._seen[key] = value


class RequestTracker:
    """Latency and speculative counters of one request, fed each output;
    counters advance by what is new since the previous output."""

    def __init__(self, metrics: ServeMetrics, start: float, count_prompt: bool = True):
        self.m = metrics
        self.start = start
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.steps = 0
        self.drafts = 0
        self.accepted = 0
        self.lookups = 0
        self.per_pos: list[int] = []
        self.prompt_counted = not count_prompt  # one choice of n counts the shared prompt

    def update(self, out: RequestOutput, now: float) -> None:
        m = self.m
        if not self.prompt_counted:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prompt_counted = True
        n = len(out.token_ids)
        if n > self.tokens:
            if self.first is None:
                self.first = now
                m.ttft.observe(now - self.start)
            m.generation_tokens.inc(n - self.tokens)
            self.tokens, self.last = n, now
        met = out.metrics
        if met.num_draft_tokens > self.drafts:
            steps = len(met.acceptance_lengths)
            if steps > self.steps:
                m.num_drafts.inc(steps - self.steps)
            m.num_draft_tokens.inc(met.num_draft_tokens - self.drafts)
            if met.num_accepted_tokens > self.accepted:
                m.num_accepted_tokens.inc(met.num_accepted_tokens - self.accepted)
            for pos, count in enumerate(met.accepted_per_position):
                before = self.per_pos[pos] if pos < len(self.per_pos) else 0
                if count > before:
                    m.accepted_per_pos.inc(count - before, {"model": m.model, "position": str(pos)})
            if met.num_lookup_steps > self.lookups:
                m.num_lookup_drafts.inc(met.num_lookup_steps - self.lookups)
                self.lookups = met.num_lookup_steps
            self.steps, self.drafts, self.accepted = steps, met.num_draft_tokens, met.num_accepted_tokens
            self.per_pos = list(met.accepted_per_position)
        if out.finished and self.first is not None and self.tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.tokens - 1))
