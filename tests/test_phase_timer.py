"""The phase timer (phase_timer.py) on a real engine's loop: every step()
call counted under one kind, a kind's functions inside its step time, and
the engine and modules as they were once the loop stops."""

import time

import pytest

from factories import make_models
from specray import SamplingParams, async_decode, chain_admit
from specray.actors.graphs import DecodeGraphs
from specray import engine as engine_module
from specray.config import EngineConfig
from specray.engine_loop import EngineLoop
from specray.llm import build_engine
from specray.phase_timer import KINDS, per_cycle


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = make_models(tmp_path_factory.mktemp("phases"), seed=4)
    return build_engine(EngineConfig(target=str(root / "t"), drafter=str(root / "d"), num_kv_blocks=256,
                                     kv_block_size=4))


def test_phases_split_every_step_and_undo_at_stop(engine, monkeypatch):
    monkeypatch.setenv("SPECRAY_PHASES", "1")
    originals = (async_decode.launch_decode, chain_admit.join_chain, engine_module.join_chain, engine_module.launch_decode,
                 DecodeGraphs.run)
    loop = EngineLoop(engine)
    try:
        before = loop.stats()["phases"]
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        ids = []
        for i, prompt in enumerate(["The capital of France is", "Hello world", "A test of", "Speculative"]):
            ids.append(f"r{i}")
            assert loop.submit([(prompt, greedy, ids[-1])]) == [None]
            time.sleep(0.05)  # later ones arrive while the first run
        done, cursor, deadline = set(), -1, time.monotonic() + 60
        while len(done) < len(ids) and time.monotonic() < deadline:
            cursor, outs = loop.get_outputs(cursor, 1.0)
            done |= {o.request_id for o in outs if o.finished}
        assert done == set(ids)
        after = loop.stats()
    finally:
        loop.stop()
    totals = after["phases"]
    assert sum(totals[k]["cycles"] for k in KINDS) == after["num_steps"] > 0
    table = per_cycle(totals, before)
    for kind in KINDS:
        rows = table[kind]["ms_per_cycle"]
        if table[kind]["cycles"]:
            # what a step() call did is inside its time; the outermost of it, the call itself
            assert rows["step"] > 0 and max(rows.values()) == rows["step"], (kind, rows)
    assert table["sync"]["cycles"] > 0 and "_sync_step" in table["sync"]["ms_per_cycle"]
    # stopped: the engine's own methods again, the modules' functions as they were
    assert not {"step", "_emit", "_sync_step"} & set(vars(engine))
    assert (async_decode.launch_decode, chain_admit.join_chain, engine_module.join_chain,
            engine_module.launch_decode, DecodeGraphs.run) == originals
