"""EngineLoop.get_outputs: how long a poll holds outputs back; the loop's
start-up heap and the garbage collector; the GIL switch interval knob."""

import gc
import sys
import threading
import time

import pytest
from factories import make_models
from specray.config import EngineConfig
from specray.engine_loop import EngineLoop, set_switch_interval
from specray.llm import build_engine
from specray.request import RequestMetrics, RequestOutput


def bare_loop(outputs) -> EngineLoop:
    # The outbox alone: get_outputs reads nothing else of the loop.
    loop = EngineLoop.__new__(EngineLoop)
    loop._cv, loop._outbox, loop._base, loop._closed = threading.Condition(), list(outputs), 0, False
    return loop


def output(token_ids, delta, finished=False) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], "", token_ids, finished, "length" if finished else None,
                         RequestMetrics(), delta_token_ids=delta)


def poll_seconds(out, min_batch_s=0.4) -> float:
    t = time.monotonic()
    cursor, outs = bare_loop([out]).get_outputs(-1, 1.0, min_batch_s)
    assert (cursor, outs) == (1, [out])
    return time.monotonic() - t


def test_first_tokens_and_ends_are_not_held_back_to_batch_steps():
    assert poll_seconds(output([7, 8], [7, 8])) < 0.2  # a request's first tokens
    assert poll_seconds(output([7, 8, 9], [9], finished=True)) < 0.2  # its end
    assert poll_seconds(output([7, 8, 9], [9])) >= 0.4  # mid-stream: batched with the next steps


def test_an_end_arriving_while_steps_are_batched_goes_at_once():
    loop = bare_loop([output([7, 8, 9], [9])])  # mid-stream: the poll batches
    end = output([7, 8, 9, 10], [10], finished=True)

    def finish():
        time.sleep(0.05)
        with loop._cv:
            loop._outbox.append(end)
            loop._cv.notify_all()

    threading.Thread(target=finish).start()
    t = time.monotonic()
    cursor, outs = loop.get_outputs(-1, 1.0, 0.6)
    # one output for the request: the batched step's tokens and its end (request.coalesce)
    assert len(outs) == 1 and outs[0].finished and outs[0].delta_token_ids == [9, 10] and cursor == 2
    assert time.monotonic() - t < 0.4  # not the 0.6 s a batch may wait


def test_the_loop_leaves_its_start_up_heap_out_of_full_collections(tmp_path):
    """What the process holds once the engine is built is frozen while the
    loop runs (a full collection would traverse it mid-stream), and
    unfrozen when it stops, so that a dropped engine can be collected."""
    models = make_models(tmp_path)
    loop = EngineLoop(build_engine(EngineConfig(target=str(models / "t"), drafter=str(models / "d"))))
    try:
        assert gc.get_freeze_count() > 1000
    finally:
        loop.stop()
    assert gc.get_freeze_count() == 0


def test_switch_interval_from_the_environment(monkeypatch):
    before = sys.getswitchinterval()
    try:
        monkeypatch.delenv("SPECRAY_SWITCH_INTERVAL_US", raising=False)
        set_switch_interval()
        assert sys.getswitchinterval() == before  # unset: CPython's own
        monkeypatch.setenv("SPECRAY_SWITCH_INTERVAL_US", "250")
        set_switch_interval()
        assert abs(sys.getswitchinterval() - 250e-6) < 1e-9
        for bad in ("0", "-5", "1.5", "fast"):
            monkeypatch.setenv("SPECRAY_SWITCH_INTERVAL_US", bad)
            with pytest.raises(ValueError, match="SPECRAY_SWITCH_INTERVAL_US"):
                set_switch_interval()
    finally:
        sys.setswitchinterval(before)
