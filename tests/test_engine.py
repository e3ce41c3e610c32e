"""Engine behaviour around the decode loop: text prompts, stop strings and
stop tokens, streaming deltas, aborts, and block accounting."""

import dataclasses

import pytest

from factories import add_tokenizer, make_drafter, make_target
from specray import LLM, SamplingParams
from specray.config import EngineConfig
from specray.llm import build_engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    hf = make_target(root / "t", seed=3)
    add_tokenizer(root / "t", hf.config.vocab_size)
    make_drafter(root / "d", hf.config)
    return root


def run(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_text_prompt_stop_string_and_streaming(ckpt):
    llm = LLM(ckpt / "t", ckpt / "d")
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate("The capital of France is", greedy)[0]
    assert len(full.token_ids) == 40 and full.text
    # Stop at a string taken from the middle of the text.
    cut = len(full.text) // 2
    stop = full.text[cut : cut + 3]
    first = full.text.find(stop)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:first]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids

    # Streaming: deltas joined equal the final text, tokens arrive over
    # several steps, and nothing of the stop string leaks out.
    engine = llm.engine
    rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=stop))
    chunks = run(engine)[rid]
    assert len(chunks) > 2
    assert "".join(c.delta_text for c in chunks) == out.text
    assert sum((c.delta_token_ids for c in chunks), []) == out.token_ids
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_stop_token_and_eos(ckpt):
    llm = LLM(ckpt / "t", ckpt / "d")
    full = llm.generate([7, 8, 9], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop_tok = full.token_ids[10]
    first = full.token_ids.index(stop_tok)
    out = llm.generate([7, 8, 9], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # The same token as the model's EOS: a stop unless ignore_eos.
    llm.engine.target_spec = dataclasses.replace(llm.engine.target_spec, eos_token_ids=(stop_tok,))
    out = llm.generate([7, 8, 9], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([7, 8, 9], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == full.token_ids and out.finish_reason == "length"


def test_abort_mid_stream_frees_every_block(ckpt):
    engine = build_engine(EngineConfig(target=str(ckpt / "t"), drafter=str(ckpt / "d"), num_kv_blocks=200, kv_block_size=4))
    a = engine.add_request([5] * 30, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    b = engine.add_request([6] * 10, SamplingParams(max_tokens=50, temperature=0.8, seed=1, ignore_eos=True))
    for _ in range(4):
        engine.step()
    pools = (engine.scheduler.target_pool, engine.scheduler.draft_pool)
    assert all(p.num_free < p.capacity for p in pools)
    out = engine.abort_request(a)
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort_request(a) is None  # twice is harmless
    assert engine.abort_request("no-such-id") is None
    rest = run(engine)
    assert rest[b][-1].finished and len(rest[b][-1].token_ids) == 50
    assert all(p.num_free == p.capacity for p in pools)


def test_seeded_sampling_is_reproducible_and_batch_independent(ckpt):
    llm = LLM(ckpt / "t", ckpt / "d")
    p = SamplingParams(max_tokens=25, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    alone = llm.generate([9, 10, 11], p)[0]
    batch = llm.generate([[1, 2, 3, 4, 5], [9, 10, 11], [30] * 12],
                         [SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True), p,
                          SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)])
    assert batch[1].token_ids == alone.token_ids
    ar = LLM(ckpt / "t").generate([9, 10, 11], p)[0]
    assert len(ar.token_ids) == 25  # same params run on the autoregressive engine too


def test_metrics(ckpt):
    llm = LLM(ckpt / "t", ckpt / "d")
    out = llm.generate([3, 4, 5], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    assert sum(m.acceptance_lengths) == len(out.token_ids) - 1  # the first token comes from prefill
    assert m.mean_acceptance_length >= 1
    assert m.num_accepted_tokens == sum(a - 1 for a in m.acceptance_lengths)
    assert sum(m.accepted_per_position) == m.num_accepted_tokens
    assert m.ttft is not None and m.ttft >= 0


def test_cli_generate_prints_text_and_stats(ckpt, capsys):
    import json as _json

    from specray.cli import main

    rc = main(["generate", "--target", str(ckpt / "t"), "--drafter", str(ckpt / "d"), "--max-tokens", "12",
               "--json", "The capital of France is"])
    out = capsys.readouterr().out.strip().splitlines()
    stats = _json.loads(out[-1])
    assert rc == 0 and stats["tokens"] == 12 and stats["mean_acceptance_length"] >= 1
    assert main(["generate", "--target", str(ckpt / "nowhere"), "x"]) == 2
    # The sampling flags reach the request: a penalty changes the text, a bad one is exit 2.
    base = ["generate", "--target", str(ckpt / "t"), "--drafter", str(ckpt / "d"), "--max-tokens", "12", "x y z"]
    assert main(base) == 0
    plain = capsys.readouterr().out.splitlines()[0]
    assert main(base + ["--repetition-penalty", "3", "--presence-penalty", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] != plain
    assert main(base + ["--frequency-penalty", "5"]) == 2


def test_a_prompt_that_is_not_unicode_text_is_refused(ckpt):
    """A lone surrogate (what a JSON \\ud800 escape decodes to) made the
    tokenizer raise a TypeError, which a batch job took for a crash."""
    from specray.request import PromptsRefused

    llm = LLM(ckpt / "t", ckpt / "d", num_kv_blocks=64)
    with pytest.raises(PromptsRefused, match="not valid Unicode"):
        llm.generate(["fine", "x\ud800y"], SamplingParams(max_tokens=2))
    assert len(llm.generate(["fine"], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_prompt_length_bound_only_where_it_is_sure(ckpt):
    """Prompts longer than max_prompt_chars are refused untokenized, so the
    bound must never refuse a prompt that fits: it exists for a BPE that
    spells every character (byte-level here), and not once an added token
    swallows whitespace (one such token can cover any number of spaces)."""
    from tokenizers import AddedToken

    from specray.detokenizer import load_tokenizer, max_prompt_chars

    tok = load_tokenizer(ckpt / "t")
    longest = max(map(len, tok.get_vocab()))
    assert max_prompt_chars(tok, 100) == 8 * longest * 100
    assert max_prompt_chars(None, 100) == float("inf")
    tok.add_tokens([AddedToken("<|x|>", lstrip=True, rstrip=True)])
    assert len(tok.encode("<|x|>" + " " * 5000 + "<|x|>", add_special_tokens=False)) <= 3
    assert max_prompt_chars(tok, 100) == float("inf")


def test_a_smaller_drafter_pool_preempts_and_changes_no_output(ckpt):
    """num_draft_kv_blocks sizes the drafter's context pool (the in-process
    engine gave it the target's size whatever was asked). When only that
    pool runs dry, requests are preempted and resume with the same tokens,
    greedy and seeded, and a resumed request's re-prefill emits no output
    of its own (it has no new token: streams saw an empty chunk)."""
    def build(num_draft_kv_blocks):
        return build_engine(EngineConfig(target=str(ckpt / "t"), drafter=str(ckpt / "d"), kv_block_size=4,
                                         num_kv_blocks=200, num_draft_kv_blocks=num_draft_kv_blocks,
                                         max_model_len=64, max_num_batched_tokens=32))

    def generate(engine):
        for i in range(4):
            engine.add_request([20 + i] * (5 + 7 * i), SamplingParams(
                max_tokens=30, temperature=0.9 * (i % 2), seed=i, ignore_eos=True), request_id=str(i))
        return run(engine)

    want = {k: outs[-1] for k, outs in generate(build(None)).items()}
    engine = build(17)  # 16 blocks: 64 positions, one request at its longest
    assert engine.drafter.kv_cache.shape[2] == engine.scheduler.draft_pool.num_blocks == 17
    streams = generate(engine)
    assert all(o.delta_token_ids for outs in streams.values() for o in outs if not o.finished)
    got = {k: outs[-1] for k, outs in streams.items()}
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in want.items()}
    assert sum(o.metrics.num_preemptions for o in got.values()) > 0
    pools = (engine.scheduler.target_pool, engine.scheduler.draft_pool)
    assert all(p.num_free == p.capacity for p in pools)


def test_a_long_draft_block_runs_to_the_length_limit(tmp_path):
    """A drafter block of 80 rows: a verify block that starts near
    max_model_len runs its padded rows ~80 positions past it, beyond the 64
    the target's RoPE table once covered (the CPU reference raised
    IndexError there; the GPU kernel reads the table unchecked). Greedy
    output to the limit is the autoregressive one."""
    from factories import make_models

    root = make_models(tmp_path, block_size=80)
    prompt = list(range(2, 40))
    greedy = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    kw = dict(max_model_len=120, cuda_graphs=True)
    spec = LLM(root / "t", root / "d", **kw).generate([prompt], greedy)[0]
    ar = LLM(root / "t", **kw).generate([prompt], greedy)[0]
    assert spec.finish_reason == "length" and len(spec.token_ids) == 120 - len(prompt)
    assert spec.token_ids == ar.token_ids
