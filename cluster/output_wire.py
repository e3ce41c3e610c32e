"""Outputs on their way from rank 0's actor to the serving replica.

A ``RequestOutput`` holds everything generated so far (the prompt's ids,
the whole text and token ids): pickled whole every poll, a batch of 16
streams cost ~150 us of rank 0's interpreter a poll, time its step thread
waits for (on the H100 at c=16 the actor's engine stepped at 1.80 ms where
the in-process one took 1.39). Across the wire a request's first output
(no tokens sent before it) and its last go whole; the ones between carry
only what is new, and the replica rebuilds them from the one before, which
it has applied: outputs arrive in order, exactly once (a poll whose answer
was lost is asked again from the same cursor, and what it carried comes
again), and coalescing keeps that (a merged output is the later one with
the deltas of both). Rebuilt outputs equal the engine's, field for field:
an unfinished output's text is what its deltas have sent
(``RequestEmit._output``), so text and token ids are the previous ones'
with the deltas appended.
"""

from __future__ import annotations

import dataclasses
import pickle

from specray.request import RequestOutput


def pack(outputs: list[RequestOutput]) -> bytes:
    rows = [o if o.finished or len(o.token_ids) == len(o.delta_token_ids)
            else (o.request_id, o.delta_token_ids, o.delta_text, o.metrics, o.delta_logprobs)
            for o in outputs]
    return pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)


class OutputUnpacker:
    """One per stream of polls (a replica's engine, one epoch of its
    group): the latest output of each unfinished request."""

    def __init__(self):
        self.latest: dict[str, RequestOutput] = {}

    def unpack(self, data: bytes) -> list[RequestOutput]:
        outs = []
        for row in pickle.loads(data):
            if isinstance(row, RequestOutput):
                out = row
            else:
                rid, ids, text, metrics, logprobs = row
                prev = self.latest.get(rid)
                if prev is None:
                    raise RuntimeError(f"an output of request {rid!r} came before its first one")
                # prev is unfinished: no finish reason, stop, error or whole logprobs to carry
                out = dataclasses.replace(prev, text=prev.text + text, token_ids=prev.token_ids + ids, metrics=metrics,
                                          delta_text=text, delta_token_ids=ids, delta_logprobs=logprobs)
            if out.finished:
                self.latest.pop(out.request_id, None)
            else:
                self.latest[out.request_id] = out
            outs.append(out)
        return outs
