"""Outputs crossing from rank 0's actor to the replica (output_wire.py):
rebuilt field for field from the deltas, over a real engine's stream with
stop strings (held-back text), logprobs, sampling, an abort and polls that
coalesce several steps."""

import pickle
import random

import pytest

from factories import make_models
from specray import SamplingParams
from specray.config import EngineConfig
from specray.llm import build_engine
from specray.output_wire import OutputUnpacker, pack
from specray.request import RequestOutput, coalesce


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = make_models(tmp_path_factory.mktemp("wire"), seed=3)
    return build_engine(EngineConfig(target=str(root / "t"), drafter=str(root / "d"), num_kv_blocks=256,
                                     kv_block_size=4))


def requests(engine):
    greedy = dict(max_tokens=40, temperature=0, ignore_eos=True)
    free = {}
    engine.add_request("The capital of France is", SamplingParams(**greedy), request_id="free")
    while engine.has_unfinished():
        for o in engine.step():
            free[o.request_id] = o
    text = free["free"].text
    # three characters from the second half, none of them blank (a stop string that is hit mid-stream)
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 2) if not text[i:i + 3].isspace()
                and " " not in text[i:i + 3])
    engine.add_request("The capital of France is", SamplingParams(**greedy, stop=[stop, "zzzz"]), request_id="stop")
    engine.add_request("Hello world", SamplingParams(**greedy, logprobs=2), request_id="logprobs")
    engine.add_request("Speculative decoding", SamplingParams(max_tokens=30, temperature=1.0, seed=5),
                       request_id="sampled")
    engine.add_request("A test of", SamplingParams(**greedy), request_id="aborted")


def test_outputs_rebuilt_from_deltas_equal_the_engines(engine):
    requests(engine)
    rng = random.Random(0)
    unpacker, pending, slim, steps = OutputUnpacker(), [], 0, 0
    while engine.has_unfinished():
        pending += engine.step()
        steps += 1
        if steps == 6:
            out = engine.abort_request("aborted")
            pending.append(out)
        if rng.random() < 0.5 and engine.has_unfinished():
            continue  # the poll waits: the next one carries several steps
        sent = coalesce(pending)
        data = pack(sent)
        if rng.random() < 0.2:
            data = pack(sent)  # a lost answer, asked again: the same outputs come again
        slim += sum(not isinstance(row, RequestOutput) for row in pickle.loads(data))
        got = unpacker.unpack(data)
        assert got == sent
        pending = []
    assert slim > 10  # most outputs went as deltas
    assert not unpacker.latest  # finished requests are forgotten


def test_unfinished_text_is_what_the_deltas_sent(engine):
    """A held-back tail (it may still turn into a stop string) is not in an
    unfinished output's text: text is the deltas so far, as vLLM's."""
    requests(engine)
    texts, deltas = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            deltas[o.request_id] = deltas.get(o.request_id, "") + o.delta_text
            assert o.text == deltas[o.request_id], o.request_id
            texts[o.request_id] = o.text
    assert set(texts) >= {"stop", "logprobs", "sampled"}


def test_a_delta_before_its_requests_first_output_is_an_error():
    first = RequestOutput("a", None, [1], "x", [3], False, None, None, "x", [3])
    later = RequestOutput("a", None, [1], "xy", [3, 4], False, None, None, "y", [4])
    with pytest.raises(RuntimeError, match="before its first"):
        OutputUnpacker().unpack(pack([later]))
    assert OutputUnpacker().unpack(pack([first, later])) == [first, later]
