"""Requests joining a running chain of asynchronous steps (chain_admit.py,
join_wait.py): in a closed loop their tokens equal synchronous steps',
they wait to join together, only a request of the chain's sampling kind
joins, and a finished row may ride as padding."""

import pytest
import torch

from test_async_decode import MAX_MODEL_LEN, engine, pair, prompts, run
from specray.sampling import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return pair(tmp_path_factory.mktemp("joins"))


def closed_loop(eng, prompts, params, concurrency: int, check=None) -> tuple[dict, int]:
    """``concurrency`` requests in flight, the next admitted as one finishes:
    the final outputs and the synchronous steps the engine took.
    ``check(eng)`` runs after every step."""
    outs, i, live, sync_steps = {}, 0, 0, 0
    while i < len(prompts) or eng.has_unfinished():
        while i < len(prompts) and live < concurrency:
            eng.add_request(prompts[i], params[i], request_id=str(i))
            i, live = i + 1, live + 1
        before = eng.num_async_steps
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
                live -= 1
        sync_steps += eng.num_async_steps == before
        if check is not None:
            check(eng)
    return outs, sync_steps


def history_rows_hold_their_tokens(eng) -> None:
    """Each live greedy row of the chain in flight finds its request's
    tokens in its row of the device's token history (its lookups read
    them); a sampled row, which never looks up, holds none."""
    if not eng._inflight or "history" not in eng._step_buffers.get(0, {}):
        return
    history = eng._step_buffers[0]["history"]
    for r in eng._inflight[0].requests:
        if not r.finished and not r.params.greedy:
            assert r.history_slot is None, r.request_id
        elif not r.finished:
            tokens = r.all_token_ids
            assert history[r.history_slot, : len(tokens)].tolist() == tokens, r.request_id


@pytest.mark.parametrize("drafter,each", [(True, False), (False, False), (True, True)],
                         ids=["spec", "ar", "spec-graph-each"])
def test_requests_join_the_running_chain(models, drafter, each, monkeypatch):
    """Under churn waiting requests join the running chain in finished
    rows' places (their prompts prefilled behind the step in flight, their
    rows' state written on the device) instead of draining it: every
    request's tokens stay those of synchronous steps (greedy and seeded
    sampled rows), the KV pools end empty, and the engine takes fewer
    synchronous steps than draining at every finish. ``each``: prompts
    joining together are prefilled one prefill graph each (the GPU's path,
    here on the CPU's padded one)."""
    from specray.actors.target import TargetWorker

    ran_each = []
    if each:
        monkeypatch.setattr(TargetWorker, "prefill_each_off_cuda", True)
        real = TargetWorker._prefill_each
        monkeypatch.setattr(TargetWorker, "_prefill_each",
                            lambda self, b: ran_each.append(b.attn.seq_lens.shape[0]) or real(self, b))
    g = torch.Generator().manual_seed(21)
    ps = [torch.randint(2, 319, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (24,), generator=g)]
    lens = torch.randint(6, 40, (24,), generator=g).tolist()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) if i % 3 else
              SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True) for i, n in enumerate(lens)]
    # Sampled and greedy rows run in separate chains' graphs; one kind a batch keeps chains long.
    for kind in (0, 1):
        pick = [i for i in range(len(ps)) if (i % 3 == 0) == bool(kind)]
        sub_ps, sub_params = [ps[i] for i in pick], [params[i] for i in pick]
        TargetWorker.prefill_each_off_cuda = False  # the reference prefills several prompts in one forward
        want, _ = closed_loop(engine(models, drafter, False), sub_ps, sub_params, 6)
        TargetWorker.prefill_each_off_cuda = each
        eager, drains = closed_loop(engine(models, drafter, True, admit_into_chain=False), sub_ps, sub_params, 6)
        eng = engine(models, drafter, True)
        got, joining = closed_loop(eng, sub_ps, sub_params, 6, check=history_rows_hold_their_tokens)
        for k in want:
            assert got[k].token_ids == want[k].token_ids == eager[k].token_ids, (kind, k)
            # the same drafts (the drafter's context, the lookup history of a joined row)
            assert got[k].metrics.acceptance_lengths == want[k].metrics.acceptance_lengths, (kind, k)
        assert eng.num_chain_joins >= len(pick) - 6, (kind, eng.num_chain_joins)
        assert not each or ran_each, "no step prefilled several prompts one graph each"
        assert joining < drains, (kind, joining, drains)
        # every drain is counted under the rule that ended its chain
        assert set(eng.chain_breaks) <= \
            {"rows changed", "admission", "a row finished", "length limit", "max_tokens next", "no room to reserve"}
        sched = eng.scheduler
        assert sched.target_pool.num_free == sched.target_pool.capacity
        if drafter:
            assert sched.draft_pool.num_free == sched.draft_pool.capacity


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_requests_wait_to_join_together(models, drafter):
    """``join_batch``: finished rows ride until that many waiting requests
    may join in one step: the tokens stay the synchronous steps', the
    requests join in fewer join steps, and the pools end empty."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(2, 319, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (24,), generator=g)]
    params = [SamplingParams(max_tokens=int(n), temperature=0, ignore_eos=True)
              for n in torch.randint(6, 40, (24,), generator=g)]
    want, _ = closed_loop(engine(models, drafter, False), ps, params, 6)
    join_steps = {}
    for batch in (1, 3, None):  # None: the batch the CPU's own cycle times make cheapest (join_wait.py)
        eng = engine(models, drafter, True, join_batch=batch, join_wait_steps=40)
        got, _ = closed_loop(eng, ps, params, 6)
        assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}, batch
        join_steps[batch] = sum(n for k, (n, *_) in eng.cycle_costs.items() if k.endswith("+join"))
        assert eng.num_chain_joins >= 12, (batch, eng.num_chain_joins)
        if batch == 3:
            assert eng.num_chain_joins >= 2 * join_steps[batch], (eng.num_chain_joins, join_steps)
        sched = eng.scheduler
        assert sched.target_pool.num_free == sched.target_pool.capacity
    assert join_steps[3] < join_steps[1], join_steps


def test_a_lone_waiting_request_joins_after_join_wait_steps(models):
    """With one request in flight at a time beside a long one, no batch of
    ``join_batch`` ever gathers: each waits ``join_wait_steps`` and joins."""
    ps = prompts()[:4]
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] + \
        [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 3
    want, _ = closed_loop(engine(models, True, False), ps, params, 2)
    eng = engine(models, True, True, join_batch=4, join_wait_steps=2)
    got, _ = closed_loop(eng, ps, params, 2)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}
    assert eng.num_chain_joins >= 2, (eng.num_chain_joins, eng.chain_breaks)


def test_only_a_request_of_the_chains_sampling_kind_joins(models):
    """A greedy request joins a greedy chain; a sampled one does not (the
    greedy graphs have no sampling settings to write): that chain drains.
    Both give the synchronous steps' tokens."""
    ps = prompts()[:3]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2 + \
        [SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True)]
    joins = {1: 3, 2: 6}
    want = run(engine(models, True, False), ps, params, joins=joins)
    eng = engine(models, True, True)
    got = run(eng, ps, params, joins=joins)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}
    assert eng.num_chain_joins == 1 and eng.chain_breaks["admission"] == 1, (eng.num_chain_joins, eng.chain_breaks)


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_a_finished_row_near_the_length_limit_rides_as_padding(models, drafter):
    """A row that finishes near max_model_len rides on for as long as the
    others run (its batch still pads to the same graph): restarted as a
    padding row, it never indexes past its block table."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(2, 319, (MAX_MODEL_LEN - 20,), generator=g).tolist()] + \
        [torch.randint(2, 319, (5,), generator=g).tolist() for _ in range(3)]
    params = [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)] + \
        [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] * 3
    want, _ = closed_loop(engine(models, drafter, False), ps, params, 4)
    got, _ = closed_loop(engine(models, drafter, True), ps, params, 4)
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}


def test_features_say_whether_requests_join_running_chains(models):
    assert engine(models, True, True).features()["admit_into_chain"] == {"on": True}
    off = engine(models, True, True, admit_into_chain=False).features()["admit_into_chain"]
    assert off == {"on": False, "reason": "turned off (admit_into_chain=False)"}
    assert engine(models, True, False).features()["admit_into_chain"] == {"on": False, "reason": "needs async_scheduling"}
