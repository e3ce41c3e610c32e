"""Asynchronous decode steps (async_decode.py) emit exactly what synchronous
steps emit, through everything that ends or changes a row while the next
step is already in flight: stop tokens, stop strings, max_tokens, the
model's length limit, an abort, a sampled request joining the batch, and
admissions."""

import pytest
import torch

from factories import make_models
from specray.config import EngineConfig
from specray.llm import build_engine
from specray.sampling import SamplingParams

MAX_MODEL_LEN = 96


def pair(root):
    """The random pair these engines run (``prompts()`` draws ids below its vocabulary of 320)."""
    return make_models(root, seed=4, drafter_seed=14, block_size=6, vocab_size=320)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return pair(tmp_path_factory.mktemp("async"))


def engine(root, drafter: bool, async_: bool, **kw):
    # Engines compared share one lookup rule: the one that needs the
    # drafter's agreement unless a test asks for the plain one.
    kw.setdefault("prompt_lookup_agree", True)
    # Sync and async steps are compared token for token, sampled rows too:
    # the adaptive policy's autoregressive steps would change which uniforms
    # a sampled row draws (test_spec_policy.py tests it on its own).
    kw.setdefault("adaptive_speculation", False)
    return build_engine(EngineConfig(
        target=str(root / "t"), drafter=str(root / "d") if drafter else None, kv_block_size=4,
        num_kv_blocks=300, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, cuda_graphs=True,
        async_scheduling=async_, **kw,
    ))


def prompts():
    g = torch.Generator().manual_seed(3)
    lens = [6, 11, 4, 70, 9, 14, 5]
    return [torch.randint(2, 319, (n,), generator=g).tolist() for n in lens]


def run(eng, prompts, params, joins=(), abort=None):
    """Step until done; request ``i`` in ``joins`` (index: step) joins at
    that step; ``abort`` = (request id, step) aborts it there. Returns the
    final outputs."""
    joins = dict(joins)
    outs, step = {}, 0
    for i in range(len(prompts)):
        if i not in joins:
            eng.add_request(prompts[i], params[i], request_id=str(i))
    while eng.has_unfinished() or step <= max(joins.values(), default=0):
        for i, at in joins.items():
            if at == step:
                eng.add_request(prompts[i], params[i], request_id=str(i))
        if abort and step == abort[1]:
            outs[abort[0]] = eng.abort_request(abort[0])
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
        assert step < 1000
    return outs


@pytest.mark.parametrize("drafter,lanes", [(True, False), (False, False), (True, True)], ids=["spec", "ar", "lanes"])
def test_async_steps_equal_sync_steps(models, drafter, lanes):
    """``lanes``: a batch of two or more runs as two micro-batch chains
    (overlap; on the CPU in turn), each from its own graphs and state."""
    ps = prompts()
    greedy = lambda n, **kw: SamplingParams(max_tokens=n, temperature=0, **kw)  # noqa: E731
    # Free continuations, to pick stops that end requests mid-step.
    free = run(engine(models, drafter, False), ps, [greedy(40, ignore_eos=True)] * len(ps))
    stop_tok = free["1"].token_ids[9]
    stop_str = free["2"].text[len(free["2"].text) // 3:][:3]
    assert stop_str.strip(), free["2"].text
    params = [
        greedy(40, ignore_eos=True),
        greedy(40, stop_token_ids=[stop_tok], ignore_eos=True),
        greedy(40, stop=stop_str, ignore_eos=True),
        greedy(100, ignore_eos=True),  # 70-token prompt: ends at max_model_len
        SamplingParams(max_tokens=15, temperature=1.0, seed=5),  # joins late; no async step while it runs
        greedy(33, ignore_eos=True),  # aborted
        greedy(27, ignore_eos=True),  # joins late
    ]
    joins, abort = {4: 30, 6: 20}, ("5", 25)
    sync = run(engine(models, drafter, False), ps, params, joins, abort)
    eng = engine(models, drafter, True, **(dict(overlap=True, overlap_min_batch=2) if lanes else {}))
    # Rows applied after their request had finished, with the next step in flight.
    dropped = []
    apply = eng._apply_inflight

    def counting_apply(step, chained):
        dropped.extend(r.request_id for r in step.requests if r.finished)
        return apply(step, chained)

    eng._apply_inflight = counting_apply
    got = run(eng, ps, params, joins, abort)
    assert eng.num_async_steps > 10
    assert any(key[1] == 1 for key in eng._step_graphs) == lanes, sorted(eng._step_graphs)
    assert {"1", "2", "5"} <= set(dropped), dropped
    for rid in map(str, range(len(ps))):
        if rid == "5":
            assert got[rid].finish_reason == "abort"
            assert got[rid].token_ids == sync[rid].token_ids[: len(got[rid].token_ids)]
            continue
        assert got[rid].token_ids == sync[rid].token_ids, rid
        assert (got[rid].text, got[rid].finish_reason, got[rid].stop_reason) == \
            (sync[rid].text, sync[rid].finish_reason, sync[rid].stop_reason), rid
    assert sync["1"].stop_reason == stop_tok and sync["2"].stop_reason == stop_str
    assert sync["3"].finish_reason == "length" and len(sync["3"].token_ids) == MAX_MODEL_LEN - 70
    sched = eng.scheduler
    assert sched.target_pool.num_free == sched.target_pool.capacity
    if drafter:
        assert sched.draft_pool.num_free == sched.draft_pool.capacity
        # Acceptance of the async engine's steps is recorded like the sync one's.
        assert sum(len(o.metrics.acceptance_lengths) for o in got.values()) > 0
        for rid in map(str, range(len(ps))):
            if rid != "5":
                g, w = got[rid].metrics, sync[rid].metrics
                assert (g.acceptance_lengths, g.num_draft_tokens) == (w.acceptance_lengths, w.num_draft_tokens), rid


def test_fewer_speculative_tokens_than_the_drafters_block(models):
    """num_speculative_tokens=2 with a drafter trained on blocks of 6: every
    step verifies at most 3 rows, the drafter drafts 3-row blocks from its
    decode graphs (not eagerly), greedy output is the autoregressive
    output, and async steps emit what sync steps emit, sampled rows too."""
    ps = prompts()
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 5 + \
        [SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in (7, 8)]
    ar = run(engine(models, False, False), ps, params)
    runs = {}
    for async_ in (False, True):
        eng = engine(models, True, async_, num_speculative_tokens=2)
        assert eng.block_size == 3
        replays = {"propose": 0, "context": 0}
        for name, g in (("propose", eng.drafter.graphs), ("context", eng.drafter.context_graphs)):
            g.run = (lambda run_, name: lambda n, inputs: replays.__setitem__(name, replays[name] + 1)
                     or run_(n, inputs))(g.run, name)
        runs[async_] = run(eng, ps, params)
        lengths = [a for o in runs[async_].values() for a in o.metrics.acceptance_lengths]
        assert max(lengths) <= 3 and len(lengths) > 0
        if async_:
            assert eng.num_async_steps > 5
        else:
            assert min(replays.values()) > 0, f"the drafter ran its shorter blocks eagerly: {replays}"
    for rid in map(str, range(len(ps))):
        assert runs[True][rid].token_ids == runs[False][rid].token_ids, rid
        if params[int(rid)].temperature == 0:
            assert runs[False][rid].token_ids == ar[rid].token_ids, rid
    # The drafters' blocks are accepted at times (every row verifies a tree
    # of two nodes, often two siblings, so a full block is not guaranteed).
    assert max(a for o in runs[False].values() for a in o.metrics.acceptance_lengths) >= 2


@pytest.mark.parametrize("agree", [False, True], ids=["plain", "agree"])
def test_async_lookups_draft_what_sync_lookups_draft(models, agree, monkeypatch):
    """Prompt lookups in async steps come from the rows' tokens on the
    device, which every replay extends: step by step the same drafts as the
    host's index, so the same acceptance lengths and lookup counts (with
    ``agree``, the same lookups refused for opening with another token than
    the drafter's)."""
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(2, 319, (5,), generator=g).tolist()
    ps = [motif * 4, prompts()[0] * 3, motif + prompts()[1] + motif[:3], motif[::-1] * 3]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (50, 40, 45, 12)]
    # Request 3 finishes early and request 2 joins later: rows of the
    # device history are reclaimed and reused across chains.
    joins = {2: 12}
    # The agreement rule is a chain's (a tree takes every lookup as a branch).
    tree = {"draft_tree": False} if agree else {}
    if agree:
        plain = run(engine(models, True, True, prompt_lookup_agree=False, **tree), ps, params, joins)
        # A drafter that drafts the outputs' most common token everywhere:
        # the lookups that open with it agree, the others do not.
        from collections import Counter

        from specray.actors.models.dflash import DFlashDrafter

        common = Counter(t for o in plain.values() for t in o.token_ids).most_common(1)[0][0]
        logits = DFlashDrafter.logits
        monkeypatch.setattr(DFlashDrafter, "logits",
                            lambda self, hidden: logits(self, hidden).index_fill(-1, torch.tensor([common]), 1e4))
    sync = run(engine(models, True, False, prompt_lookup_agree=agree, **tree), ps, params, joins)
    eng = engine(models, True, True, prompt_lookup_agree=agree, **tree)
    got = run(eng, ps, params, joins)
    assert eng.num_async_steps > 10
    for rid in "0123":
        assert got[rid].token_ids == sync[rid].token_ids
        assert got[rid].metrics.acceptance_lengths == sync[rid].metrics.acceptance_lengths, rid
        assert got[rid].metrics.num_lookup_steps == sync[rid].metrics.num_lookup_steps, rid
    lookups = sum(o.metrics.num_lookup_steps for o in got.values())
    assert lookups > 5
    if agree:  # some were refused: the plain rule took more
        assert sum(o.metrics.num_lookup_steps for o in plain.values()) > lookups


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_sampled_async_steps_equal_sync_steps(models, drafter):
    """Sampled rows in async steps draw, on the device, the counter-based
    uniforms the host draws for synchronous steps: plain sampling, then
    top-k / top-p beside a greedy row, give the same tokens and acceptance."""
    ps = [prompts()[i] for i in (0, 1, 2, 4)]
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=37, temperature=1.3, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=35, temperature=1.0, top_p=0.9, top_k=20, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    for rows, graphs in (([0, 1], {"sampled"}), ([0, 1, 2, 3], {"filtered"})):
        sync = run(engine(models, drafter, False), [ps[i] for i in rows], [params[i] for i in rows])
        eng = engine(models, drafter, True)
        sync_plans = []
        sync_step = eng._sync_step
        eng._sync_step = lambda plan, t0: sync_plans.append(plan) or sync_step(plan, t0)
        got = run(eng, [ps[i] for i in rows], [params[i] for i in rows])
        assert eng.num_async_steps > 10 and graphs <= {mode for mode, _ in eng._step_graphs}
        # Every decode step ran async, the cut-short last blocks too.
        assert all(p.prefill and not p.decode for p in sync_plans), [len(p.decode) for p in sync_plans]
        for rid in map(str, range(len(rows))):
            assert got[rid].token_ids == sync[rid].token_ids, (rows, rid)
            g, w = got[rid].metrics, sync[rid].metrics
            assert (g.acceptance_lengths, g.num_draft_tokens, g.accepted_per_position) == \
                (w.acceptance_lengths, w.num_draft_tokens, w.accepted_per_position), (rows, rid)
        if drafter:
            assert max(a for o in got.values() for a in o.metrics.acceptance_lengths) > 1


def test_sampled_lookups_keep_sync_steps(models):
    """``prompt_lookup_sampled`` drafts for sampled rows with a one-hot q,
    which only synchronous steps build: such batches do not go async."""
    eng = build_engine(EngineConfig(
        target=str(models / "t"), drafter=str(models / "d"), kv_block_size=4, num_kv_blocks=300,
        max_model_len=MAX_MODEL_LEN, cuda_graphs=True, async_scheduling=True, prompt_lookup_sampled=True))
    run(eng, prompts()[:2], [SamplingParams(max_tokens=30, temperature=0.8, seed=i) for i in range(2)])
    assert eng.num_async_steps == 0


def test_async_steps_behind_the_tp_driver(models):
    """A Ray target rank at TP 1 drives its worker through TPDriver (the
    colocated deployment): the step graphs reach the worker's model."""
    from specray.actors.workers import TPDriver

    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = run(engine(models, True, False), prompts()[:2], [greedy] * 2)
    eng = engine(models, True, True)
    eng.target = TPDriver(eng.target, None)
    got = run(eng, prompts()[:2], [greedy] * 2)
    assert eng.num_async_steps > 5
    assert [got[k].token_ids for k in "01"] == [want[k].token_ids for k in "01"]


def test_async_scheduling_without_graphs_is_refused(models, capsys):
    from specray.config import ConfigError

    with pytest.raises(ConfigError, match="needs cuda_graphs"):
        EngineConfig(target=str(models / "t"), async_scheduling=True)
    pytest.importorskip("ray")
    from specray.serve.cli import main

    argv = ["--target", str(models / "t"), "--drafter", str(models / "d"), "--async-scheduling"]
    assert main(argv) == 2
    assert "needs cuda_graphs" in capsys.readouterr().err


def test_cuda_graphs_default_follows_the_device(models):
    t = str(models / "t")
    assert EngineConfig(target=t).cuda_graphs is False
    assert EngineConfig(target=t, device="cuda").cuda_graphs is True
    assert EngineConfig(target=t, device="cuda:1", cuda_graphs=False).cuda_graphs is False
    assert EngineConfig(target=t, device="cuda", async_scheduling=True).async_scheduling


def test_chains_while_a_waiting_request_does_not_fit(models, monkeypatch):
    """A request that cannot be admitted yet (KV full) does not stop the
    running ones from chaining; it gets in once one finishes."""
    import specray.engine as engine_module

    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(2, 319, (n,), generator=g).tolist() for n in (30, 30, 80)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 60, 20)]

    def build(async_):
        return build_engine(EngineConfig(
            target=str(models / "t"), drafter=str(models / "d"), kv_block_size=4, num_kv_blocks=50,
            max_model_len=128, max_num_seqs=8, cuda_graphs=True, async_scheduling=async_))

    want = run(build(False), ps, params, joins={2: 10})
    eng = build(True)
    chained_while_waiting = []
    launch = engine_module.launch_decode

    def counting(core, requests, chained, **kw):
        chained_while_waiting.append(chained and bool(core.scheduler.waiting))
        return launch(core, requests, chained, **kw)

    monkeypatch.setattr(engine_module, "launch_decode", counting)
    got = run(eng, ps, params, joins={2: 10})
    assert sum(chained_while_waiting) > 3, chained_while_waiting
    assert [got[k].token_ids for k in "012"] == [want[k].token_ids for k in "012"]


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_chains_start_at_the_prefill(models, drafter):
    """A prefill that finishes every running prompt launches their first
    decode step from the first tokens it left on the device
    (``chain_from_prefill``): the synchronous steps' tokens and acceptance
    lengths, one request or several at once, greedy or sampled. A request
    whose first token stops it has the chain's results dropped; one with
    max_tokens 1 starts no chain."""
    ps = prompts()
    greedy = lambda n, **kw: SamplingParams(max_tokens=n, temperature=0, **kw)  # noqa: E731
    first = run(engine(models, drafter, False), ps[:1], [greedy(1)])["0"].token_ids[0]
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(2, 319, (5,), generator=g).tolist()
    cases = [
        (ps[:1], [greedy(30, ignore_eos=True)], 1),
        ([motif * 4, motif[::-1] * 3], [greedy(40, ignore_eos=True)] * 2, 1),  # lookups from the first step
        (ps[:3], [greedy(25, ignore_eos=True), greedy(12, ignore_eos=True), greedy(30, ignore_eos=True)], 1),
        (ps[1:3], [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)], 1),
        (ps[:1], [greedy(30, stop_token_ids=[first], ignore_eos=True)], 1),
        (ps[:1], [greedy(1, ignore_eos=True)], 0),
    ]
    for case, (prompts_, params, chains) in enumerate(cases):
        sync = run(engine(models, drafter, False), prompts_, params)
        eng = engine(models, drafter, True)
        got = run(eng, prompts_, params)
        assert eng.num_prefill_chains == chains, case
        for rid in sync:
            assert got[rid].token_ids == sync[rid].token_ids, (case, rid)
            assert got[rid].metrics.acceptance_lengths == sync[rid].metrics.acceptance_lengths, (case, rid)
        if chains and case != 4:
            assert eng.num_async_steps > 0, case
    assert len(got["0"].token_ids) == 1
    # The first token is in the device's copy of the row, after the prompt,
    # before any chained step: the first step's lookups read it.
    eng = engine(models, drafter, True)
    eng.add_request(motif * 4, greedy(40, ignore_eos=True), request_id="m")
    eng.step()
    r = eng.requests["m"]
    if drafter:
        row = eng._step_buffers[0]["history"][r.history_slot, : r.num_tokens].tolist()
        assert eng._inflight and row == r.all_token_ids


def test_an_admission_beside_graphed_decode_rows_is_prefilled_alone(models):
    """A prompt admitted while rows decode as step graphs is prefilled in a
    step of its own (beside it those rows would verify synchronously); the
    next step runs every row as a graph again, with the same tokens (rows
    that may not join the running chain: chain_admit.py)."""
    ps = prompts()
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 2
    eng = engine(models, True, True, admit_into_chain=False)
    eng.add_request(ps[0], params[0], request_id="a")
    for _ in range(3):  # prefill, then graphed steps
        eng.step()
    assert eng._inflight
    eng.add_request(ps[1], params[1], request_id="b")
    seen = []
    while eng.has_unfinished():
        async_before = eng.num_async_steps
        outs = eng.step()
        seen.append((eng.num_async_steps > async_before, sorted(o.request_id for o in outs if o.delta_token_ids)))
    # the chain drains (a's in-flight step), then b's prompt alone (a emits nothing), then both as graphs
    sync_steps = [ids for was_async, ids in seen if not was_async]
    assert sync_steps == [["b"]]
    want = run(engine(models, False, False), ps[:2], params)
    again = run(engine(models, True, True), ps[:2], params, joins={1: 3})
    assert [again[str(i)].token_ids for i in range(2)] == [want[str(i)].token_ids for i in range(2)]


def test_prompts_admitted_together_are_prefilled_one_a_step(models, monkeypatch):
    """On a GPU up to ``lone_prefills`` prompts admitted at once are prefilled
    one a step through the captured prefill graphs (here forced on the CPU's
    padded path); tokens stay those of autoregressive decoding."""
    from specray.engine import EngineCore

    monkeypatch.setattr(EngineCore, "lone_prefills_off_cuda", True)
    ps = prompts()
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)] * 4
    eng = engine(models, True, True, admit_into_chain=False)
    eng.add_request(ps[0], params[0], request_id="a")
    for _ in range(3):
        eng.step()
    for i, rid in ((1, "b"), (2, "c"), (4, "d")):
        eng.add_request(ps[i], params[0], request_id=rid)
    sync_steps, outs = [], {}
    while eng.has_unfinished():
        async_before = eng.num_async_steps
        got = eng.step()
        outs.update({o.request_id: o for o in got if o.finished})
        if eng.num_async_steps == async_before:
            sync_steps.append(sorted(o.request_id for o in got if o.delta_token_ids))
    assert sync_steps == [["b"], ["c"], ["d"]]
    want = run(engine(models, False, False), [ps[0], ps[1], ps[2], ps[4]], params)
    assert [outs[r].token_ids for r in "abcd"] == [want[str(i)].token_ids for i in range(4)]
    # off: one eager step of the three prompts
    eng = engine(models, True, True, lone_prefills=0, admit_into_chain=False)
    eng.add_request(ps[0], params[0], request_id="a")
    for _ in range(3):
        eng.step()
    for i, rid in ((1, "b"), (2, "c"), (4, "d")):
        eng.add_request(ps[i], params[0], request_id=rid)
    for _ in range(10):  # a's chain drains, then the first synchronous step
        async_before = eng.num_async_steps
        got = eng.step()
        if eng.num_async_steps == async_before:
            break
    assert sorted(o.request_id for o in got if o.delta_token_ids) == ["b", "c", "d"]


def test_a_capture_warm_up_on_the_last_chains_rows_writes_no_cache(models):
    """A step kind first used at a chain's start is captured (every batch
    size) before its inputs arrive, with the last chain's rows in its
    buffers (shared by the kinds): the capture's warm-up calls, which run
    on a GPU (called directly here), write neither cache outside the
    padding block 0. Run on those rows, they wrote the target's and the
    drafter's K/V where the last chain's rows point, blocks the next
    requests' prompts may hold (H100: a sampled generate after a greedy
    one gave other samples than a fresh engine)."""
    eng = engine(models, True, True)
    run(eng, prompts(), [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 7)
    assert eng.has_step_graphs("greedy") and not eng.has_step_graphs("sampled")
    graphs = eng.step_graphs("sampled")
    assert int(graphs.buffers["start"].max()) > 0  # the greedy chain's rows
    drafter = getattr(eng.drafter, "inner", eng.drafter)
    target_kv, draft_kv = eng.target.kv_cache.clone(), drafter.kv_cache.clone()
    graphs.warm_up(graphs.sizes[-1])
    assert torch.equal(eng.target.kv_cache[:, :, 1:], target_kv[:, :, 1:])
    assert torch.equal(drafter.kv_cache[:, :, 1:], draft_kv[:, :, 1:])


def test_gpu_step_graphs_with_a_drafter_on_another_gpu_are_opt_in():
    """On a GPU a drafter in another process replays its half of the step
    graphs by default where the GPU tests run it (on rank 0's GPU, through
    the CUDA IPC ring); on another GPU (NCCL, not yet run on GPUs) only
    with remote_step_graphs=True: without it the engine runs synchronous
    steps and says why. False turns them off for both; a drafter in rank
    0's process, and every CPU engine, are unaffected."""
    from types import SimpleNamespace

    from specray.async_decode import AsyncSteps
    from specray.config import EngineConfig

    class Remote:
        runs_step_graphs = True

    class Beside(Remote):
        on_rank0_gpu = True

    class Local(Remote):
        local_model = True

    def unsupported(drafter, device, **kw):
        core = SimpleNamespace(config=EngineConfig(target="t", device=device, cuda_graphs=True, async_scheduling=True,
                                                   **kw), device=torch.device(device), target=Local(), drafter=drafter)
        core.drafter_apart = lambda: AsyncSteps.drafter_apart(core)
        return AsyncSteps._async_unsupported(core)

    assert "remote_step_graphs=True" in unsupported(Remote(), "cuda")
    assert unsupported(Remote(), "cuda", remote_step_graphs=True) is None
    assert unsupported(Beside(), "cuda") is None
    assert "remote_step_graphs=False" in unsupported(Beside(), "cuda", remote_step_graphs=False)
    assert unsupported(Local(), "cuda") is None and unsupported(None, "cuda") is None
    assert unsupported(Remote(), "cpu") is None
