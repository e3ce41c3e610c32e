"""Faults inside one engine, in process (cluster/faults.py): a drafter that
fails is replaced and its context re-seeded while the requests go on
autoregressively, a request that breaks a step fails alone, deadlines end
requests, a lost process group ends the loop, and the replica's health
reflects all of it. The Ray placements are in test_faults_ray.py."""

import asyncio
import dataclasses
import time

import pytest
import torch

from factories import make_models
from specray import LLM, SamplingParams
from specray.actors.drafter import DrafterWorker
from specray.config import EngineConfig
from specray.engine_loop import EngineLoop
from specray.faults import reseed
from specray.llm import build_engine
from specray.serve import health as H
from specray.serve import protocol as P

PROMPTS = [[5, 17, 33, 2, 9, 10, 42], [3, 4], list(range(2, 40)), [7] * 15, [11, 12, 13], [20, 21, 22],
           [30, 31], [40, 41, 42, 43]]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
KW = dict(num_kv_blocks=300, kv_block_size=4, prompt_lookup_min=0)  # drafts come from the drafter alone


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def want(models):
    return [o.token_ids for o in LLM(models / "t", models / "d", **KW).generate(PROMPTS, GREEDY)]


def pools_free(engine) -> bool:
    s = engine.scheduler
    return all(p.num_free == p.capacity for p in (s.target_pool, s.draft_pool) if p is not None)


@pytest.mark.parametrize("graphs", [False, True])
def test_reseed_gives_the_context_the_steps_stored(models, graphs):
    """A new drafter re-seeded from the running requests holds the context
    KV the engine's own drafter was given step by step (prefill chunks,
    decode blocks), and the target's cache is left as it was (its re-run
    writes only into the reserved block 0)."""
    engine = build_engine(EngineConfig(target=str(models / "t"), drafter=str(models / "d"), max_num_batched_tokens=24,
                                       cuda_graphs=graphs, **KW))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, request_id=str(i))
    for _ in range(6):
        engine.step()
    running = [r for r in engine.scheduler.running if r.num_computed]
    assert len(running) >= 4 and any(r.is_prefilling for r in running) and any(r.output_token_ids for r in running)
    target_before = engine.target.kv_cache.clone()
    c = engine.config
    fresh = DrafterWorker(engine.drafter_spec, engine.target_spec, max_model_len=engine.max_model_len)
    fresh.init_cache(engine.scheduler.draft_pool.num_blocks, c.kv_block_size)
    n = reseed(engine, fresh)
    assert n == sum(r.num_computed for r in running)
    assert torch.equal(engine.target.kv_cache[:, :, 1:], target_before[:, :, 1:])

    def flat(cache):
        L, two, blocks, bs, h, d = cache.shape
        return cache.reshape(L, two, blocks * bs, h, d)

    for r in running:
        slots = torch.tensor(r.draft_blocks.slots(0, r.num_computed))
        got, ref = flat(fresh.kv_cache)[:, :, slots], flat(engine.drafter.kv_cache)[:, :, slots]
        assert ref.abs().sum() > 0
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("where", ["step", "nan", "append"])
def test_a_request_that_breaks_the_step_fails_alone(models, want, where):
    """One request raising inside the step (the forward, NaN logits, its
    own host code): it fails with its error, the other 7 finish with the
    tokens they have without it, and every block is free again."""
    llm = LLM(models / "t", models / "d", extra={"fault_injection": {"seed": 666, "where": where}}, **KW)
    params = [GREEDY] * len(PROMPTS)
    params[3] = dataclasses.replace(GREEDY, seed=666)
    got = llm.generate(PROMPTS, params, errors="return")
    assert [o.finish_reason for o in got] == ["length"] * 3 + ["error"] + ["length"] * 4
    assert [o.token_ids for i, o in enumerate(got) if i != 3] == [w for i, w in enumerate(want) if i != 3]
    assert got[3].error_kind == "request"
    why = {"step": "injected step failure", "nan": "NaN", "append": "injected failure appending"}[where]
    assert why in got[3].error
    assert not llm.engine.has_unfinished() and pools_free(llm.engine)
    with pytest.raises(RuntimeError, match="the engine failed a step"):  # the default: raise
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, params[3]])
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == want[:2]


def test_a_drafter_that_raises_is_replaced_and_reseeded(models, want):
    """The drafter raising mid-generation (in process: what a colocated one
    does): the step runs without it, a new drafter is built and re-seeded
    with the running requests' context, speculation resumes; the tokens
    are the ones a run without the fault gives."""
    llm = LLM(models / "t", models / "d", **KW)
    first = llm.engine.drafter.inner
    calls = []

    def propose(batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected drafter failure")
        return DrafterWorker.propose(first, batch)

    first.propose = propose
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == want
    state = llm._faults.drafter
    assert (state.state, state.losses, state.restarts) == ("up", 1, 1)
    assert state.reseeded > sum(len(p) for p in PROMPTS) and "injected drafter failure" in state.error
    assert llm.engine.drafter.inner is not first
    # the loss cost one step of drafts (every request's block was one row)
    assert all(1 in o.metrics.acceptance_lengths for o in got)
    later = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in later] == want and all(o.metrics.num_draft_tokens for o in later)


def test_a_drafter_that_keeps_failing_is_given_up(models, want, monkeypatch):
    llm = LLM(models / "t", models / "d", **KW)
    llm._faults.max_restarts = 2

    def broken(self, batch):
        raise RuntimeError("the drafter is broken")

    monkeypatch.setattr(DrafterWorker, "propose", broken)
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == want
    assert (llm._faults.drafter.state, llm._faults.drafter.losses) == ("failed", 3)
    assert llm.engine.drafter is None and all(set(o.metrics.acceptance_lengths) == {1} for o in got[1:])
    assert H.http_health({"engine": "ok", "loop": "running", "drafter": llm._faults.drafter.as_dict()})[1][
        "status"] == "degraded"


def test_sampled_requests_go_on_through_a_drafter_loss(models):
    llm = LLM(models / "t", models / "d", **KW)
    inner, calls = llm.engine.drafter.inner, []

    def propose(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected drafter failure")
        return DrafterWorker.propose(inner, batch)

    inner.propose = propose
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    got = llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in got] == [30] * len(PROMPTS) and llm._faults.drafter.restarts == 1
    assert pools_free(llm.engine)


def test_a_patch_on_the_guarded_drafter_runs_inside_the_guard(models, want):
    """Tests and benches wrap the drafter method they see (the guard's):
    the wrapper runs in place of the drafter's own method, calls through
    without recursing, and its failure is a drafter loss like any other."""
    llm = LLM(models / "t", models / "d", **KW)
    guard, calls = llm.engine.drafter, []
    seen = guard.propose

    def wrapped(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected in the wrapper")
        return seen(batch)

    guard.propose = wrapped
    assert "propose" not in vars(guard.inner)  # the drafter itself stays unpatched
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == want and len(calls) == 3
    assert llm._faults.drafter.losses == 1 and "injected in the wrapper" in llm._faults.drafter.error
    # the new drafter's guard carries no patch: it speculates undisturbed
    assert llm.engine.drafter is not guard and not llm.engine.drafter._patches
    assert all(o.metrics.num_draft_tokens for o in llm.generate(PROMPTS, GREEDY))


ASYNC = dict(cuda_graphs=True, async_scheduling=True, adaptive_speculation=False)  # every decode step a step graph


@pytest.mark.parametrize("part", ["propose_hidden", "store_context"])
@pytest.mark.parametrize("every_drafter", [False, True])
def test_a_drafter_failing_inside_async_step_graphs_is_lost_not_the_step(models, want, part, every_drafter,
                                                                         monkeypatch):
    """Async step graphs (the GPU default) run the drafter's propose and
    context store inside the step: its failure there is a drafter loss
    (steps go on autoregressively, a new drafter is re-seeded), not a
    failed step, whose retries on halves of the batch would meet the same
    drafter in each and fail every request. ``every_drafter``: the new ones
    fail too, and the engine gives up on drafting."""
    from specray.actors.models.dflash import DFlashDrafter

    llm = LLM(models / "t", models / "d", **KW, **ASYNC)
    llm._faults.max_restarts = 2
    first = llm.engine.drafter.inner.model
    orig, calls = getattr(DFlashDrafter, part), []

    def failing(self, *a, **k):
        calls.append(llm.engine.num_async_steps)
        if (every_drafter or self is first) and llm.engine.num_async_steps >= 3:
            raise RuntimeError("injected drafter failure")
        return orig(self, *a, **k)

    monkeypatch.setattr(DFlashDrafter, part, failing)
    got = llm.generate(PROMPTS, GREEDY, errors="return")
    assert [o.finish_reason for o in got] == ["length"] * len(PROMPTS)
    assert [o.token_ids for o in got] == want
    state = llm._faults.drafter
    assert "injected drafter failure" in state.error
    if every_drafter:
        assert (state.state, state.losses) == ("failed", 3)
        return
    assert (state.state, state.losses, state.restarts) == ("up", 1, 1) and state.reseeded > 0
    steps = llm.engine.num_async_steps
    later = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in later] == want and all(o.metrics.num_draft_tokens for o in later)
    assert llm.engine.num_async_steps > steps  # the new drafter runs inside step graphs again


def loop_for(models, **kw) -> EngineLoop:
    engine = build_engine(EngineConfig(target=str(models / "t"), drafter=str(models / "d"), **{**KW, **kw}))
    return EngineLoop(engine)


def collect(loop, ids, deadline_s=60.0) -> dict:
    done, cursor, end = {}, -1, time.monotonic() + deadline_s
    while len(done) < len(ids):
        assert time.monotonic() < end, "requests did not finish"
        cursor, outs = loop.get_outputs(cursor, 0.5)
        done.update({o.request_id: o for o in outs if o.finished})
    return done


def test_a_request_past_its_timeout_fails_alone(models):
    loop = loop_for(models, max_model_len=512)
    try:
        long = SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
        t = time.monotonic()
        errors = loop.submit([([5, 6, 7], long, "late", 0.3), ([8, 9], GREEDY, "fine")])
        assert errors == [None, None]
        done = collect(loop, ["late", "fine"])
        late = done["late"]
        assert (late.finish_reason, late.error_kind) == ("error", "timeout") and "0.3 s" in late.error
        assert 0 < len(late.token_ids) < 480 and time.monotonic() - t < 10
        assert done["fine"].finish_reason == "length"
        bad = loop.submit([([5], GREEDY, "x", 0), ([5], GREEDY, "y", float("inf")), ([5], GREEDY, "z", "1")])
        assert all(isinstance(e, ValueError) and "timeout" in str(e) for e in bad)
        assert P.output_error(late).status == 504
    finally:
        loop.stop()


def test_a_stuck_step_shows_in_health_and_the_front_times_out(models, monkeypatch):
    """A step that hangs: the loop's stats say how long it has run (Serve's
    check then fails the replica), and a request's own timeout still ends
    its stream (the front gives up on an engine that does not answer)."""
    from specray import async_engine
    from specray.async_engine import AsyncEngine, RequestTimeout, _LocalCore

    monkeypatch.setattr(async_engine, "_TIMEOUT_GRACE_S", 0.5)
    loop = loop_for(models, extra={"fault_injection": {"seed": 667, "where": "hang", "hang_s": 4}})
    engine = AsyncEngine(_LocalCore(loop))

    async def run():
        outs = []
        async for o in engine.generate([5, 6, 7], dataclasses.replace(GREEDY, seed=667), timeout=0.5):
            outs.append(o)
        return outs

    try:
        t = time.monotonic()
        with pytest.raises(RequestTimeout):
            asyncio.run(run())
        assert time.monotonic() - t < 3
        h = engine.health()
        assert h["step_running_s"] > 0.5
        with pytest.raises(RuntimeError, match="stuck"):
            H.check(h, stuck_step_s=0.5, rebuild_grace_s=60)
        H.check(h, stuck_step_s=60, rebuild_grace_s=60)  # within its bound: healthy
    finally:
        loop.stop()


def test_a_lost_process_group_ends_the_loop_and_fails_its_requests(models):
    """A collective that fails (a TP rank gone) is no request's fault: every
    request fails as the engine's ("engine", HTTP 503), the loop ends, and
    submit and polls say the engine is unavailable (the Ray front rebuilds)."""
    loop = loop_for(models)
    calls = []
    execute = loop.engine.target.execute

    def dying(batch):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        return execute(batch)

    loop.engine.target.execute = dying
    try:
        loop.submit([(p, GREEDY, str(i)) for i, p in enumerate(PROMPTS)])
        done = collect(loop, [str(i) for i in range(len(PROMPTS))])
        assert {(o.finish_reason, o.error_kind) for o in done.values()} == {("error", "engine")}
        assert P.output_error(done["0"]).status == 503
        st = loop.stats()
        assert st["loop"] == "failed" and "Connection closed" in st["failure"]
        assert "unavailable" in str(loop.submit([([5], GREEDY, "after")])[0])
        with pytest.raises(RuntimeError, match="unavailable"):
            loop.get_outputs(10**9, 0.1)  # past every output it had
        assert H.http_health({"engine": "ok", **st})[0] == 503
    finally:
        loop.stop()


def test_health_and_error_mapping():
    assert H.http_health({"engine": "ok", "loop": "running", "drafter": {"state": "up"}}) == (200, {"status": "ok"})
    code, body = H.http_health({"engine": "ok", "loop": "running", "drafter": {"state": "down", "losses": 1}})
    assert code == 200 and body["status"] == "degraded"
    assert H.http_health({"engine": "rebuilding"})[0] == 503
    for h in ({"engine": "failed"}, {"engine": "unresponsive"}, {"engine": "rebuilding", "rebuilding_s": 99},
              {"engine": "ok", "loop": "stopped"}):
        with pytest.raises(RuntimeError):
            H.check(h, stuck_step_s=60, rebuild_grace_s=60)
    H.check({"engine": "rebuilding", "rebuilding_s": 5}, stuck_step_s=60, rebuild_grace_s=60)
    H.check({"engine": "ok", "loop": "running", "drafter": {"state": "failed"}}, 60, 60)  # degraded still serves
    # a stream cut by a fault ends with an error event, never [DONE]
    from specray.faults import EngineUnavailable
    from specray.request import RequestMetrics, RequestOutput

    out = RequestOutput("r", None, [1], "x", [2], True, "error", RequestMetrics(), error="boom", error_kind="engine")
    w = P.ChunkWriter("chat", "id", "m", False, False, [None])
    chunks = w.delta(0, out)
    assert b"[DONE]" not in b"".join(chunks) and b'"engine_unavailable"' in chunks[-1]
    assert P.exception_error(EngineUnavailable("lost")).status == 503
    assert P.output_error(dataclasses.replace(out, error_kind="request")).status == 500


def test_batch_rows_of_a_lost_engine_are_marked_to_run_again():
    """A batch the engine lost a worker under comes back as error rows of
    stage "unavailable" (a rerun runs them again); a row that failed alone
    is the engine's error of that row."""
    from specray.batch import Replica
    from specray.faults import EngineUnavailable
    from specray.request import RequestMetrics, RequestOutput

    class Lost:
        tokenizer, engine = None, None

        def generate(self, prompts, params, errors="raise"):
            raise EngineUnavailable("the engine lost a worker and is being rebuilt (ActorDiedError: ...)")

    class OneFails(Lost):
        def generate(self, prompts, params, errors="raise"):
            assert errors == "return"
            return [RequestOutput(str(i), p, [1], "hi", [2, 3], True, "error" if p == "bad" else "length",
                                  RequestMetrics(), error="Traceback ...\nRuntimeError: boom" if p == "bad" else None)
                    for i, p in enumerate(prompts)]

    rows = [{"line": i + 1, "id_json": f'"r{i}"', "task": f'{{"prompt": "{p}", "params": {{"max_tokens": 4}}}}'}
            for i, p in enumerate(["a", "bad", "c"])]
    replica = Replica.__new__(Replica)
    replica.llm = Lost()
    out = replica.run(rows)
    assert [(r["error_stage"], r["error"].startswith("the engine was unavailable")) for r in out] == \
        [("unavailable", True)] * 3
    replica.llm = OneFails()
    out = replica.run(rows)
    assert [r["error"] for r in out] == [None, "the engine failed this row: RuntimeError: boom", None]
    assert [r["error_stage"] for r in out] == [None] * 3 and out[0]["text"] == "hi"
