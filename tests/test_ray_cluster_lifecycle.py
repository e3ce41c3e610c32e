"""The Ray backend's lifecycle on a local CPU cluster (loopback): aborted
streams, bad input and configs refused, dead or failing workers surfacing
promptly, and engines leaving no actors, placement groups or files behind."""

import asyncio
import os
import time

import pytest

from factories import make_target
from ray_cluster_helpers import PROMPTS, config, reference, start_cluster
from specray import LLM, ConfigError, SamplingParams
from specray.async_engine import AsyncEngine

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from start_cluster(tmp_path_factory)


@pytest.mark.parametrize("channel", ["1", "0"])
def test_abort_mid_stream_frees_blocks_everywhere(cluster, channel, monkeypatch):
    # SPECRAY_ENGINE_CHANNEL: the streams' socket to rank 0 (engine_channel), or Ray calls alone
    monkeypatch.setenv("SPECRAY_ENGINE_CHANNEL", channel)
    engine = AsyncEngine.from_config(config(cluster), "ray", 2, "separate")

    async def run():
        got = []
        agen = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        async for out in agen:
            got.append(out)
            if len(got) == 3:
                break
        await agen.aclose()  # what a dropped client does
        other = [o async for o in engine.generate([8, 9], SamplingParams(max_tokens=12, temperature=0))]
        return got, other

    try:
        got, other = asyncio.run(run())
        assert not got[-1].finished and other[-1].finished
        for _ in range(50):
            stats = engine.stats()
            if stats["num_unfinished"] == 0:
                break
            time.sleep(0.05)
        assert stats["num_unfinished"] == 0 and stats["running"] == 0
        assert all(free == cap for free, cap in stats["pools"].values()), stats["pools"]
        calls = stats["calls"]  # rank 0's actor methods the streams called
        if channel == "1":
            assert engine.core.channel.client is not None
            assert calls["submit"] == calls["abort"] == calls["get_outputs"] == 0, calls
        else:
            assert engine.core.channel.client is None
            assert calls["submit"] == 2 and calls["abort"] >= 1 and calls["get_outputs"] >= 1, calls
    finally:
        rendezvous = engine.core.actors.rendezvous_dir
        engine.shutdown()
    assert rendezvous and not os.path.exists(rendezvous)  # TP 2 met through a file store: removed


def test_text_prompts_and_errors_through_ray(cluster):
    llm = LLM(cluster / "t", cluster / "d", backend="ray", num_kv_blocks=300, kv_block_size=4)
    try:
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
        local = LLM(cluster / "t", cluster / "d").generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
        assert out.text == local.text and out.token_ids == local.token_ids
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 9999]], SamplingParams(max_tokens=4))
        # The engine still serves afterwards.
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0].token_ids) == 5
    finally:
        llm.shutdown()


def test_clear_error_when_cluster_lacks_gpus(cluster):
    t = time.monotonic()
    with pytest.raises(ConfigError, match="GPU: needs 3, the cluster has 0"):
        LLM(cluster / "t", cluster / "d", device="cuda", backend="ray", tensor_parallel_size=2,
            drafter_placement="separate")
    assert time.monotonic() - t < 30
    with pytest.raises(ConfigError, match="GPU: needs 2, the cluster has 0"):  # rank 0's GPU shared, rank 1's
        LLM(cluster / "t", cluster / "d", device="cuda", backend="ray", tensor_parallel_size=2,
            drafter_placement="separate_same_gpu")
    with pytest.raises(ConfigError, match="drafter_placement"):
        LLM(cluster / "t", cluster / "d", backend="ray", drafter_placement="elsewhere")


# ------------------------------------------------- failures and lifecycle
def generate_within(llm, prompts, params, deadline_s=60.0):
    """``llm.generate`` in a thread: its outputs, or the exception it raised;
    a call still running after ``deadline_s`` fails the test (a hang)."""
    import threading

    box = {}

    def run():
        try:
            box["out"] = llm.generate(prompts, params)
        except BaseException as e:
            box["err"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(deadline_s)
    if th.is_alive():
        pytest.fail(f"generate still running after {deadline_s:.0f} s")
    return box.get("err") or box["out"]


def wait_for_steps(llm, n=2, deadline_s=30.0):
    end = time.monotonic() + deadline_s
    while llm.stats()["num_steps"] < n:
        assert time.monotonic() < end, "the engine never stepped"
        time.sleep(0.05)


LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def test_follower_killed_mid_generate_raises_then_the_group_is_rebuilt(cluster):
    """A dead target rank is an error from generate, not outputs cut short;
    the group is rebuilt and later calls are served (tests/test_faults_ray.py
    has the drafter's and rank 0's cases)."""
    import threading

    from specray.faults import EngineUnavailable

    llm = LLM(cluster / "t", cluster / "d", backend="ray", tensor_parallel_size=2, num_kv_blocks=300, kv_block_size=4)
    try:
        handle = llm._core.actors.ranks[1]

        def kill():
            wait_for_steps(llm)
            ray.kill(handle)

        threading.Thread(target=kill, daemon=True).start()
        got = generate_within(llm, [[5, 6, 7], [8, 9]], LONG)
        assert isinstance(got, EngineUnavailable), got
        short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        got = generate_within(llm, [[5, 6]], short, 90)
        assert not isinstance(got, Exception), got
        assert len(got[0].token_ids) == 6 and llm._core.group.rebuilds == 1
    finally:
        llm.shutdown()


def fail_in(actor, method: str, message: str):
    """Make ``actor.worker.<method>`` raise from now on (the function is built
    here, so it travels by value: workers cannot import this module)."""
    def patch(self):
        def bad(*a, **k):
            raise RuntimeError(message)

        setattr(self.worker, method, bad)

    ray.get(actor.__ray_call__.remote(patch))


def test_follower_exception_surfaces_promptly_with_its_traceback(cluster):
    """A follower whose serve loop raises must not leave rank 0 waiting on
    it (gloo's timeout is 30 minutes): generate raises that worker's error
    (a drafter that raises is survived: tests/test_faults_ray.py)."""
    llm = LLM(cluster / "t", cluster / "d", backend="ray", tensor_parallel_size=2, num_kv_blocks=300,
              kv_block_size=4)
    try:
        fail_in(llm._core.actors.ranks[1], "execute", "injected follower failure")
        got = generate_within(llm, [[5, 6, 7]], LONG)
        assert isinstance(got, Exception), [(o.finish_reason, len(o.token_ids)) for o in got]
        assert "injected follower failure" in str(got)
        assert "workers.py" in str(got)  # the worker's own traceback
    finally:
        t = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - t < 15


def test_async_stream_ends_when_a_worker_fails(cluster):
    engine = AsyncEngine.from_config(config(cluster), "ray", 2, "separate")

    async def run():
        fail_in(engine.core.actors.ranks[1], "execute", "injected follower failure")
        return [o async for o in engine.generate([5, 6, 7], LONG)]

    try:
        outs = asyncio.run(asyncio.wait_for(run(), 60))
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert outs[-1].error and "Traceback" in outs[-1].error
    finally:
        engine.shutdown()


def test_dropped_llm_releases_its_placement_group(cluster):
    """Ray ends an engine's actors with their last handle, but a placement
    group lives until removed: an LLM dropped without shutdown() must not
    keep its CPUs / GPUs reserved for the rest of the job."""
    import gc

    llm = LLM(cluster / "t", cluster / "d", backend="ray", tensor_parallel_size=2, num_kv_blocks=300, kv_block_size=4)
    pg_id = llm._core.actors.placement_group.id.hex()
    rendezvous = llm._core.actors.rendezvous_dir
    del llm
    gc.collect()
    end = time.monotonic() + 20
    while ray.util.placement_group_table()[pg_id]["state"] != "REMOVED":
        assert time.monotonic() < end, ray.util.placement_group_table()[pg_id]
        time.sleep(0.1)
    assert not os.path.exists(rendezvous)


def test_two_engines_at_once_then_nothing_left(cluster):
    before = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = reference(cluster, [params] * len(PROMPTS))
    a = LLM(cluster / "t", cluster / "d", backend="ray", tensor_parallel_size=2, num_kv_blocks=300, kv_block_size=4)
    b = LLM(cluster / "t", cluster / "d", backend="ray", drafter_placement="colocated", num_kv_blocks=300,
            kv_block_size=4)
    try:
        assert [o.token_ids for o in a.generate(PROMPTS, params)] == want
        assert [o.token_ids for o in b.generate(PROMPTS, params)] == want
    finally:
        a.shutdown()
        b.shutdown()
    after = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    assert after == before


def test_tp_that_cannot_shard_the_model_is_a_config_error_before_actors(cluster, tmp_path):
    # 6 heads split 3 ways, but 2 KV heads do not (nor 3 ways 2); and
    # intermediate_size 102 does not split 4 ways.
    for name, shape, tp in (("kv", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, head_dim=16), 3),
                            ("mlp", dict(intermediate_size=102), 4)):
        make_target(tmp_path / name, seed=2, **shape)
        before = len(ray.util.placement_group_table())
        with pytest.raises(ConfigError, match="tensor_parallel_size"):
            LLM(tmp_path / name, backend="ray", tensor_parallel_size=tp, num_kv_blocks=300, kv_block_size=4)
        assert len(ray.util.placement_group_table()) == before  # nothing was placed
