"""Temperature 0 is lossless: the engine's output equals greedy decoding of
the target alone (HF generate), whatever the drafter proposes, for a
continuously batched mix of prompts admitted at different times; at batch 1
the accepted length of every step equals the DFlash reference's."""

import time

import pytest
import torch

from factories import make_drafter, make_target
from specray.config import EngineConfig
from specray.llm import build_engine
from specray.plan import DraftOutput
from specray.sampling import SamplingParams


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    hf = make_target(root / "t", vocab_size=48, seed=2)
    make_drafter(root / "d", hf.config, seed=12, block_size=8)
    return root, hf


def prompts_and_lengths():
    g = torch.Generator().manual_seed(7)
    lens = [3, 17, 8, 31, 5, 12, 24, 9, 40, 2]
    prompts = [torch.randint(2, 47, (n,), generator=g).tolist() for n in lens]
    max_tokens = [25, 40, 13, 30, 33, 21, 18, 37, 26, 29]
    return prompts, max_tokens


class OracleDrafter:
    """Wraps the real drafter but replaces most drafts with the target's
    true greedy continuation, so that long runs get accepted and the
    rollback / context paths see every acceptance length."""

    def __init__(self, inner, truth, engine):
        self.inner, self.truth, self.engine = inner, truth, engine
        self.g = torch.Generator().manual_seed(0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, batch):
        out = self.inner.propose(batch)
        tokens = out.tokens.clone()
        running = [r for r in self.engine.scheduler.running if not r.is_prefilling]
        for s, ctx in enumerate(batch.ctx_lens.tolist()):
            req = next(r for r in running if r.num_computed == ctx and r.all_token_ids[-1] == batch.block_ids[s, 0])
            truth = self.truth[req.request_id]
            done = len(req.output_token_ids)
            for i in range(tokens.shape[1]):
                if done + i < len(truth) and torch.rand((), generator=self.g) < 0.85:
                    tokens[s, i] = truth[done + i]
        return DraftOutput(tokens, out.draft_idx, out.draft_q)


@pytest.mark.parametrize("mode", ["ar", "spec", "oracle", "oracle-tight-kv", "oracle-static-decode", "ar-static-decode",
                                  "spec-async", "ar-async", "spec-tight-kv-async"])
def test_staggered_batch_equals_hf_greedy(models, mode):
    root, hf = models
    prompts, max_tokens = prompts_and_lengths()
    truth = {str(i): hf_greedy(hf, p, n) for i, (p, n) in enumerate(zip(prompts, max_tokens))}
    tight = "tight-kv" in mode
    # *-static-decode: the padded, static-shaped decode path that CUDA graphs
    # replay on a GPU (run eagerly here).
    cfg = EngineConfig(
        target=str(root / "t"),
        drafter=None if mode.startswith("ar") else str(root / "d"),
        kv_block_size=4,
        num_kv_blocks=40 if tight else 400,
        max_model_len=128,
        max_num_batched_tokens=64,
        cuda_graphs=mode.endswith(("static-decode", "async")),
        async_scheduling=mode.endswith("async"),
        max_num_seqs=6,
    )
    engine = build_engine(cfg)
    if mode.startswith("oracle"):
        engine.drafter = OracleDrafter(engine.drafter, truth, engine)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_tokens]
    outs, admitted, steps = {}, 0, 0
    waves = [4, 3, 3]
    while len(outs) < len(prompts):
        if waves and (steps % 3 == 0):
            for _ in range(waves.pop(0)):
                engine.add_request(prompts[admitted], params[admitted], request_id=str(admitted))
                admitted += 1
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        assert steps < 2000
    for rid, want in truth.items():
        assert outs[rid].token_ids == want, rid
        assert outs[rid].finish_reason == "length"
    sched = engine.scheduler
    assert sched.target_pool.num_free == sched.target_pool.capacity
    if sched.draft_pool is not None:
        assert sched.draft_pool.num_free == sched.draft_pool.capacity
    lengths = [a for o in outs.values() for a in o.metrics.acceptance_lengths]
    if mode.startswith("oracle"):
        assert max(lengths) == 8 and len(set(lengths)) >= 5, sorted(set(lengths))
    if tight:
        assert sum(o.metrics.num_preemptions for o in outs.values()) > 0
    if mode.endswith("async"):
        assert engine.num_async_steps > steps // 3, (engine.num_async_steps, steps)


@pytest.mark.parametrize(
    "vocab,seed,stop,static,async_",
    [(24, 2, None, False, False), (48, 2, None, False, False), (48, 2, "first-output", False, False),
     (48, 2, None, True, False), (24, 2, None, True, True), (48, 2, "first-output", True, True)],
)
def test_acceptance_lengths_equal_reference(tmp_path, vocab, seed, stop, static, async_):
    """Step by step, the same accepted lengths as the authors' loop; with
    ``static``, through the padded layout CUDA graphs replay (whole blocks
    of context stored, rejected rows into the reserved slot); with
    ``async_``, each step launched from the previous one's device results
    (async_decode.py)."""
    import dflash.model as dm

    dm._cuda_time = time.perf_counter  # the reference times with cuda.synchronize
    hf = make_target(tmp_path / "t", vocab_size=vocab, seed=seed)
    ref = make_drafter(tmp_path / "d", hf.config, seed=seed + 10, block_size=8)
    prompt = [3, 4, 5, 6, 7]
    n = 60
    stop_ids = None
    if stop:
        cont = hf_greedy(hf, prompt, n)
        late = [t for i, t in enumerate(cont) if cont.index(t) == i and i >= 20]
        stop_ids = [late[0]]
    r = dm.dflash_generate(ref, hf, torch.tensor([prompt]), n, stop_ids, return_stats=True)
    from specray import LLM

    # The reference drafts chains with the drafter only: so does this engine.
    llm = LLM(tmp_path / "t", tmp_path / "d", max_model_len=256, cuda_graphs=static, prompt_lookup_min=0,
              draft_tree=False, adaptive_speculation=False,
              async_scheduling=async_)
    out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, stop_token_ids=stop_ids))[0]
    assert out.token_ids == r.output_ids[0, len(prompt):].tolist()
    assert out.metrics.acceptance_lengths == r.acceptance_lengths
    assert max(r.acceptance_lengths) > 1
    # Far from any length limit, every decode step ran asynchronously.
    assert llm.engine.num_async_steps == (len(r.acceptance_lengths) if async_ else 0)
