"""The specray Ray Serve application: one deployment (FastAPI ingress) that
owns an AsyncEngine and serves OpenAI-compatible HTTP and the specray.v1
gRPC service.

Engine placement: the replica starts the engine with ``backend="ray"``: the
target TP group and the drafter run as Ray actors in their own placement
group, owned by the replica (they die with it). The replica itself only
parses, tokenizes chat prompts, streams and counts; it asks for CPUs
(``replica_num_cpus``), never a GPU. ``backend="inprocess"`` stays available
(the replica then holds the model and, on CUDA, one GPU).

Backpressure: a replica admits at most ``max_num_seqs + max_queued_requests``
generation requests at once (a request counts from admission until its
stream ends, however it ends); beyond that HTTP answers 429 with
``Retry-After`` and gRPC RESOURCE_EXHAUSTED, immediately. Serve's own
per-replica ``max_ongoing_requests`` is set above that bound (room for
/health and /v1/models) and its router queue is bounded too
(``max_queued_requests`` of the deployment), so nothing queues without limit.

Disconnects: a client that goes aborts its engine request and frees its
slot however the request ends (``specray.serve.lease``).

Streaming responses start with the first token: the prompt is validated by
the engine at submit, so a bad prompt still gets a 400 rather than an error
inside a 200 stream.

The settings (``ServeArgs``) are ``specray.serve.settings``; the gRPC
methods are ``specray.serve.grpc_service``, a base class of the deployment.
"""

import asyncio
import hmac
import inspect
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from specray.serve import limits as L
from specray.serve import openapi
from specray.serve import protocol as P
from specray.serve.grpc_service import GrpcService
from specray.serve.lease import EngineStream, Lease, detached, release_all, set_status, shielded
from specray.serve.settings import ServeArgs, _resolve

log = logging.getLogger("specray.serve")

GRPC_SERVICER_FUNCTIONS = ["specray.serve.specray_pb2_grpc.add_SpecRayServicer_to_server"]
# Serve-level in-flight room per replica beyond the generation bound, for
# /health, /v1/models, rejected requests on their way out and handle calls.
_HEADROOM = 32


# ------------------------------------------------------------- FastAPI app
app = FastAPI(title="specray", description="OpenAI-compatible API with DFlash speculative decoding",
              docs_url="/docs", redoc_url=None)


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(P.APIError)
async def _api_error(request: Request, e: P.APIError):
    return _error_response(e)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    msg = f"Unknown route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
    return _error_response(P.APIError(e.status_code, msg, "invalid_request_error", None, code))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    errors = [dict(err, loc=tuple(err.get("loc", ()))[1:]) for err in e.errors()]  # drop "body" / "query"
    return _error_response(P.from_validation_error(errors) if errors else P.bad_request("invalid request"))


@app.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception):
    log.exception("unhandled error")
    return _error_response(P.APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))


@serve.deployment
@serve.ingress(app)
class SpecRayServer(GrpcService):
    def __init__(self, settings: dict):
        from specray.async_engine import AsyncEngine
        from specray.config import TargetSpec
        from specray.detokenizer import load_tokenizer, max_prompt_bytes, max_prompt_chars
        from specray.engine_loop import freeze_startup_heap
        from specray.llm import resolve_max_model_len
        from specray.priority import normal_priority
        from specray.serve.loopback import bind_replica_server_to_node_ip
        from specray.serve.metrics import ServeMetrics

        bind_replica_server_to_node_ip()
        normal_priority()
        s = ServeArgs.model_validate(settings)
        if s.api_key is None:
            s = s.model_copy(update={"api_key": os.environ.get("SPECRAY_API_KEY") or None})
        self.settings = s
        self.model_name = s.model_name
        config = s.engine_config()
        self.max_model_len = resolve_max_model_len(config, TargetSpec.from_dir(config.target))
        self.tokenizer = load_tokenizer(config.target)
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specray-tokenize")
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len - 1)
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, self.max_model_len - 1)
        openapi.publish_context(self.max_model_len)
        self.engine = AsyncEngine.from_config(config, backend=s.backend, tensor_parallel_size=s.tensor_parallel_size,
                                              drafter_placement=s.drafter_placement)
        self.limit = s.max_in_flight
        self.in_flight = 0
        self.created = int(time.time())
        self.metrics = ServeMetrics(self.model_name)
        self._poller: asyncio.Task | None = None
        self.features = self.engine.stats().get("features", {})
        # Serve reads this from the environment Ray started with (`specray serve` sets it, docs/serving.md).
        self.http_ingress = "direct" if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1" else "proxy"
        # Ray, Serve, FastAPI and the tokenizer leave ~400k objects here; a
        # full collection walked them all (180 ms on a CI core) mid-stream.
        freeze_startup_heap()
        log.info("specray replica ready: model %s, backend %s, tp %d, drafter %s (%s), in-flight bound %d, "
                 "HTTP %s", self.model_name, s.backend, s.tensor_parallel_size, config.drafter,
                 s.drafter_placement, self.limit, self.http_ingress)

    # ------------------------------------------------------------ lifecycle
    async def __del__(self):
        if self._poller is not None:
            self._poller.cancel()
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)
        parent = getattr(super(), "__del__", None)  # the ASGI wrapper's lifespan shutdown
        if parent is not None:
            result = parent()
            if inspect.isawaitable(result):
                await result

    async def check_health(self) -> None:
        """Serve's periodic health check: raises (Serve replaces the
        replica) where the engine will not recover by itself (health.py)."""
        from specray.serve.health import check

        s = self.settings
        check(await asyncio.wait_for(asyncio.to_thread(self.engine.health), timeout=30), s.stuck_step_s,
              s.rebuild_grace_s)

    async def engine_stats(self) -> dict:
        """Engine and admission state (for operators and tests, via a Serve
        handle: ``serve.get_app_handle(name).engine_stats.remote()``)."""
        stats = await asyncio.to_thread(self.engine.stats)
        stats["in_flight"] = self.in_flight
        stats["max_in_flight"] = self.limit
        return stats

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(detached(self._poll_engine_load()))

    async def _poll_engine_load(self) -> None:
        """Running / waiting and health gauges, from one call a second
        (never per step)."""
        while True:
            try:
                h = await asyncio.to_thread(self.engine.health)
                self.metrics.engine_load(h.get("running", 0), h.get("waiting", 0))
                self.metrics.engine_health(h)
            except Exception:  # the health check reports a dead engine
                pass
            await asyncio.sleep(1.0)

    # ---------------------------------------------------------- admission
    def _admit(self, endpoint: str, n: int = 1) -> list[Lease]:
        """Slots for a request's ``n`` engine requests (its choices), all or
        none; the first lease reports the request to the metrics."""
        self._ensure_poller()
        if n > self.limit:
            raise P.bad_request(f"n ({n}) exceeds what this server runs at once ({self.limit})", "n",
                                "invalid_value")
        if self.in_flight + n > self.limit:
            self.metrics.rejected_request(endpoint)
            raise P.APIError(
                429, f"The server is at capacity ({self.limit} requests in flight on this replica); "
                     f"retry after {self.settings.retry_after_s} s.",
                "rate_limit_exceeded", None, "rate_limit_exceeded",
                headers={"Retry-After": str(self.settings.retry_after_s)})
        self.in_flight += n
        self.metrics.in_flight.set(self.in_flight)
        return [Lease(self, endpoint, reports=i == 0) for i in range(n)]

    def _release(self, lease: Lease) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if lease.reports:
            self.metrics.request_done(lease.endpoint, lease.status)

    def _check_key(self, supplied: str | None) -> None:
        key = self.settings.api_key
        if not key:
            return
        if supplied is None:
            raise P.APIError(401, "You didn't provide an API key. Pass it as 'Authorization: Bearer <key>'.",
                             "invalid_request_error", None, "invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(supplied.encode(), key.encode()):
            raise P.APIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})

    def _check_http_key(self, request: Request) -> None:
        auth = request.headers.get("authorization")
        supplied = None
        if auth:
            scheme, _, value = auth.partition(" ")
            supplied = value.strip() if scheme.lower() == "bearer" else ""
        self._check_key(supplied)

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise P.APIError(404, f"The model '{model}' does not exist (this server serves '{self.model_name}').",
                             "invalid_request_error", "model", "model_not_found")

    # ------------------------------------------------------------- prompts
    async def _chat_prompt(self, messages: list[dict]) -> list[int]:
        """The messages through the chat template, tokenized on the
        replica's one tokenizing thread: on the event loop a long prompt
        would hold every other stream of the replica, and a fast tokenizer
        is not safe to share between threads."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise P.bad_request("This model has no chat template; send a plain prompt (/v1/completions, or the gRPC "
                                 "prompt field).", "messages")
        ids = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._render_chat, messages)
        if len(ids) >= self.max_model_len:
            raise P.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the messages take "
                f"{len(ids)} tokens, leaving none to generate.", "messages", "context_length_exceeded")
        return ids

    def _check_prompt_length(self, prompt) -> None:
        """Refuses here what the engine would refuse by its length alone:
        the engine would first receive the whole prompt and walk every id
        (seconds for a few million, every stream of the engine slowed)."""
        from specray.request import PromptTooLong, check_prompt_length

        if isinstance(prompt, str):
            L.check_prompt_bytes(prompt, self.max_prompt_bytes, self.max_model_len, "prompt")
        try:
            check_prompt_length(prompt, self.max_model_len, self.max_prompt_chars)
        except PromptTooLong as e:
            raise P.prompt_error(e, "prompt") from None

    def _render_chat(self, messages: list[dict]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja TemplateError and friends
            raise P.bad_request(f"The chat template rejected the messages: {e}", "messages") from None
        L.check_prompt_bytes(text, self.max_prompt_bytes, self.max_model_len, "messages")
        if len(text) > self.max_prompt_chars:
            raise P.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the rendered messages "
                f"have {len(text)} characters, more than that many tokens can spell.", "messages",
                "context_length_exceeded")
        # The template writes its own special tokens (BOS included).
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---------------------------------------------------------------- HTTP
    @app.get("/health")
    async def health(self):
        from specray.serve.health import http_health

        self._ensure_poller()  # the health gauges, before any request came
        try:
            h = await asyncio.wait_for(asyncio.to_thread(self.engine.health), timeout=5)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "error": str(e)}, status_code=503)
        status, body = http_health(h)
        return JSONResponse(body, status_code=status)

    def _timeout(self, asked: float | None) -> float | None:
        limit = self.settings.request_timeout_s
        return asked if limit is None else min(asked or limit, limit)

    def _model_card(self) -> dict:
        s = self.settings
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specray",
                "root": s.target, "parent": None, "max_model_len": self.max_model_len,
                "specray": {"drafter": s.drafter, "tensor_parallel_size": s.tensor_parallel_size,
                            "drafter_placement": s.drafter_placement, "backend": s.backend,
                            "http_ingress": self.http_ingress, "features": self.features}}

    @app.get("/v1/models")
    async def list_models(self, request: Request):
        try:
            self._check_http_key(request)
        except P.APIError as e:
            self.metrics.request_done("models", e.status)
            return _error_response(e)
        self.metrics.request_done("models", 200)
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(self, model: str, request: Request):
        try:
            self._check_http_key(request)
            self._check_model(model)
        except P.APIError as e:
            self.metrics.request_done("models", e.status)
            return _error_response(e)
        self.metrics.request_done("models", 200)
        return self._model_card()

    @app.get("/server_info")
    async def server_info(self, request: Request):
        """The engine's counters (steps, their wall and GPU time, joins, the
        policy's choices, pools): read before and after a benchmark's run,
        they tell the engine's time from the serving path's."""
        try:
            self._check_http_key(request)
            stats = await asyncio.wait_for(asyncio.to_thread(self.engine.stats), timeout=10)
        except P.APIError as e:
            self.metrics.request_done("server_info", e.status)
            return _error_response(e)
        except Exception as e:  # the engine lost or rebuilding: /health says which
            return JSONResponse({"status": "unavailable", "error": f"{type(e).__name__}: {e}"}, status_code=503)
        self.metrics.request_done("server_info", 200)
        return {"model": self.model_name, "engine": stats}

    @app.post("/v1/completions", openapi_extra=openapi.completions)
    async def completions(self, request: Request):
        return await self._serve_http(request, "completions")

    @app.post("/v1/chat/completions", openapi_extra=openapi.chat_completions)
    async def chat_completions(self, request: Request):
        return await self._serve_http(request, "chat")

    async def _serve_http(self, request: Request, kind: str):
        start = time.monotonic()
        endpoint = "chat_completions" if kind == "chat" else "completions"
        leases: list[Lease] = []
        try:
            self._check_http_key(request)
            L.check_content_type(request.headers.get("content-type"))
            body = P.parse_json(await L.read_body(request, self.settings.max_request_bytes,
                                                   self.settings.request_body_timeout_s))
            L.check_body(body, self.max_model_len)
            if kind == "chat":
                req = P.parse(P.ChatCompletionRequest, body)
                self._check_model(req.model)
                prompt = await self._chat_prompt(req.chat_messages())
                params = req.sampling_params(req.max_new_tokens(self.max_model_len - len(prompt)))
                rid = P.new_id("chatcmpl")
            else:
                req = P.parse(P.CompletionRequest, body)
                self._check_model(req.model)
                prompt = req.prompt
                self._check_prompt_length(prompt)
                params = req.sampling_params(req.max_new_tokens())
                rid = P.new_id("cmpl")
            # n choices are n engine requests, each holding a slot.
            leases = self._admit(endpoint, req.num_choices)
            timeout = self._timeout(req.timeout)
            for i, lease in enumerate(leases):
                lease.start(prompt, P.choice_params(params, i), rid if i == 0 else f"{rid}-{i}", timeout)
            firsts = []
            try:
                for lease in leases:
                    firsts.append(await lease.next())
            except ValueError as e:  # the engine rejected the prompt
                raise P.prompt_error(e, "messages" if kind == "chat" else "prompt") from None
            except RuntimeError as e:
                raise P.exception_error(e) from None
        except P.APIError as e:
            if not leases:
                self.metrics.request_done(endpoint, e.status)
            else:
                set_status(leases, e.status)
                await shielded(release_all(leases))
            return _error_response(e)
        except BaseException:
            # cancelled (client gone) while waiting for the first tokens
            await shielded(release_all(leases))
            raise

        from specray.serve.metrics import RequestTracker

        trackers = [RequestTracker(self.metrics, start, count_prompt=i == 0) for i in range(len(leases))]
        logprobs = [P.LogprobWriter(self.tokenizer, kind == "chat") if params.logprobs is not None else None
                    for _ in leases]
        if req.stream:
            writer = P.ChunkWriter(kind, rid, self.model_name, req.include_usage, req.return_token_ids, logprobs,
                                   received=start)
            return EngineStream(self._sse(writer, firsts, trackers, leases), leases)
        try:
            outs = []
            for lease, out, tracker in zip(leases, firsts, trackers):
                tracker.update(out, time.monotonic())
                while not out.finished:
                    out = await lease.next()
                    tracker.update(out, time.monotonic())
                if P.finish_reason(out) is None:
                    raise P.output_error(out)
                outs.append(out)
            build = P.chat_response if kind == "chat" else P.completion_response
            set_status(leases, 200)
            return JSONResponse(build(rid, self.model_name, outs, req.return_token_ids, logprobs))
        except P.APIError as e:
            set_status(leases, e.status)
            return _error_response(e)
        except RuntimeError as e:
            err = P.exception_error(e)
            set_status(leases, err.status)
            return _error_response(err)
        finally:
            await shielded(release_all(leases))

    async def _sse(self, writer: P.ChunkWriter, firsts, trackers, leases: list[Lease]):
        # What one wake-up produced goes out in one write (a stream's role
        # chunk with its first tokens, the last tokens with the finish, usage
        # and [DONE] chunks): each write is a trip through Serve's and
        # uvicorn's send path, and the end's trips delay the client's next request.
        pending = list(writer.start())
        finals: dict[int, object] = {}
        waiting: dict[asyncio.Task, int] = {}  # each unfinished choice's next output
        try:
            ready = list(enumerate(firsts))
            while True:
                # The choices advance together, as the engine runs them:
                # chunks go out in the order their outputs arrive.
                for i, out in ready:
                    trackers[i].update(out, time.monotonic())
                    pending += writer.delta(i, out)
                    if not out.finished:
                        waiting[asyncio.ensure_future(leases[i].next())] = i
                    elif P.finish_reason(out) is None:  # the writer ended the stream with an error event
                        set_status(leases, P.output_error(out).status)
                        yield b"".join(pending)
                        return
                    else:
                        finals[i] = out
                if not waiting:
                    break
                if pending:
                    yield b"".join(pending)
                    pending = []
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                ready = [(waiting.pop(task), task.result()) for task in done]
            yield b"".join(pending + writer.end([finals[i] for i in range(len(leases))]))
            set_status(leases, 200)
        except RuntimeError as e:  # the engine failed under us: an error event ends the stream
            err = P.exception_error(e)
            set_status(leases, err.status)
            yield b"".join(pending + [P.sse(err.body())])
        finally:
            for task in waiting:  # a queue's get is safe to cancel: nothing is lost
                task.cancel()


def build_app(args: dict | None = None) -> serve.Application:
    """The specray Serve application, for ``import_path:
    specray.serve:build_app`` in a Serve config (its ``args`` are
    :class:`ServeArgs`) or ``serve.run(build_app({...}))``.

    gRPC is configured on Serve's proxy, not per application: add
    ``specray.serve.GRPC_SERVICER_FUNCTIONS`` to ``grpc_options``."""
    s = _resolve(args)
    # The handlers run on the replica's own event loop, where Serve's direct
    # ingress receives HTTP: on a loop of their own (Serve's default) every
    # request and every streamed chunk crossed threads, ~3-4 ms of time to
    # first token on the development CPU. Nothing blocking runs on the loop
    # (tokenizing and engine calls go to threads).
    actor_options: dict[str, Any] = {"num_cpus": s.replica_num_cpus,
                                     "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}}
    if s.backend == "inprocess" and s.device != "cpu":
        actor_options["num_gpus"] = 1
    bound = s.max_in_flight
    return SpecRayServer.options(
        name=s.deployment_name,
        num_replicas=s.num_replicas,
        max_ongoing_requests=bound + _HEADROOM,
        max_queued_requests=bound + _HEADROOM,
        ray_actor_options=actor_options,
        health_check_period_s=s.health_check_period_s,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=20,
        max_constructor_retry_count=3,  # a bad checkpoint fails the deploy instead of retrying 20 times
    ).bind(s.model_dump())
