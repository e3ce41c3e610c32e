"""A request's side of a step's results (``EngineCore``'s mixin): emitted
tokens appended up to a stop, their text detokenized, the step recorded,
blocks rolled back past what was accepted, and the ``RequestOutput``
deltas a stream sends."""

from __future__ import annotations

import time

from specray.detokenizer import detokenize_step, find_stop_string, stop_holdback
from specray.request import Request, RequestOutput


class RequestEmit:
    def _emit(self, r: Request, drafts: list[int], a: int, bonus: int, num_drafts: int,
              keep_ahead: int = 0, logprobs: list | None = None) -> RequestOutput:
        """A decode row's result: its first ``a`` drafts and the bonus token
        are appended (up to a stop), the step recorded, and the request's
        blocks rolled back past what was accepted (keeping ``keep_ahead``
        more positions for a step in flight)."""
        produced = self._append(r, drafts[:a] + [bonus], logprobs)
        r.metrics.record_step(num_drafts, min(a, produced), produced)
        if not r.finished:
            computed = r.num_computed + a + 1
            self.scheduler.commit(r, computed, keep=computed + keep_ahead)
        return self._output(r)

    def _forget_finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for o in outputs:
            if o.finished:
                self.requests.pop(o.request_id, None)
        return outputs

    def _append(self, r: Request, tokens: list[int], logprobs: list | None = None) -> int:
        """Append emitted tokens (and their ``logprobs`` entries) one by one,
        stopping at the first stop condition; returns how many were kept."""
        if logprobs is None and not r.params.stop:
            return self._append_run(r, tokens)
        stops = r.stop_token_ids
        kept = 0
        for tok in tokens:
            r.output_token_ids.append(tok)
            if logprobs is not None:
                r.logprobs.append(logprobs[kept])
            kept += 1
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = time.monotonic()
            # A stop token's text stays out of the output, as in vLLM (the
            # token still counts in token_ids and usage).
            # Before min_tokens a stop token is text like any other (the
            # verification masks stop tokens there, so none is emitted) and
            # stop strings are not looked for (vLLM's rule).
            stopping = tok in stops and len(r.output_token_ids) > r.params.min_tokens
            new_text = ""
            if not stopping:
                with self.tokenizer_lock:
                    new_text = detokenize_step(self._decode, r)
                r.text += new_text
            reason = None
            if stopping:
                reason, r.stop_reason = "stop", tok
            elif new_text and r.params.stop and len(r.output_token_ids) >= r.params.min_tokens and \
                    (hit := find_stop_string(r, len(new_text))):
                r.text = r.text[: hit[0]]
                reason, r.stop_reason = "stop", hit[1]
            elif len(r.output_token_ids) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                self.scheduler.finish(r, reason)
                r.metrics.finished_time = time.monotonic()
                break
        return kept

    def _append_run(self, r: Request, tokens: list[int]) -> int:
        """``_append`` for a request without stop strings or logprobs, by the
        same rules: where it stops is known from the token ids alone, so the
        run's text is decoded once (a speculative row emits several tokens a
        step; per token, the detokenizer was most of a row's host time)."""
        out, params = r.output_token_ids, r.params
        stops = r.stop_token_ids
        limit = min(params.max_tokens - len(out), self.max_model_len - r.num_tokens)
        kept, reason = len(tokens), None
        for i, tok in enumerate(tokens):
            if tok in stops and len(out) + i + 1 > params.min_tokens:
                kept, reason = i + 1, "stop"
                break
            if i + 1 >= limit:
                kept, reason = i + 1, "length"
                break
        if not kept:
            return 0
        if r.metrics.first_token_time is None:
            r.metrics.first_token_time = time.monotonic()
        # A stop token's text stays out of the output (it is not decoded).
        texted = kept - (reason == "stop")
        out.extend(tokens[:texted])
        if texted:
            with self.tokenizer_lock:
                r.text += detokenize_step(self._decode, r, self._decode_runs)
        if reason == "stop":
            out.append(tokens[kept - 1])
            r.stop_reason = tokens[kept - 1]
        if reason:
            self.scheduler.finish(r, reason)
            r.metrics.finished_time = time.monotonic()
        return kept

    def _output(self, r: Request) -> RequestOutput:
        visible = len(r.text) - stop_holdback(r)
        delta_text = r.text[r.sent_text_len : max(visible, r.sent_text_len)]
        r.sent_text_len = max(visible, r.sent_text_len)
        delta_ids = r.output_token_ids[r.sent_token_len :]
        asked = r.params.logprobs is not None
        # New entries every time, all of them once: a stream's outputs cross
        # processes (the Ray backend), and the whole list each step would
        # make a long generation's traffic quadratic.
        delta_logprobs = r.logprobs[r.sent_token_len :] if asked else None
        r.sent_token_len = len(r.output_token_ids)
        # The text its deltas have sent: a held-back tail may still be cut
        # by a stop string (vLLM's cumulative text holds it back too), and
        # text is then the previous output's plus delta_text (output_wire.py).
        text = r.text if r.finished or r.sent_text_len == len(r.text) else r.text[: r.sent_text_len]
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,
            text=text,
            token_ids=list(r.output_token_ids),
            finished=r.finished,
            finish_reason=r.finish_reason,
            metrics=r.metrics,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            stop_reason=r.stop_reason,
            delta_logprobs=delta_logprobs,
            logprobs=list(r.logprobs) if asked and r.finished else None,
        )
