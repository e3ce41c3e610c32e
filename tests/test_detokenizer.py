"""Detokenization: the fast decoder against the tokenizer's own decode,
several tokens at once against one at a time, and the engine's run append
(no stop strings, no logprobs) against its token-by-token append."""

import random
import threading
import types

import pytest

from factories import add_tokenizer
from specray import SamplingParams
from specray.detokenizer import decodes_in_runs, detokenize_step, init_detokenizer, text_decoder
from specray.engine import EngineCore
from specray.request import Request


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    add_tokenizer(path, 320)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def request(prompt: list[int], params: SamplingParams) -> Request:
    r = Request("r", None, list(prompt), params, 0, (1,))
    init_detokenizer(r)
    return r


def random_ids(rng: random.Random, n: int, vocab: int = 320) -> list[int]:
    # Special ids (0, 1) now and then; every byte of the byte-level alphabet
    # is a token, so continuation bytes and cut characters come up too.
    return [rng.randrange(vocab) if rng.random() < 0.9 else rng.choice((0, 1)) for _ in range(n)]


def test_the_fast_decoder_is_the_tokenizers_decode(tokenizer):
    decode = text_decoder(tokenizer)
    assert decode is not None
    rng = random.Random(0)
    for _ in range(300):
        ids = random_ids(rng, rng.randrange(1, 30))
        for skip in (False, True):
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_whose_wrapper_cleans_up_keeps_its_own_decode(tokenizer):
    # A wrapper that changes the text (as clean-up would): the probe sees it.
    class Cleaning:
        is_fast = True
        backend_tokenizer = tokenizer.backend_tokenizer

        def encode(self, text, add_special_tokens=False):
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids, skip_special_tokens=False):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).replace(" .", ".")

    wrapper = Cleaning()
    decode = text_decoder(wrapper)
    ids = tokenizer.encode("a . b", add_special_tokens=False)
    assert decode(ids, False) == wrapper.decode(ids) != tokenizer.backend_tokenizer.decode(ids)
    assert text_decoder(None) is None


@pytest.mark.parametrize("seed", range(6))
def test_several_tokens_at_once_give_the_text_of_one_at_a_time(tokenizer, seed):
    assert decodes_in_runs(tokenizer)
    decode, rng = text_decoder(tokenizer), random.Random(seed)
    prompt = random_ids(rng, rng.randrange(1, 12))
    out = random_ids(rng, 60)
    params = SamplingParams(max_tokens=100, skip_special_tokens=bool(seed % 2))
    one, runs = request(prompt, params), request(prompt, params)
    texts = [""]  # the text after each token, one call a token
    for tok in out:
        one.output_token_ids.append(tok)
        one.text += detokenize_step(decode, one)
        texts.append(one.text)
    i = 0
    while i < len(out):
        k = rng.randrange(1, 8)
        runs.output_token_ids.extend(out[i : i + k])
        runs.text += detokenize_step(decode, runs, runs=True)
        i = min(i + k, len(out))
        # At every cut, not only at the end: a stream's deltas are the same too.
        assert runs.text == texts[i]


class _Scheduler:
    def finish(self, r, reason):
        r.finish_reason = reason
        from specray.request import Status

        r.status = Status.FINISHED


@pytest.mark.parametrize("seed", range(8))
def test_the_run_append_keeps_what_token_by_token_keeps(tokenizer, seed):
    """Stop tokens before and after min_tokens, max_tokens and the model
    length cut inside a run: the same tokens, text, reason and stop token."""
    rng = random.Random(100 + seed)
    core = types.SimpleNamespace(scheduler=_Scheduler(), tokenizer_lock=threading.Lock(),
                                 _decode=text_decoder(tokenizer), _decode_runs=True,
                                 max_model_len=rng.choice((40, 200)))
    core._append_run = types.MethodType(EngineCore._append_run, core)
    prompt = random_ids(rng, 10)
    kw = dict(max_tokens=rng.randrange(5, 40), min_tokens=rng.choice((0, 3, 8)), stop_token_ids=[7, 9],
              ignore_eos=bool(seed % 2))
    runs = request(prompt, SamplingParams(**kw))
    # A stop string that never occurs keeps the token-by-token path.
    one = request(prompt, SamplingParams(**kw, stop=["\x00never\x00"]))
    stream = [rng.choice((7, 9, 1)) if rng.random() < 0.08 else rng.randrange(2, 320) for _ in range(80)]
    i = 0
    while i < len(stream) and not runs.finished:
        k = rng.randrange(1, 9)
        kept_runs = EngineCore._append(core, runs, stream[i : i + k])
        kept_one = EngineCore._append(core, one, stream[i : i + k])
        assert kept_runs == kept_one
        i += k
    assert runs.finished and one.finished
    for field in ("output_token_ids", "text", "finish_reason", "stop_reason"):
        assert getattr(runs, field) == getattr(one, field), field
