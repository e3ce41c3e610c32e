"""The engine on the GPU (Triton kernels, bf16 / fp32): the same tokens as
on the CPU in fp32, and the speculative engine lossless against the
autoregressive one."""

import pytest
import torch

from factories import make_drafter, make_target
from specray import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=384, intermediate_size=768, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4, vocab_size=512)
PROMPTS = [[5, 17, 33, 2, 9, 10, 42], [3, 4], list(range(2, 200)), [7] * 40, [11, 12, 13] * 30]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    hf = make_target(root / "t", seed=5, **SHAPE)
    make_drafter(root / "d", hf.config, seed=6, block_size=16, target_layer_ids=(1, 2))
    return root


def generate(root, drafter, device, dtype, params, **kw):
    kw.setdefault("async_scheduling", False)  # the synchronous steps, unless a test asks
    llm = LLM(root / "t", root / "d" if drafter else None, device=device, dtype=dtype, num_kv_blocks=512,
              max_model_len=512, **kw)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def acceptance(root, device, params, **kw):
    kw.setdefault("async_scheduling", False)
    llm = LLM(root / "t", root / "d", device=device, dtype="float32", num_kv_blocks=512, max_model_len=512, **kw)
    return [o.metrics.acceptance_lengths for o in llm.generate(PROMPTS, params)]


def sampled(max_tokens, top_p=False):
    return [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95 if top_p and i % 2 else 1.0, seed=i,
                           ignore_eos=True) for i in range(len(PROMPTS))]


def drafter_accepted(lengths):
    """Whether some draft token was accepted. Greedy, this random drafter
    never matches the target (every greedy length is 1, longer ones come
    from prompt lookups), so only sampled runs, with lookups off as they
    are by default, show whether the drafter saw the right context: its
    proposals change and the seeded accept/reject draws with them."""
    return max(max(x) for x in lengths) > 1


@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_fp32_matches_cpu_and_is_lossless(ckpt, graphs):
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    cpu = generate(ckpt, True, "cpu", "float32", greedy)
    gpu_spec = generate(ckpt, True, "cuda", "float32", greedy, cuda_graphs=graphs)
    gpu_ar = generate(ckpt, False, "cuda", "float32", greedy, cuda_graphs=graphs)
    assert gpu_spec == cpu
    assert gpu_ar == cpu
    # The drafter saw the same context too (graphed: whole blocks stored).
    want = acceptance(ckpt, "cpu", sampled(48))
    assert drafter_accepted(want)
    assert acceptance(ckpt, "cuda", sampled(48), cuda_graphs=graphs) == want


def test_gpu_bf16_runs_and_stays_close(ckpt):
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    spec = generate(ckpt, True, "cuda", "bfloat16", greedy)
    ar = generate(ckpt, False, "cuda", "bfloat16", greedy)
    assert all(len(s) == 48 for s in spec)
    # Only the first tokens: the attention gives verify rows a decode step's
    # bits (tests/test_kernels.py), but whether cuBLAS does for this model's
    # GEMM shapes is its choice (it does for the embedded default's).
    assert all(s[:8] == a[:8] for s, a in zip(spec, ar))
    outs = generate(ckpt, True, "cuda", "bfloat16", sampled(32))
    assert all(len(o) == 32 for o in outs)
    assert torch.cuda.is_available()


@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_fp32_seeded_sampling_matches_cpu(ckpt, graphs):
    """Seeded sampling draws the same tokens on the GPU as on the CPU: the
    host ships each step's uniforms and the sampling settings through
    pinned, asynchronous copies, and nothing may race them."""
    for drafter in (True, False):
        cpu = generate(ckpt, drafter, "cpu", "float32", sampled(40, top_p=True))
        gpu = generate(ckpt, drafter, "cuda", "float32", sampled(40, top_p=True), cuda_graphs=graphs)
        assert gpu == cpu, f"drafter={drafter}"


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_gpu_async_steps_match_cpu(ckpt, drafter):
    """Steps launched from the previous step's device results (pinned
    copies, events, blocks reserved ahead) give the CPU's tokens and, step
    by step, its acceptance lengths (greedy, those of the prompt lookups:
    the sampled test below is the one that sees the drafter's context)."""
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    kw = dict(cuda_graphs=True, async_scheduling=True, adaptive_speculation=False)
    llm = LLM(ckpt / "t", ckpt / "d" if drafter else None, device="cuda", dtype="float32", num_kv_blocks=512,
              max_model_len=512, **kw)
    gpu = llm.generate(PROMPTS, greedy)
    assert llm.engine.num_async_steps > 0
    graphs = llm.engine._step_graphs[("greedy", 0)]
    assert sorted(graphs.graphs) == graphs.sizes  # every batch size captured at the kind's first step
    assert [o.token_ids for o in gpu] == generate(ckpt, drafter, "cpu", "float32", greedy)
    if drafter:
        cpu = acceptance(ckpt, "cpu", greedy, **kw)
        assert [o.metrics.acceptance_lengths for o in gpu] == cpu


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_gpu_requests_join_the_running_chain_and_match_cpu(ckpt, drafter):
    """More requests than max_num_seqs, ending at different steps: each
    waiting one joins the running chain in a finished row's place (its
    prompt prefilled through a graph behind the step in flight); the CPU's
    synchronous steps give the same tokens."""
    prompts = PROMPTS * 3
    params = [SamplingParams(max_tokens=8 + 7 * (i % 5) + i, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    cpu = LLM(ckpt / "t", ckpt / "d" if drafter else None, device="cpu", dtype="float32", num_kv_blocks=512,
              max_model_len=512, max_num_seqs=6)
    want = [o.token_ids for o in cpu.generate(prompts, params)]
    llm = LLM(ckpt / "t", ckpt / "d" if drafter else None, device="cuda", dtype="float32", num_kv_blocks=512,
              max_model_len=512, max_num_seqs=6, cuda_graphs=True, async_scheduling=True,
              adaptive_speculation=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.num_chain_joins > 0
    sched = llm.engine.scheduler
    assert sched.target_pool.num_free == sched.target_pool.capacity


@pytest.mark.parametrize("sampled_", [False, True], ids=["greedy", "sampled"])
def test_gpu_overlapped_lanes_match_cpu(ckpt, sampled_):
    """Two micro-batch lanes, each a chain of step graphs on its own CUDA
    stream, run concurrently on the GPU: the CPU's tokens and acceptance
    lengths, as one chain gives them."""
    params = sampled(48, top_p=True) if sampled_ else SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    kw = dict(cuda_graphs=True, async_scheduling=True, overlap=True, overlap_min_batch=2, adaptive_speculation=False)
    llm = LLM(ckpt / "t", ckpt / "d", device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512, **kw)
    gpu = llm.generate(PROMPTS, params)
    assert any(key[1] == 1 for key in llm.engine._step_graphs)
    assert [o.token_ids for o in gpu] == generate(ckpt, True, "cpu", "float32", params)
    assert [o.metrics.acceptance_lengths for o in gpu] == acceptance(ckpt, "cpu", params, cuda_graphs=True,
                                                                     async_scheduling=True, adaptive_speculation=False)


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "ar"])
def test_gpu_sampled_async_steps_match_cpu(ckpt, drafter):
    """Sampled async steps draw their uniforms on the device (one Triton
    kernel) from starts the host never sees: the CPU's tokens, plain and
    top-p rows in one batch, and the CPU's acceptance lengths."""
    params = sampled(48, top_p=True)
    kw = dict(cuda_graphs=True, async_scheduling=True, adaptive_speculation=False)
    llm = LLM(ckpt / "t", ckpt / "d" if drafter else None, device="cuda", dtype="float32", num_kv_blocks=512,
              max_model_len=512, **kw)
    gpu = llm.generate(PROMPTS, params)
    assert llm.engine.num_async_steps > 0 and ("filtered", 0) in llm.engine._step_graphs
    assert [o.token_ids for o in gpu] == generate(ckpt, drafter, "cpu", "float32", params)
    if drafter:
        lengths = [o.metrics.acceptance_lengths for o in gpu]
        assert drafter_accepted(lengths)
        assert lengths == acceptance(ckpt, "cpu", params, **kw)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "tree"])
def test_gpu_shorter_chains_match_cpu(ckpt, tree, monkeypatch):
    """The adaptive policy's shorter chains (forced to take turns with whole
    blocks and autoregressive steps) replay graphs of 8-, 4- and 2-row blocks:
    the greedy tokens are the CPU's autoregressive ones."""
    import itertools

    from specray.spec_policy import SpecPolicy

    turns = itertools.cycle([15, 7, 3, 1, 0])
    monkeypatch.setattr(SpecPolicy, "choose", lambda self, n, kind: next(turns))
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    llm = LLM(ckpt / "t", ckpt / "d", device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512,
              cuda_graphs=True, async_scheduling=True, adaptive_speculation=True, draft_tree=tree)
    assert llm.engine.policy.options == (15, 7, 3, 1, 0)
    gpu = llm.generate(PROMPTS, greedy)
    assert {("greedy", 0, 8), ("greedy", 0, 4), ("greedy", 0, 2), ("greedy", 0, "ar")} <= set(llm.engine._step_graphs)
    assert [o.token_ids for o in gpu] == generate(ckpt, False, "cpu", "float32", greedy)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_gpu_fewer_speculative_tokens_match_cpu(ckpt, async_):
    """num_speculative_tokens=5 with a drafter of block 16: the drafter's
    decode graphs take 6-row blocks; greedy tokens are the CPU's (and the
    autoregressive ones); sampled, the acceptance lengths are the CPU's,
    none above 6."""
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    # The adaptive policy's choices follow measured step times: off, so that
    # the acceptance lengths are the drafter's, comparable with the CPU's.
    kw = dict(num_speculative_tokens=5, cuda_graphs=True, async_scheduling=async_, adaptive_speculation=False)
    llm = LLM(ckpt / "t", ckpt / "d", device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512, **kw)
    gpu = llm.generate(PROMPTS, greedy)
    assert llm.engine.drafter.graphs.graphs or async_  # the sync path replayed 6-row propose graphs
    assert not async_ or llm.engine.num_async_steps > 0
    assert [o.token_ids for o in gpu] == generate(ckpt, False, "cpu", "float32", greedy)
    lengths = [o.metrics.acceptance_lengths for o in llm.generate(PROMPTS, sampled(48))]
    assert drafter_accepted(lengths)
    assert lengths == acceptance(ckpt, "cpu", sampled(48), **kw)
    assert max(max(x) for x in lengths) <= 6


def test_gpu_uniforms_kernel_is_the_hash():
    pytest.importorskip("triton")
    from specray.kernels.uniforms_triton import position_uniforms
    from specray.sampling import host_uniforms, seed_keys

    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (37,), generator=g).tolist() + [0, 2**63 - 1]
    starts = torch.randint(0, 2**34, (len(seeds),), generator=g).tolist()
    keys = torch.from_numpy(seed_keys(seeds)).cuda()
    for width in (1, 6, 16, 33):
        want = host_uniforms(seeds, starts, width)
        assert torch.equal(position_uniforms(keys, torch.tensor(starts).cuda(), width).cpu(), want), width
        # The step graph keeps keys row-major per sequence and passes their transpose.
        keys_t = keys.T.contiguous().T
        assert torch.equal(position_uniforms(keys_t, torch.tensor(starts).cuda(), width).cpu(), want), width


def test_gpu_prefill_graphs_match_cpu(ckpt):
    """Prompts one at a time: each prefill replays a captured padded chunk
    (chunked by max_num_batched_tokens for the long ones), and the drafter
    gets the context the CPU's does (sampled: same acceptance lengths)."""
    kw = dict(num_kv_blocks=512, max_model_len=512, max_num_batched_tokens=128, prompt_lookup_min=0)
    cpu = LLM(ckpt / "t", ckpt / "d", device="cpu", dtype="float32", **kw)
    gpu = LLM(ckpt / "t", ckpt / "d", device="cuda", dtype="float32", cuda_graphs=True, adaptive_speculation=False, **kw)
    used = []
    run = gpu.engine.target._execute_prefill_graph
    gpu.engine.target._execute_prefill_graph = lambda batch, rows: used.append(rows) or run(batch, rows)
    lengths = []
    for p, params in zip(PROMPTS, sampled(24)):
        want, got = cpu.generate([p], params)[0], gpu.generate([p], params)[0]
        assert got.token_ids == want.token_ids
        assert got.metrics.acceptance_lengths == want.metrics.acceptance_lengths
        lengths.append(got.metrics.acceptance_lengths)
    assert drafter_accepted(lengths)
    assert len(used) >= len(PROMPTS) and max(used) == 128


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_gpu_min_tokens_matches_cpu(ckpt, async_):
    """min_tokens on the GPU (the stop-token mask on a graphed step's
    logits, a prefill graph's first-token row, then async chains past it):
    the CPU's fp32 tokens, speculative and autoregressive; each prompt's
    third free token is a stop token, masked for the first twelve."""
    free = generate(ckpt, False, "cpu", "float32", SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    held = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[f[2], f[0]], min_tokens=12)
            for f in free]
    llm = LLM(ckpt / "t", ckpt / "d", device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=512)
    want = [o.token_ids for o in llm.generate(PROMPTS, held)]
    assert all(len(w) > 12 and not {f[0], f[2]} & set(w[:12]) and w != f for w, f in zip(want, free))
    for drafter in (True, False):
        got = [o.token_ids for o in LLM(ckpt / "t", ckpt / "d" if drafter else None, device="cuda",
                                        dtype="float32", num_kv_blocks=512, max_model_len=512, cuda_graphs=True,
                                        async_scheduling=async_).generate(PROMPTS, held)]
        assert got == want, drafter


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_gpu_logprobs_match_cpu(ckpt, async_):
    """Log probabilities on the GPU (fp32; graphed verify blocks, a prefill
    graph's first-token row; an async engine runs the request in
    synchronous steps): the CPU's tokens and figures, speculative and
    autoregressive, one row with prompt lookups, one without a stop."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=4) for _ in PROMPTS]
    want = LLM(ckpt / "t", ckpt / "d", device="cpu", dtype="float32", num_kv_blocks=512,
               max_model_len=512).generate(PROMPTS, params)
    for drafter in (True, False):
        got = LLM(ckpt / "t", ckpt / "d" if drafter else None, device="cuda", dtype="float32", num_kv_blocks=512,
                  max_model_len=512, cuda_graphs=True, async_scheduling=async_).generate(PROMPTS, params)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, drafter
            assert len(g.logprobs) == len(g.token_ids)
            for a, b in zip(g.logprobs, w.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
                assert [t for t, _ in a.top][:2] == [t for t, _ in b.top][:2]
                assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-3)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_gpu_penalties_match_cpu(ckpt, async_):
    """Penalties on the GPU (graphed verify blocks whose rows count the
    drafts before them; an async engine runs the requests in synchronous
    steps): the CPU's fp32 tokens, speculative and autoregressive, which
    differ from the free ones."""
    kw = dict(max_tokens=32, temperature=0, ignore_eos=True)
    params = [SamplingParams(**kw, repetition_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(**kw, presence_penalty=1.5), SamplingParams(**kw, repetition_penalty=1.8),
              SamplingParams(**kw, frequency_penalty=-0.5, presence_penalty=0.5), SamplingParams(**kw)]
    free = generate(ckpt, False, "cpu", "float32", SamplingParams(**kw))
    want = generate(ckpt, False, "cpu", "float32", params)
    assert sum(w != f for w, f in zip(want, free)) >= 3 and want[4] == free[4]
    for drafter in (True, False):
        assert generate(ckpt, drafter, "cuda", "float32", params, cuda_graphs=True,
                        async_scheduling=async_) == want, drafter


def test_gpu_ray_colocated_runs_the_step_graphs(ckpt):
    """The Ray backend's rank-0 actor with the drafter inside it (what
    ``specray serve --device cuda`` runs by default): async step graphs,
    draft trees, the adaptive policy with its shorter chains and joins into
    running chains as in process, and the in-process tokens."""
    pytest.importorskip("ray")
    from specray.placement import ensure_ray

    ensure_ray()
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512)
    want = [o.token_ids for o in LLM(ckpt / "t", ckpt / "d", **kw).generate(PROMPTS, greedy)]
    llm = LLM(ckpt / "t", ckpt / "d", backend="ray", **kw)
    try:
        stats = llm.stats()
        features = stats["features"]
        assert all(features[f]["on"] for f in ("cuda_graphs", "async_scheduling", "draft_tree",
                                               "adaptive_speculation", "admit_into_chain")), features
        assert "note" not in features["adaptive_speculation"], features  # no process to keep shorter chains in step
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == want
        assert llm.stats()["num_async_steps"] > 10
    finally:
        llm.shutdown()


def separate_same_gpu(ckpt, params, before=None):
    """Tokens and acceptance lengths of ``params`` from the in-process engine
    and from the Ray backend with the drafter its own actor on rank 0's GPU
    (``separate_same_gpu``: NCCL cannot pair two ranks on one device, a
    CUDA IPC ring does), async step graphs on both ends, with its stats.
    Both engines take the policy's kinds in the same turns (trees, shorter
    chains, autoregressive steps). ``before``: what each engine generates
    first (whose chain's rows its buffers still hold when the next starts)."""
    pytest.importorskip("ray")
    from specray.placement import ensure_ray

    ensure_ray()
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512,
              extra={"policy_turns": [15, 7, 3, 0]})
    ref = LLM(ckpt / "t", ckpt / "d", **kw)
    if before is not None:
        ref.generate(PROMPTS, before)
    want = ref.generate(PROMPTS, params)
    ref.shutdown()
    llm = LLM(ckpt / "t", ckpt / "d", backend="ray", drafter_placement="separate_same_gpu", **kw)
    try:
        features = llm.stats()["features"]
        assert features["async_scheduling"]["on"] and features["cuda_graphs"]["on"], features
        if before is not None:
            llm.generate(PROMPTS, before)
        got = llm.generate(PROMPTS, params)
        return want, got, llm.stats()
    finally:
        llm.shutdown()


def test_gpu_ray_separate_drafter_on_one_gpu_runs_the_step_graphs(ckpt):
    """Greedy: the in-process tokens, and its acceptance lengths (the
    separate drafter drafted what the in-process one did), over every kind
    of step."""
    want, got, stats = separate_same_gpu(ckpt, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.metrics.acceptance_lengths for o in got] == [o.metrics.acceptance_lengths for o in want]
    assert stats["num_async_steps"] > 10
    assert {"0", "3", "7", "15"} <= set(stats["speculation"]["steps_by_drafts"]), stats["speculation"]


def test_gpu_ray_separate_drafter_on_one_gpu_gives_the_seeded_samples(ckpt):
    """Sampled after greedy on both engines: the drafter's proposals, hence
    the seeded accept / reject draws, follow its context (greedy tokens are
    the target's whatever it drafts)."""
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=11 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want, got, _ = separate_same_gpu(ckpt, params, before=greedy)
    assert drafter_accepted([o.metrics.acceptance_lengths for o in want])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.metrics.acceptance_lengths for o in got] == [o.metrics.acceptance_lengths for o in want]


def test_gpu_a_step_kind_first_used_at_a_chain_start_leaves_the_new_prompts_alone(ckpt):
    """A step graph kind first used at a chain's start is captured (every
    batch size) before its inputs arrive, while its buffers hold the last
    chain's rows: a second generate gives a fresh engine's tokens, sampled
    after greedy (the drafter's context of the new prompts) and greedy
    after sampled (the target's). Whole blocks every step: the policy's
    turns would go on from the first generate's, and the seeded samples
    follow the kinds of step that draw them."""
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=512, adaptive_speculation=False)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    samples = [SamplingParams(max_tokens=32, temperature=1.0, seed=11 + i, ignore_eos=True)
               for i in range(len(PROMPTS))]
    runs = {}
    for first, second in ((greedy, samples), (samples, greedy)):
        llm = LLM(ckpt / "t", ckpt / "d", **kw)
        runs[first is greedy] = [[o.token_ids for o in llm.generate(PROMPTS, p)] for p in (first, second)]
        llm.shutdown()
    greedy_first, samples_first = runs[True], runs[False]
    assert greedy_first[1] == samples_first[0]
    assert samples_first[1] == greedy_first[0]
