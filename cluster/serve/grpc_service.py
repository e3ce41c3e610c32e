"""The specray.v1 gRPC service (``specray.proto``): Generate (server
streaming) and ListModels, as methods of the Serve deployment, which Serve's
proxy calls by name. The requests go through the same admission, API key,
prompt limits and engine leases as HTTP (the deployment's own methods);
what is gRPC's alone lives here: protobuf in and out, and the API's errors
as gRPC status codes."""

import time

from pydantic import ValidationError

from specray.serve import limits as L
from specray.serve import protocol as P
from specray.serve.lease import shielded

# 413: gRPC answers a message over its size limit with RESOURCE_EXHAUSTED.
_GRPC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
               429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class _GrpcAbort(Exception):
    pass


class GrpcService:
    """The gRPC methods of ``SpecRayServer`` (a base class of it): they use
    its admission (``_admit``), checks (``_check_key``, ``_check_model``,
    ``_check_prompt_length``), chat rendering (``_chat_prompt``), time limit
    (``_timeout``), ``settings``, ``metrics`` and ``max_model_len``."""

    def _grpc_fail(self, grpc_context, e: P.APIError, endpoint: str):
        import grpc

        code = getattr(grpc.StatusCode, _GRPC_CODES.get(e.status, "UNKNOWN"))
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(e.message)
        raise _GrpcAbort(e.message)

    def _grpc_key(self, grpc_context) -> None:
        supplied = None
        if grpc_context is not None:
            for k, v in grpc_context.invocation_metadata():
                if k.lower() == "authorization":
                    scheme, _, value = str(v).partition(" ")
                    supplied = value.strip() if scheme.lower() == "bearer" else ""
        self._check_key(supplied)

    async def _grpc_inputs(self, request):
        from specray.sampling import SamplingParams

        # Serve's proxy takes messages up to 2 GB; hold them to the bound HTTP bodies have.
        size, limit = request.ByteSize(), self.settings.max_request_bytes
        if size > limit:
            raise P.APIError(413, f"The request has {size} bytes; this server takes at most {limit}.",
                             "invalid_request_error", None, "request_too_large")
        self._check_model(request.model or None)
        L.check_grpc(request, self.max_model_len)
        which = request.WhichOneof("input")
        if which is None:
            raise P.bad_request("one of prompt, prompt_token_ids or messages is required", "input")
        if which == "prompt":
            prompt = request.prompt
            self._check_prompt_length(prompt)
        elif which == "prompt_token_ids":
            self._check_prompt_length(request.prompt_token_ids.ids)
            prompt = list(request.prompt_token_ids.ids)
        else:
            try:
                msgs = [P.ChatMessage(role=m.role, content=m.content) for m in request.messages.messages]
            except ValidationError as e:
                raise P.from_validation_error(e) from None
            if not msgs:
                raise P.bad_request("messages is empty", "messages")
            prompt = await self._chat_prompt([{"role": "system" if m.role == "developer" else m.role,
                                         "content": m.content} for m in msgs])
        p = request.params
        try:
            params = SamplingParams(
                max_tokens=p.max_tokens if p.HasField("max_tokens") else self.max_model_len,
                temperature=p.temperature if p.HasField("temperature") else 1.0,
                top_p=p.top_p if p.HasField("top_p") else 1.0,
                top_k=p.top_k if p.HasField("top_k") else 0,
                seed=p.seed if p.HasField("seed") else None,
                stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                min_tokens=p.min_tokens, logprobs=p.logprobs if p.HasField("logprobs") else None,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0)
        except ValueError as e:
            raise P.sampling_error(e) from None
        return prompt, params

    async def Generate(self, request, grpc_context=None):
        """specray.v1.SpecRay/Generate (server streaming)."""
        from specray.serve import specray_pb2 as pb
        from specray.serve.metrics import RequestTracker

        start = time.monotonic()
        endpoint = "grpc_generate"
        try:
            self._grpc_key(grpc_context)
            prompt, params = await self._grpc_inputs(request)
            lease, = self._admit(endpoint)
        except P.APIError as e:
            self.metrics.request_done(endpoint, _GRPC_CODES.get(e.status, "UNKNOWN"))
            self._grpc_fail(grpc_context, e, endpoint)
        # The client's id names its stream; the engine's is always fresh, so
        # clients choosing the same id never collide.
        engine_rid = P.new_id("grpc")
        rid = request.request_id or engine_rid
        tracker = RequestTracker(self.metrics, start)
        try:
            remaining = getattr(grpc_context, "time_remaining", None)  # Serve's context has none (2.60)
            left = remaining() if callable(remaining) else None
            lease.start(prompt, params, engine_rid, self._timeout(left if left and left > 0 else None))
            try:
                while True:
                    out = await lease.next()
                    tracker.update(out, time.monotonic())
                    msg = pb.GenerateResponse(request_id=rid, text=out.delta_text, token_ids=out.delta_token_ids,
                                              finished=out.finished)
                    for e in out.delta_logprobs or ():
                        msg.logprobs.add(token_id=e.token_id, logprob=e.logprob,
                                         top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
                    if out.finished:
                        if P.finish_reason(out) is None:
                            raise P.output_error(out)
                        st = P.spec_stats([out])
                        u = P.usage([out])
                        msg.finish_reason = out.finish_reason
                        msg.usage.CopyFrom(pb.Usage(**u))
                        msg.stats.CopyFrom(pb.SpeculativeStats(
                            **{k: v for k, v in st.items() if k not in ("ttft_s", "engine_times")}))
                        msg.ttft_s = st["ttft_s"] or 0.0
                    yield msg
                    if out.finished:
                        break
            except ValueError as e:
                raise P.prompt_error(e, "prompt") from None
            except RuntimeError as e:
                raise P.exception_error(e) from None
            lease.status = "OK"
        except P.APIError as e:
            lease.status = _GRPC_CODES.get(e.status, "UNKNOWN")
            self._grpc_fail(grpc_context, e, endpoint)
        finally:
            await shielded(lease.release())

    async def ListModels(self, request, grpc_context=None):
        """specray.v1.SpecRay/ListModels."""
        from specray.serve import specray_pb2 as pb

        try:
            self._grpc_key(grpc_context)
        except P.APIError as e:
            self.metrics.request_done("grpc_list_models", _GRPC_CODES[e.status])
            self._grpc_fail(grpc_context, e, "grpc_list_models")
        self.metrics.request_done("grpc_list_models", "OK")
        return pb.ListModelsResponse(models=[pb.Model(
            id=self.model_name, owned_by="specray", max_model_len=self.max_model_len,
            speculative=bool(self.settings.drafter))])

