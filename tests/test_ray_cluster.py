"""The Ray backend on a local CPU cluster (loopback): TP=1, 2 and 3 target
groups with the drafter colocated or a separate actor give exactly the
in-process engine's output (draft trees, lookups, lanes, the policy's kinds
of step, requests joining running chains) and stream while running; the step
loop runs inside the rank-0 actor, and one output poll can carry several
steps. Aborts, errors, failures and cleanup: test_ray_cluster_lifecycle.py."""

import asyncio
import time

import pytest

from factories import make_models
from ray_cluster_helpers import MAX_TOKENS, PROMPTS, config, reference, start_cluster
from specray import LLM, SamplingParams
from specray.async_engine import AsyncEngine
from specray.config import EngineConfig
from specray.output_wire import OutputUnpacker

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from start_cluster(tmp_path_factory)


async def staggered(engine, params, after_first: bool = False):
    """Admit the prompts at different times; collect every chunk.
    ``after_first``: the others only once the first has its first tokens
    (its chain runs, on however slow a machine)."""
    started = asyncio.Event()

    async def one(i):
        if after_first and i:
            await started.wait()
        await asyncio.sleep(0.05 * i)
        chunks = []
        async for out in engine.generate(PROMPTS[i], params[i], request_id=f"r{i}"):
            chunks.append((time.monotonic(), out))
            started.set()
        return chunks

    return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


def staggered_as_in_process(cluster, engine, params, after_first: bool = False) -> dict:
    """Requests arriving apart on ``engine``: their tokens must be the
    in-process engine's. The engine's stats after."""
    results = asyncio.run(staggered(engine, params, after_first))
    assert [chunks[-1][1].token_ids for chunks in results] == reference(cluster, params)
    return engine.stats()


@pytest.mark.parametrize("tp,placement", [(1, "separate"), (2, "separate"), (1, "colocated"), (2, "colocated")])
def test_ray_matches_inprocess(cluster, tp, placement):
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    sampled = [SamplingParams(max_tokens=n, temperature=0.8, seed=100 + i, ignore_eos=True)
               for i, n in enumerate(MAX_TOKENS)]
    want_greedy, want_sampled = reference(cluster, greedy), reference(cluster, sampled)
    engine = AsyncEngine.from_config(config(cluster), "ray", tp, placement)
    try:
        for params, want in ((greedy, want_greedy), (sampled, want_sampled)):
            results = asyncio.run(staggered(engine, params))
            got = [chunks[-1][1].token_ids for chunks in results]
            assert got == want
            for chunks in results:
                # Streaming: tokens arrive while the request runs.
                assert len(chunks) > 2 and not chunks[0][1].finished and chunks[-1][1].finished
                assert chunks[0][0] < chunks[-1][0]
                assert sum((c.delta_token_ids for _, c in chunks), []) == chunks[-1][1].token_ids
        stats = engine.stats()
        assert all(free == cap for free, cap in stats["pools"].values())
        steps = stats["num_steps"]
    finally:
        engine.shutdown()
    # The serve loops return the steps they ran: followers and the drafter
    # served every step from one Ray call each.
    loop_steps = ray.get(engine.core.actors.loops)
    if tp == 2:
        assert loop_steps[0] == steps
    if placement == "separate":
        assert 0 < loop_steps[-1] <= steps
    # every request submitted once, through the replica's socket to rank 0 (engine_channel), not a Ray call
    assert stats["channel"]["submit"] == 2 * len(PROMPTS) and stats["calls"]["submit"] == 0


@pytest.mark.parametrize("tp,placement,lanes", [(1, "separate", False), (2, "separate", True),
                                               (2, "colocated", False), (1, "colocated", False)])
def test_async_step_graphs_in_every_placement(cluster, tp, placement, lanes):
    """Whole-step graphs (here their eager CPU path) with the drafter and the
    TP followers in other processes: each replays its half from one host
    message a step, and the tokens are the in-process synchronous engine's,
    greedy (draft trees, prompt lookups) and seeded samples alike. With
    ``lanes`` the batch runs as two micro-batches (overlap): the drafter
    proposes for one while rank 0 verifies the other."""
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    sampled = [SamplingParams(max_tokens=n, temperature=0.8, seed=100 + i, ignore_eos=True, top_p=0.9 if i % 2 else 1)
               for i, n in enumerate(MAX_TOKENS)]
    settings = dict(num_kv_blocks=300, kv_block_size=4, cuda_graphs=True, async_scheduling=True, max_num_seqs=8,
                    overlap=lanes, overlap_min_batch=2, adaptive_speculation=False)
    local = LLM(cluster / "t", cluster / "d", **settings)
    llm = LLM(cluster / "t", cluster / "d", backend="ray", tensor_parallel_size=tp, drafter_placement=placement,
              **settings)
    try:
        features = llm.stats()["features"]
        assert features["async_scheduling"]["on"] and features["draft_tree"]["on"], features
        assert features["overlap"]["on"] == lanes, features
        assert features["admit_into_chain"]["on"], features  # requests join running chains in every placement
        for params in (greedy, sampled):
            before = llm.stats()
            got = llm.generate(PROMPTS, params)
            assert [o.token_ids for o in got] == reference(cluster, params)
            # The drafts too (a drafter apart given wrong first tokens drafts other ones).
            steps = [o.metrics.acceptance_lengths for o in local.generate(PROMPTS, params)]
            assert [o.metrics.acceptance_lengths for o in got] == steps
            stats = llm.stats()
            assert stats["num_async_steps"] - before["num_async_steps"] > 10, stats
            # The chain started at the prefill, from its first tokens on rank 0's side (a drafter
            # apart takes them over its data channel); a batch that splits into lanes starts at
            # the next step instead (chain_admit.chain_from_prefill).
            chains = stats["prefill_chains"] - before["prefill_chains"]
            assert chains == 0 if lanes else chains >= 1, stats
            assert all(free == cap for free, cap in stats["pools"].values())
    finally:
        llm.shutdown()


def test_tp1_with_a_colocated_drafter_runs_the_in_process_features(cluster):
    """At TP 1 with the drafter in rank 0's actor no other process keeps row
    state: requests join running chains and the policy may verify shorter
    chains, as in process (the served default's placement), and greedy
    tokens stay the in-process engine's, seeded samples too where every
    step verifies the whole block (a policy's AR steps draw other
    uniforms: its sampled output is checked by distribution,
    test_spec_policy.py)."""
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    settings = dict(cuda_graphs=True, async_scheduling=True, max_num_seqs=8)
    engine = AsyncEngine.from_config(config(cluster, **settings), "ray", 1, "colocated")
    try:
        features = engine.stats()["features"]
        assert features["admit_into_chain"] == {"on": True}, features
        assert features["async_scheduling"]["on"] and "note" not in features["adaptive_speculation"], features
        stats = staggered_as_in_process(cluster, engine, greedy)
        assert stats["chain_joins"] > 0 and stats["num_async_steps"] > 10, stats
        assert all(free == cap for free, cap in stats["pools"].values())
    finally:
        engine.shutdown()
    sampled = [SamplingParams(max_tokens=n, temperature=0.8, seed=100 + i, ignore_eos=True)
               for i, n in enumerate(MAX_TOKENS)]
    engine = AsyncEngine.from_config(config(cluster, adaptive_speculation=False, **settings), "ray", 1, "colocated")
    try:
        assert staggered_as_in_process(cluster, engine, sampled)["chain_joins"] > 0
    finally:
        engine.shutdown()


def test_tp_followers_replay_every_kind_of_step_the_policy_chooses(cluster):
    """At TP 2 with the drafter in rank 0's actor the policy may verify the
    whole block (a draft tree), a shorter chain or no draft at all; each
    follower replays its shard of each (forced in turn here), and requests
    arriving at different times join the running chain (the followers keep
    no row state: the joined prompts' prefill and the new block tables
    reach them as any step's do): greedy tokens stay the in-process
    engine's, and an autoregressive engine's at TP 2 joins too."""
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    settings = dict(cuda_graphs=True, async_scheduling=True, max_num_seqs=8, extra={"policy_turns": [7, 3, 1, 0]})
    engine = AsyncEngine.from_config(config(cluster, **settings), "ray", 2, "colocated")
    try:
        features = engine.stats()["features"]
        assert features["adaptive_speculation"] == {"on": True, "drafts": [7, 3, 1, 0]}, features
        assert features["draft_tree"]["on"], features
        results = asyncio.run(staggered(engine, greedy))
        finals = [chunks[-1][1] for chunks in results]
        assert [o.token_ids for o in finals] == reference(cluster, greedy)
        stats = engine.stats()
        taken = stats["speculation"]["steps_by_drafts"]
        assert stats["num_async_steps"] > 10 and {"0", "1", "3", "7"} <= set(taken), stats
        # a step verified 7, 3, 1 and 0 drafts in turn: whole blocks alone would verify ~7 a step
        steps = sum(len(o.metrics.acceptance_lengths) for o in finals)
        assert 0 < sum(o.metrics.num_draft_tokens for o in finals) < 0.6 * 7 * steps, taken
        assert features["admit_into_chain"] == {"on": True} and stats["chain_joins"] > 0, stats
        assert all(free == cap for free, cap in stats["pools"].values())
    finally:
        engine.shutdown()
    ar = EngineConfig(target=str(cluster / "t"), num_kv_blocks=300, kv_block_size=4, cuda_graphs=True,
                      async_scheduling=True, max_num_seqs=8)
    engine = AsyncEngine.from_config(ar, "ray", 2, "colocated")
    try:
        assert staggered_as_in_process(cluster, engine, greedy)["chain_joins"] > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_separate_drafter_replays_every_kind_of_step_the_policy_chooses(cluster, tp):
    """The drafter in its own actor mirrors each kind of step the policy may
    choose, forced in turn: whole blocks (draft trees), shorter chains (its
    proposal at that length) and autoregressive steps (no proposal; the
    row's context stored when its result comes). Seeded samples are those
    of an in-process engine forced the same way, greedy tokens the
    target's."""
    turns = {"policy_turns": [7, 3, 1, 0]}
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    sampled = [SamplingParams(max_tokens=n, temperature=0.8, seed=100 + i, ignore_eos=True, top_p=0.9 if i % 2 else 1)
               for i, n in enumerate(MAX_TOKENS)]
    settings = dict(num_kv_blocks=300, kv_block_size=4, cuda_graphs=True, async_scheduling=True, max_num_seqs=8,
                    admit_into_chain=False, extra=turns)
    want_sampled = [o.token_ids for o in LLM(cluster / "t", cluster / "d", **settings).generate(PROMPTS, sampled)]
    llm = LLM(cluster / "t", cluster / "d", backend="ray", tensor_parallel_size=tp, drafter_placement="separate",
              **settings)
    try:
        features = llm.stats()["features"]
        assert features["adaptive_speculation"] == {"on": True, "drafts": [7, 3, 1, 0]}, features
        got = llm.generate(PROMPTS, sampled)  # first: the same turns as the in-process engine's
        assert [o.token_ids for o in got] == want_sampled
        got = llm.generate(PROMPTS, greedy)
        assert [o.token_ids for o in got] == reference(cluster, greedy)
        stats = llm.stats()
        assert {"0", "1", "3", "7"} <= set(stats["speculation"]["steps_by_drafts"]), stats["speculation"]
        assert stats["drafter"]["state"] == "up" and stats["drafter"]["losses"] == 0, stats["drafter"]
        steps = sum(len(o.metrics.acceptance_lengths) for o in got)
        assert 0 < sum(o.metrics.num_draft_tokens for o in got) < 0.6 * 7 * steps
        assert all(free == cap for free, cap in stats["pools"].values())
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_requests_join_the_chains_of_a_separate_drafter(cluster, tp):
    """Requests arriving apart join running chains with the drafter in its
    own actor: the joining prompts' context store takes the step in
    flight's results, and the joined rows' state and first tokens reach
    the drafter's mirrored state with the next step (JOINED); finished rows
    ride meanwhile. Greedy tokens, and seeded samples where every step
    verifies the whole block, are the in-process engine's."""
    lengths = [120] + MAX_TOKENS[1:]  # the first request's chain runs while the others arrive
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    sampled = [SamplingParams(max_tokens=n, temperature=0.8, seed=100 + i, ignore_eos=True, top_p=0.9 if i % 2 else 1)
               for i, n in enumerate(lengths)]
    for params, adaptive in ((greedy, None), (sampled, False)):
        settings = dict(cuda_graphs=True, async_scheduling=True, max_num_seqs=8, adaptive_speculation=adaptive)
        engine = AsyncEngine.from_config(config(cluster, **settings), "ray", tp, "separate")
        try:
            assert engine.stats()["features"]["admit_into_chain"] == {"on": True}
            stats = staggered_as_in_process(cluster, engine, params, after_first=True)
            assert stats["chain_joins"] > 0 and stats["drafter"]["losses"] == 0, stats
            assert all(free == cap for free, cap in stats["pools"].values())
        finally:
            engine.shutdown()


def test_three_way_tensor_parallel_group(cluster, tmp_path):
    """An odd group size (what the default SmolLM2, 9 heads, needs for TP > 1):
    every rank's shard, the plan broadcast and the all-reduces still give
    the in-process engine's tokens, with the drafter as its own actor."""
    make_models(tmp_path, arch="llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                intermediate_size=192, head_dim=16, vocab_size=321)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    local = LLM(tmp_path / "t", tmp_path / "d")
    want = [o.token_ids for o in local.generate(PROMPTS, params)]
    # min_tokens: each prompt's third free token is a stop token, masked
    # (on the driver rank's gathered logits) for the first eight.
    held = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[w[2]], min_tokens=8)
            for w in want]
    want_held = [o.token_ids for o in local.generate(PROMPTS, held)]
    assert all(len(h) > 8 and w[2] not in h[:8] and h != w for h, w in zip(want_held, want))
    # Penalties and log probabilities, also read on the driver rank's logits.
    extra = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=0.5,
                           frequency_penalty=0.3, logprobs=3)
    want_extra = local.generate(PROMPTS, extra)
    llm = LLM(tmp_path / "t", tmp_path / "d", backend="ray", tensor_parallel_size=3, drafter_placement="separate")
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        assert [o.token_ids for o in llm.generate(PROMPTS, held)] == want_held
        got = llm.generate(PROMPTS, extra)
        assert [o.token_ids for o in got] == [o.token_ids for o in want_extra]
        for g, w in zip(got, want_extra):
            assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-4)
            assert [[t for t, _ in e.top] for e in g.logprobs] == [[t for t, _ in e.top] for e in w.logprobs]
    finally:
        llm.shutdown()


def test_output_delivery_is_batched(cluster):
    """One get_outputs call carries several steps' outputs."""
    llm = LLM(cluster / "t", cluster / "d", backend="ray", num_kv_blocks=300, kv_block_size=4)
    try:
        driver = llm._core.driver
        ids = [f"b{i}" for i in range(4)]
        ray.get(driver.submit.remote([(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), i)
                                      for p, i in zip(PROMPTS, ids)]))
        done, cursor, unpacker = set(), -1, OutputUnpacker()
        while len(done) < len(ids):
            # 0.5 s of batching spans several steps even on a loaded 2-core machine (0.1 s did not)
            cursor, data = ray.get(driver.get_outputs.remote(cursor, 1.0, 0.5))
            for o in unpacker.unpack(data):
                if o.finished:
                    done.add(o.request_id)
        stats = llm.stats()
        assert stats["calls"]["get_outputs"] < stats["num_steps"] / 2, stats
    finally:
        llm.shutdown()


def test_drafter_beside_rank_0_shares_its_bundle(cluster):
    """``separate_same_gpu``: the drafter is its own actor in rank 0's bundle
    (on a GPU, half of it each: the same device), and the tokens are the
    in-process engine's (on CPUs the tensors go over gloo as "separate")."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    llm = LLM(cluster / "t", cluster / "d", backend="ray", drafter_placement="separate_same_gpu", num_kv_blocks=300)
    try:
        bundles = ray.util.placement_group_table(llm._core.actors.placement_group)["bundles"]
        assert bundles == {0: {"CPU": 2.0}}
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == reference(cluster, params)
        assert ray.get(llm._core.actors.drafter.node_id.remote())  # its own actor
    finally:
        llm.shutdown()
