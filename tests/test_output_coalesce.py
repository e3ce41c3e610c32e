"""A stream that fell behind the engine gets the outputs waiting for it as
one (request.coalesce, take_queued): nothing lost, nothing reordered."""

import asyncio

from specray.request import RequestMetrics, RequestOutput, TokenLogprobs, coalesce, take_queued


def out(rid: str, ids: list[int], new: int, finished: bool = False, logprobs: bool = False) -> RequestOutput:
    """Request ``rid``'s output with ``ids`` so far, the last ``new`` of them new."""
    delta = ids[len(ids) - new:]
    lps = [TokenLogprobs(t, -0.5, []) for t in delta] if logprobs else None
    return RequestOutput(rid, None, [1], "".join(chr(97 + t) for t in ids), list(ids), finished, "length" if finished else None, RequestMetrics(),
                         delta_text="".join(chr(97 + t) for t in delta), delta_token_ids=delta, delta_logprobs=lps)


def test_one_output_a_request_with_every_delta_in_order():
    outs = [out("a", [0], 1), out("b", [5], 1), out("a", [0, 1, 2], 2), out("b", [5, 6], 1),
            out("a", [0, 1, 2, 3], 1, finished=True), out("c", [9], 1)]
    got = coalesce(outs)
    assert [o.request_id for o in got] == ["b", "a", "c"]  # each at its last output's place
    a = got[1]
    assert a.delta_token_ids == [0, 1, 2, 3] and a.delta_text == "abcd" and a.finished and a.token_ids == [0, 1, 2, 3]
    assert got[0].delta_token_ids == [5, 6] and got[0].delta_text == "fg"
    assert coalesce(outs[:2]) == outs[:2] and coalesce(outs[:2]) is not outs[:2]


def test_logprobs_follow_their_tokens():
    merged = coalesce([out("a", [0, 1], 2, logprobs=True), out("a", [0, 1, 2], 1, logprobs=True)])
    assert [e.token_id for e in merged[0].delta_logprobs] == [0, 1, 2]
    assert coalesce([out("a", [0], 1), out("a", [0, 1], 1)])[0].delta_logprobs is None


def test_take_queued_stops_at_the_end_and_holds_an_error():
    async def run():
        q = asyncio.Queue()
        for o in (out("a", [0, 1], 1), out("a", [0, 1, 2], 1, finished=True), out("a", [7], 1)):
            q.put_nowait(o)
        first, err = take_queued(out("a", [0], 1), q)
        assert first.delta_token_ids == [0, 1, 2] and first.finished and err is None
        assert q.qsize() == 1  # nothing taken past the finished output
        q = asyncio.Queue()
        boom = RuntimeError("engine failure")
        for item in (out("a", [0, 1], 1), boom, out("a", [0, 1, 2], 1)):
            q.put_nowait(item)
        first, err = take_queued(out("a", [0], 1), q)
        assert first.delta_token_ids == [0, 1] and err is boom and q.qsize() == 1

    asyncio.run(run())
