"""Bad input gets a clear error naming the problem, and a running engine
keeps serving its other requests."""

import json
import shutil

import pytest

from factories import make_drafter, make_target
from specray import LLM, ConfigError, SamplingParams
from specray.config import EngineConfig
from specray.llm import build_engine
from specray.engine_loop import EngineLoop
from specray.request import PromptsRefused, PromptTooLong


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    hf = make_target(root / "t", max_position_embeddings=64)
    make_drafter(root / "d", hf.config)
    return root, hf


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(max_tokens=-3), "max_tokens must be at least 1"),
        (dict(temperature=-0.1), "temperature must be non-negative"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be"),
        (dict(seed="x"), "seed must be an integer"),
        (dict(seed=2**64), "seed must fit in a signed 64-bit integer"),
        (dict(stop=[3]), "stop must be"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
        (dict(temperature=10**400), "temperature must be a finite number"),  # was an OverflowError
        (dict(stop=5), "stop must be a string or a list of strings"),  # was "'int' object is not iterable"
        (dict(stop={"q": 1}), "stop must be a string or a list of strings"),  # was taken as ["q"]
        (dict(stop=["ok", None]), "stop must be a string or a list of strings"),  # was dropped silently
        (dict(top_p=10**400), r"top_p must be in \(0, 1\]"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_extreme_but_valid_sampling_values_decode_sensibly(ckpt):
    """Values that pass validation but broke a step: a top_k beyond int64
    (the step's tensor could not hold it, and the failed step ended every
    request in flight), a temperature so small that logits / T overflow
    float32, a top_p that rounds to 0 in float32 (nothing kept: the last
    vocabulary token every time). All must decode as their limits do."""
    root, _ = ckpt
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-5).greedy
    llm = LLM(str(root / "t"), str(root / "d"), num_kv_blocks=64)
    prompt = [5, 9, 13, 7]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    cases = [dict(temperature=1e-39), dict(temperature=1.0, top_p=1e-46, seed=3),
             dict(temperature=0.7, top_k=2**63, seed=4), dict(temperature=0.7, top_k=10**30, top_p=1e-300, seed=5)]
    outs = llm.generate([prompt] * len(cases), [SamplingParams(max_tokens=12, ignore_eos=True, **c) for c in cases])
    for c, o in zip(cases, outs):
        assert o.finish_reason == "length", c
        if c.get("top_p", 1) < 1e-40 or c["temperature"] < 1e-5:
            assert o.token_ids == greedy, c  # only the argmax survives
    assert len(set(outs[2].token_ids)) > 1  # top_k 2**63 = no top-k: still sampling


def test_engine_keeps_serving_after_bad_requests(ckpt):
    root, _ = ckpt
    engine = build_engine(EngineConfig(target=str(root / "t"), drafter=str(root / "d"), num_kv_blocks=64))
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    with pytest.raises(PromptTooLong, match="prompt has 64 tokens; this model takes at most 63"):
        engine.add_request(list(range(2, 66)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, 10_000], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="ships no tokenizer"):
        engine.add_request("hello", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5], SamplingParams(max_tokens=4), request_id=good)
    done = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done = o
    assert done.request_id == good and len(done.token_ids) == 20


def test_a_request_keeps_its_own_validated_params(ckpt):
    """The engine held the caller's SamplingParams object: changing it for
    the next request changed the first one's max_tokens, and a field made
    invalid after construction reached a step, whose failure ended every
    request in flight (an OverflowError for a seed beyond int64)."""
    root, _ = ckpt
    llm = LLM(str(root / "t"), str(root / "d"), num_kv_blocks=64)
    engine = llm.engine
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = engine.add_request([5, 6, 7], p)
    p.max_tokens = 9
    second = engine.add_request([5, 6, 8], p)
    for field, value, match in (("seed", 2**70, "seed must fit"), ("max_tokens", None, "max_tokens must be an integer"),
                                ("temperature", -1.0, "temperature must be non-negative"), ("stop", 5, "stop must be")):
        bad = SamplingParams(max_tokens=4, temperature=1.0)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=match):
            engine.add_request([5, 9], bad)
        with pytest.raises(PromptsRefused, match=match):
            llm.generate([5, 9], bad)
    lengths = {}
    while engine.has_unfinished():
        lengths |= {o.request_id: len(o.token_ids) for o in engine.step() if o.finished}
    assert lengths == {first: 3, second: 9}


def test_prompts_of_the_wrong_kind_are_named(ckpt):
    root, _ = ckpt
    llm = LLM(str(root / "t"), str(root / "d"), num_kv_blocks=64)
    for prompts in (5, None, {"prompt": [1]}, b"hello"):
        with pytest.raises(ValueError, match="prompts must be a string, a list of token ids"):
            llm.generate(prompts)
    for prompt, match in (([1.7, 2.2], "must be integers, got 1.7 at index 0"),
                          (["1", "2"], "must be integers, got '1'"), ([3, True], "got True at index 1")):
        with pytest.raises(PromptsRefused, match=match):  # were read as [1, 2], [1, 2], [3, 1]
            llm.generate([prompt], SamplingParams(max_tokens=2))
    import numpy as np

    assert len(llm.generate([np.array([5, 6, 7])], SamplingParams(max_tokens=2))[0].token_ids) == 2
    assert len(llm.generate(np.array([5, 6, 7]), SamplingParams(max_tokens=2))) == 1  # one prompt, not three
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ConfigError, match="sees no CUDA device"):  # was an AssertionError from torch
            LLM(str(root / "t"), device="cuda")


def test_generate_names_prompts_and_params_of_the_wrong_shape(ckpt):
    """A float or a 0-d tensor as the prompts raised a bare TypeError from
    list(); a dict of settings as the params was refused as "got str" (its
    keys); a list of numpy integers was taken as that many prompts, and a
    bool tensor as token ids."""
    import numpy as np
    import torch

    root, _ = ckpt
    llm = LLM(str(root / "t"), num_kv_blocks=64)
    for prompts in (1.5, torch.tensor(3), np.int64(3)):
        with pytest.raises(ValueError, match="prompts must be a string, a list of token ids"):
            llm.generate(prompts)
    for params in ({"max_tokens": 2}, "greedy", 3):
        with pytest.raises(ValueError, match=f"params must be SamplingParams or a list of them, got {type(params).__name__}"):
            llm.generate([5, 6, 7], params)
    with pytest.raises(PromptsRefused, match="must be integers, got tensor.True. at index 0"):
        llm.generate(torch.tensor([True, False]))  # was read as [1, 0]
    outs = llm.generate([np.int64(5), np.int64(6), np.int64(7)], SamplingParams(max_tokens=2, temperature=0))
    assert len(outs) == 1 and outs[0].prompt_token_ids == [5, 6, 7] and len(outs[0].token_ids) == 2


def test_interrupted_generate_leaves_nothing_behind(ckpt, monkeypatch):
    """Ctrl-C in LLM.generate (or a step that fails) must not leave that
    call's requests in the engine: the next call stepped them along with
    its own and failed with a KeyError, every time."""
    root, _ = ckpt
    llm = LLM(str(root / "t"), str(root / "d"), num_kv_blocks=64)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts * 2, params)
    monkeypatch.setattr(llm.engine, "step", step)
    assert not llm.engine.has_unfinished()
    sched = llm.engine.scheduler
    assert sched.target_pool.num_free == sched.target_pool.capacity
    assert sched.draft_pool.num_free == sched.draft_pool.capacity
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    # a step that fails once inside (the target's forward raising) is
    # retried, on part of the requests first: nothing fails (faults.py)
    execute = llm.engine.target.execute

    def failing_once(batch):
        monkeypatch.setattr(llm.engine.target, "execute", execute)
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(llm.engine.target, "execute", failing_once)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    # a forward that keeps failing fails the call, and leaves nothing behind
    def failing(batch):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(llm.engine.target, "execute", failing)
    with pytest.raises(RuntimeError, match="the forward failed"):
        llm.generate(prompts, params)
    monkeypatch.setattr(llm.engine.target, "execute", execute)
    assert not llm.engine.has_unfinished() and sched.target_pool.num_free == sched.target_pool.capacity
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_missing_and_corrupt_checkpoints(ckpt, tmp_path):
    root, _ = ckpt
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json is missing"):
        LLM(empty)
    t = tmp_path / "t"
    shutil.copytree(root / "t", t)
    (t / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ConfigError, match="cannot read weight file .*model.safetensors"):
        LLM(t)
    (t / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors weight files"):
        LLM(t)
    shutil.copytree(root / "t", tmp_path / "t2")
    (tmp_path / "t2" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        LLM(tmp_path / "t2")


def test_truncated_weights_name_the_tensor(ckpt, tmp_path):
    root, _ = ckpt
    from safetensors.torch import load_file, save_file

    t = tmp_path / "t"
    shutil.copytree(root / "t", t)
    tensors = load_file(t / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, t / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model.layers.1.mlp.up_proj.weight.* is missing"):
        LLM(t)


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if k == "dflash_config":
            cfg["dflash_config"].update(v)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(hidden_size=128), "hidden_size 128 != target hidden_size 64"),
        (dict(vocab_size=999), "vocab_size 999 != target vocab_size 320"),
        (dict(dflash_config={"target_layer_ids": [1, 7]}), r"target_layer_ids \[1, 7\] must lie in \[0, 4\)"),
        (dict(dflash_config={"mask_token_id": 5000}), "mask_token_id 5000 is outside the vocabulary"),
        (dict(num_target_layers=36), "built for 36 target layers"),
        (dict(architectures=["Qwen3ForCausalLM"]), "DFlashDraftModel"),
    ],
)
def test_drafter_that_does_not_fit(ckpt, tmp_path, changes, match):
    root, _ = ckpt
    d = _edit_config(root / "d", tmp_path / "d", **changes)
    with pytest.raises(ConfigError, match=match):
        LLM(root / "t", d)


def test_engine_config_errors(ckpt):
    root, _ = ckpt
    with pytest.raises(ConfigError, match="exceeds the target's max_position_embeddings 64"):
        LLM(root / "t", max_model_len=1000)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        LLM(root / "t", dtype="int8")
    with pytest.raises(ConfigError, match="fewer than max_model_len"):
        LLM(root / "t", num_kv_blocks=3, kv_block_size=4)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        LLM(root / "t").generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ConfigError, match="num_speculative_tokens must be at least 1"):
        LLM(root / "t", root / "d", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="num_speculative_tokens 99 is more than the drafter drafts in one pass"):
        LLM(root / "t", root / "d", num_speculative_tokens=99)
    # wrong types (from YAML, --engine-arg, JSON) are named, not left to fail in a worker
    for kw, match in [(dict(num_kv_blocks="x"), "num_kv_blocks must be int"),
                      (dict(max_model_len="256"), "max_model_len must be int"),
                      (dict(num_kv_blocks=-1), "num_kv_blocks must be at least 2"),
                      (dict(cuda_graphs=1), "cuda_graphs must be bool")]:
        with pytest.raises(ConfigError, match=match):
            LLM(root / "t", **kw)


def test_batch_with_bad_prompts_names_each_and_runs_none(ckpt):
    root, _ = ckpt
    llm = LLM(root / "t", root / "d", num_kv_blocks=64)
    steps, step = [], llm.engine.step
    llm.engine.step = lambda: steps.append(1) or step()
    with pytest.raises(PromptsRefused) as err:  # a ValueError, naming each
        llm.generate([[5, 6], [], [7], [5, 10_000]], SamplingParams(max_tokens=4))
    assert [i for i, _ in err.value.refused] == [1, 3]
    msg = str(err.value)
    assert msg.startswith("2 prompt(s) refused, nothing generated")
    assert "prompt 1: prompt is empty" in msg and "prompt 3: prompt token ids [10000]" in msg
    assert not llm.engine.has_unfinished() and not steps
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_submit_returns_each_error_with_its_type(ckpt):
    """The serving layer answers by the error's type (a prompt too long is
    OpenAI's context_length_exceeded), so submit hands back the exception,
    not its text; after shutdown it is a server error, not a bad prompt."""
    root, _ = ckpt
    loop = EngineLoop(build_engine(EngineConfig(target=str(root / "t"), drafter=str(root / "d"), num_kv_blocks=64)))
    try:
        errors = loop.submit([(list(range(2, 66)), SamplingParams(max_tokens=4), "long"),
                              ([5, 10_000], SamplingParams(max_tokens=4), "vocab"),
                              ([5, 6], SamplingParams(max_tokens=2), "fine")])
        assert isinstance(errors[0], PromptTooLong)
        assert type(errors[1]) is ValueError and "outside the vocabulary" in str(errors[1])
        assert errors[2] is None
    finally:
        loop.stop()
    (after,) = loop.submit([([5, 6], SamplingParams(max_tokens=2), "late")])
    assert isinstance(after, RuntimeError) and "shut down" in str(after)


def test_shutdown_ends_open_streams(ckpt):
    """Shutting the engine down under an open stream ends the stream (its
    request aborted, with the tokens it had) instead of leaving it waiting
    on a loop that will never answer; later callers get a clear error."""
    import asyncio

    from specray.async_engine import AsyncEngine, generate_sync, make_core

    root, _ = ckpt
    core = make_core(EngineConfig(target=str(root / "t"), drafter=str(root / "d"), num_kv_blocks=64))
    engine = AsyncEngine(core)

    async def stream():
        outs = []
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        async for out in engine.generate([5, 6, 7], params):
            outs.append(out)
            if len(outs) == 2:
                await asyncio.to_thread(engine.shutdown)
        return outs

    outs = asyncio.run(asyncio.wait_for(stream(), timeout=60))
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert 2 <= len(outs[-1].token_ids) < 200
    with pytest.raises(RuntimeError, match="shut down"):
        generate_sync(core, [[5, 6]], [SamplingParams(max_tokens=2)])
    with pytest.raises(RuntimeError, match="shut down"):  # a poller past the last output
        core.get_outputs(10**9, 1.0)


def test_join_settings_are_checked():
    with pytest.raises(ConfigError, match="join_batch must be positive"):
        EngineConfig(target="t", join_batch=0)
    with pytest.raises(ConfigError, match="join_wait_steps must be 0 or more"):
        EngineConfig(target="t", join_wait_steps=-1)
