"""One drafter actor serving two target replicas (N:1) on a local CPU
cluster (gloo, loopback): each replica's tokens equal the same engine with
a drafter of its own (1:1) and the in-process engine, greedy and seeded
samples, with both replicas generating at once; the drafter's pool is
partitioned per replica and proposals arriving together run as one
propose. Also: sizing N from propose / verify times, the batcher alone, a
lost shared drafter (replicas step on without it), bad configurations."""

import asyncio
import contextlib
import threading
import time

import pytest
import torch

from factories import make_models
from specray import LLM, ConfigError, SamplingParams
from specray.async_engine import AsyncEngine
from specray.actors.shared_drafter import ProposeBatcher, merge, merge_key, offset_batch, split
from specray.config import EngineConfig
from specray.plan import DraftBatch, DraftOutput
from specray.sampling import SamplingTensors
from specray.shared_drafter import replicas_per_drafter, start_shared_drafter

ray = pytest.importorskip("ray")

PROMPTS = [[[5, 17, 33, 2, 9, 10, 42], [3, 4], list(range(2, 40))],  # replica 0
           [[7] * 15, [11, 12, 13], [20, 21, 22, 23, 24]]]  # replica 1
MAX_TOKENS = [30, 24, 17]
KW = dict(num_kv_blocks=300, kv_block_size=4)


def test_replicas_per_drafter():
    assert replicas_per_drafter(2.0, 10.0) == 5
    assert replicas_per_drafter(3.0, 10.0) == 3
    assert replicas_per_drafter(10.0, 4.0) == 1  # a drafter slower than the target serves one
    assert replicas_per_drafter(1.0, 0.0) == 1
    for bad in ((0.0, 1.0), (-1.0, 1.0), (1.0, -1.0), (float("nan"), 1.0), (float("inf"), 1.0)):
        with pytest.raises(ValueError):
            replicas_per_drafter(*bad)


def _batch(rows: int, width: int, first: int) -> DraftBatch:
    ids = torch.arange(first, first + rows * 4).view(rows, 4)
    st = SamplingTensors(torch.zeros(rows), torch.ones(rows), torch.zeros(rows, dtype=torch.int64),
                         torch.zeros(3, rows, 0, dtype=torch.float64))
    tables = torch.arange(1, 1 + rows * width, dtype=torch.int32).view(rows, width)
    return DraftBatch(ids, torch.full((rows,), 3), torch.full((rows,), 4), tables, 3 + first, st)


def test_merge_split_offset():
    a, b = _batch(2, 3, 0), offset_batch(_batch(1, 5, 100), 50)
    assert b.block_tables.tolist() == [[51, 52, 53, 54, 55]]
    assert merge_key(a) == merge_key(b)
    m = merge([a, b])
    assert m.block_ids.shape == (3, 4) and m.block_tables.shape == (3, 5)
    assert m.block_tables[:2, :3].tolist() == a.block_tables.tolist() and m.block_tables[2].tolist() == [51, 52, 53,
                                                                                                          54, 55]
    assert m.max_ctx_len == 103 and m.sampling.temperature.shape == (3,) and m.sampling.all_greedy
    out = DraftOutput(m.block_ids[:, 1:], None, None)
    parts = split(out, [2, 1])
    assert parts[0].tokens.tolist() == a.block_ids[:, 1:].tolist()
    assert parts[1].tokens.tolist() == b.block_ids[:, 1:].tolist()


def test_batcher_merges_what_gathers():
    """Threads proposing at once: each gets its own rows back, and with a
    gather window they share one propose."""
    runs = []

    def propose(batch):
        runs.append(batch.block_ids.shape[0])
        time.sleep(0.01)
        return DraftOutput(batch.block_ids[:, 1:] * 2, None, None)

    batcher = ProposeBatcher(propose, threading.Lock(), gather_s=2.0, expected=lambda: 3)
    got = {}

    def one(i):
        b = _batch(i + 1, 2, 1000 * i)
        got[i] = (batcher(b).tokens.tolist(), (b.block_ids[:, 1:] * 2).tolist())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(mine == want for mine, want in got.values()) and len(got) == 3
    assert runs == [6] and batcher.merged == 3 and batcher.batches == 1
    # Without a window, a lone proposal runs at once.
    t = time.monotonic()
    ProposeBatcher(propose, threading.Lock(), 0.0, lambda: 3)(_batch(1, 2, 0))
    assert time.monotonic() - t < 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ray.init(address="local", num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR")
    yield make_models(tmp_path_factory.mktemp("shared"))
    ray.shutdown()


def params_sets():
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    sampled = [[SamplingParams(max_tokens=n, temperature=0.8, seed=100 + 10 * r + i, ignore_eos=True)
                for i, n in enumerate(MAX_TOKENS)] for r in range(2)]
    return [("greedy", [greedy, greedy]), ("sampled", sampled)]


def generate_at_once(llms, params, steps=None):
    """Both replicas' generate calls in flight together; their tokens (and
    into ``steps``, each request's accepted drafts per step)."""
    out, errors = [None, None], []

    def run(r):
        try:
            got = llms[r].generate(PROMPTS[r], params[r])
            out[r] = [o.token_ids for o in got]
            if steps is not None:
                steps[r] = [o.metrics.acceptance_lengths for o in got]
        except BaseException as e:  # noqa: BLE001  (the test reports it)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    return out


def inprocess_greedy(root):
    """Each replica's greedy tokens from the in-process engine."""
    greedy = params_sets()[0][1]
    local = LLM(root / "t", root / "d")
    return [[o.token_ids for o in local.generate(PROMPTS[r], greedy[r])] for r in range(2)]


@contextlib.contextmanager
def shared_replicas(root, kw, gather_ms: float = 0.0):
    """A shared drafter and two Ray engines paired with it, shut down after."""
    config = EngineConfig(target=str(root / "t"), drafter=str(root / "d"), **kw)
    shared = start_shared_drafter(config, 2, gather_ms=gather_ms)
    llms = []
    try:
        llms = [LLM(root / "t", root / "d", backend="ray", shared_drafter=shared.replica(r), **kw) for r in range(2)]
        yield shared, llms
    finally:
        for llm in llms:
            llm.shutdown()
        shared.shutdown()


def test_two_replicas_share_one_drafter(cluster):
    root = cluster
    want = {}
    local = LLM(root / "t", root / "d")
    for name, params in params_sets():
        want[name] = [[o.token_ids for o in local.generate(PROMPTS[r], params[r])] for r in range(2)]
    # 1:1: the same engine with a drafter actor of its own.
    solo = LLM(root / "t", root / "d", backend="ray", drafter_placement="separate", **KW)
    solo_steps = {}
    try:
        for name, params in params_sets():
            got = [solo.generate(PROMPTS[r], params[r]) for r in range(2)]
            assert [[o.token_ids for o in g] for g in got] == want[name]
            solo_steps[name] = [[o.metrics.acceptance_lengths for o in g] for g in got]
    finally:
        solo.shutdown()

    with shared_replicas(root, KW, gather_ms=20) as (shared, llms):
        features = llms[0].stats()["features"]
        assert features["draft_tree"]["on"], features
        for name, params in params_sets():
            steps = [None, None]
            assert generate_at_once(llms, params, steps) == want[name], name
            # The drafts too are a drafter of its own's: each step accepts as many.
            assert steps == solo_steps[name], name
        stats = shared.stats()
        assert stats["blocks_per_replica"] == 300 and all(s > 10 for s in stats["steps"]), stats
        assert stats["merged"] > 0, stats  # some proposes served both replicas at once
        for llm in llms:
            st = llm.stats()
            assert st["drafter"]["state"] == "up" and all(free == cap for free, cap in st["pools"].values())
        # A replica shut down ends its loop only: the other keeps drafting.
        llms[0].shutdown()
        greedy = params_sets()[0][1]
        got = llms[1].generate(PROMPTS[1], greedy[1])
        assert [o.token_ids for o in got] == want["greedy"][1]
        assert sum(o.metrics.num_draft_tokens for o in got) > 0


def test_two_replicas_share_one_drafter_with_async_steps(cluster):
    """Replicas running async step graphs (their eager CPU path) with one
    drafter: each replica's halves of its graphs replay on the drafter in
    its own partition, and both replicas' tokens, their requests in flight
    together, are the in-process engine's (greedy, and seeded samples with
    whole blocks)."""
    root = cluster
    kw = dict(KW, cuda_graphs=True, async_scheduling=True, max_num_seqs=8, adaptive_speculation=False)
    local = LLM(root / "t", root / "d", cuda_graphs=True, async_scheduling=True, max_num_seqs=8,
                adaptive_speculation=False)
    want, want_steps = {}, {}
    for name, params in params_sets():
        got = [local.generate(PROMPTS[r], params[r]) for r in range(2)]
        want[name] = [[o.token_ids for o in g] for g in got]
        want_steps[name] = [[o.metrics.acceptance_lengths for o in g] for g in got]
    with shared_replicas(root, kw) as (shared, llms):
        assert llms[0].stats()["features"]["async_scheduling"]["on"]
        for name, params in params_sets():
            steps = [None, None]
            assert generate_at_once(llms, params, steps) == want[name], name
            # The drafts too: a replica's context store in another's blocks would change them.
            assert steps == want_steps[name], name
        assert all(llm.stats()["num_async_steps"] > 0 for llm in llms)
        stats = shared.stats()
        assert all(s > 10 for s in stats["steps"]), stats
        for llm in llms:
            st = llm.stats()
            assert st["drafter"]["state"] == "up" and all(free == cap for free, cap in st["pools"].values())


def test_shared_drafter_replays_the_kinds_the_policy_takes(cluster):
    """The adaptive policy's kinds, forced in turn (whole blocks, shorter
    chains, autoregressive steps), with two replicas on one drafter: seeded
    samples are an in-process engine's forced the same way."""
    root = cluster
    kw = dict(KW, cuda_graphs=True, async_scheduling=True, max_num_seqs=8, admit_into_chain=False,
              extra={"policy_turns": [7, 3, 1, 0]})
    sampled = params_sets()[1][1]
    # An engine per replica: the forced turns run on from one generate call to the next.
    want = [[o.token_ids for o in LLM(root / "t", root / "d", **kw).generate(PROMPTS[r], sampled[r])] for r in range(2)]
    with shared_replicas(root, kw) as (_, llms):
        assert generate_at_once(llms, sampled) == want
        for llm in llms:
            st = llm.stats()
            assert {"0", "1", "3", "7"} <= set(st["speculation"]["steps_by_drafts"]), st["speculation"]
            assert st["drafter"]["state"] == "up" and st["num_async_steps"] > 0


def test_requests_join_the_chains_of_replicas_sharing_a_drafter(cluster):
    """Requests arriving while each replica's chain runs join it (JOINED
    words to the shared drafter, each replica's in its own partition):
    both replicas' greedy tokens, and seeded samples where every step
    verifies the whole block (they depend on the drafts), are the
    in-process engine's."""
    root = cluster
    lengths = [80] + MAX_TOKENS[1:]  # the first request's chain runs while the others arrive
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    sampled = [SamplingParams(max_tokens=n, temperature=0.8, seed=100 + i, ignore_eos=True) for i, n in enumerate(lengths)]
    for params, adaptive in ((greedy, None), (sampled, False)):
        want = [[o.token_ids for o in LLM(root / "t", root / "d").generate(PROMPTS[r], params)] for r in range(2)]
        kw = dict(KW, cuda_graphs=True, async_scheduling=True, max_num_seqs=8, adaptive_speculation=adaptive)
        config = EngineConfig(target=str(root / "t"), drafter=str(root / "d"), **kw)
        shared = start_shared_drafter(config, 2)
        engines = []
        try:
            engines = [AsyncEngine.from_config(config, "ray", shared_drafter=shared.replica(r)) for r in range(2)]
            got = asyncio.run(asyncio.wait_for(_staggered_on_both(engines, params), 240))
            assert [list(g) for g in got] == want
            for engine in engines:
                stats = engine.stats()
                assert stats["chain_joins"] > 0 and stats["drafter"]["losses"] == 0, stats
                assert all(free == cap for free, cap in stats["pools"].values())
        finally:
            for engine in engines:
                engine.shutdown()
            shared.shutdown()


async def _staggered_on_both(engines, params):
    """Each replica's first request, then its others once that one's
    chain runs, both replicas at once; each request's tokens."""
    async def replica(r):
        started = asyncio.Event()

        async def one(i):
            if i:
                await started.wait()
                await asyncio.sleep(0.05 * i)
            out = None
            async for out in engines[r].generate(PROMPTS[r][i], params[i], request_id=f"r{r}-{i}"):
                started.set()
            return out.token_ids

        return await asyncio.gather(*(one(i) for i in range(len(params))))

    return await asyncio.gather(*(replica(r) for r in range(len(engines))))


def test_lost_shared_drafter_replicas_step_on(cluster):
    """The shared drafter killed: each replica's next propose fails (the
    pair closed), and it steps on autoregressively with the same tokens."""
    root = cluster
    kw = dict(KW, drafter_timeout_s=3.0)
    greedy = params_sets()[0][1]
    want = inprocess_greedy(root)
    with shared_replicas(root, kw) as (shared, llms):
        assert generate_at_once(llms, greedy) == want
        ray.kill(shared.actor)
        assert generate_at_once(llms, greedy) == want
        for llm in llms:
            assert llm.stats()["drafter"]["state"] != "up"


def test_replica_rebuilt_pairs_again(cluster):
    """Replica 0's rank 0 SIGKILLed: its group is rebuilt and pairs with the
    shared drafter again under its index (the old pair's loop ends); both
    replicas then draft and give the in-process tokens."""
    import os
    import signal

    import ray._private.state

    root = cluster
    greedy = params_sets()[0][1]
    want = inprocess_greedy(root)
    with shared_replicas(root, KW) as (_, llms):
        assert generate_at_once(llms, greedy) == want
        pid = ray._private.state.actors()[llms[0]._core.driver._actor_id.hex()]["Pid"]
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 120
        while llms[0]._core.group.rebuilds == 0:  # the front finds it lost on its next call
            try:
                llms[0].generate(PROMPTS[0][:1], greedy[0][:1])
            except Exception:  # noqa: BLE001  (EngineUnavailable while it is rebuilt)
                pass
            assert time.monotonic() < end
        got = [llms[r].generate(PROMPTS[r], greedy[r]) for r in range(2)]
        assert [[o.token_ids for o in g] for g in got] == want
        assert all(sum(o.metrics.num_draft_tokens for o in g) > 0 for g in got)
        assert all(llm.stats()["drafter"]["state"] == "up" for llm in llms)


def test_shared_drafter_bad_configs(cluster):
    root = cluster
    config = EngineConfig(target=str(root / "t"), drafter=str(root / "d"), **KW)
    with pytest.raises(ConfigError, match="num_replicas"):
        start_shared_drafter(config, 0)
    shared = start_shared_drafter(config, 1)
    try:
        with pytest.raises(ConfigError, match="replica index"):
            shared.replica(1)
        with pytest.raises(ConfigError, match="backend='ray'"):
            LLM(root / "t", root / "d", shared_drafter=shared.replica(0), **KW)
        with pytest.raises(ConfigError, match="drafter_placement"):
            LLM(root / "t", root / "d", backend="ray", drafter_placement="colocated",
                shared_drafter=shared.replica(0), **KW)
        with pytest.raises(ConfigError, match="kv_block_size"):
            LLM(root / "t", root / "d", backend="ray", shared_drafter=shared.replica(0),
                num_kv_blocks=300, kv_block_size=8)
    finally:
        shared.shutdown()
