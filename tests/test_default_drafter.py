"""The embedded default: SmolLM2-135M-Instruct with the DFlash drafter
trained for it (cluster/assets/smollm2-dflash), on CPU in fp32."""

import json
import time
from pathlib import Path

import pytest
import torch

from specray import LLM, SamplingParams
from specray.default_model import default_drafter_dir, ensure_default_target

pytestmark = pytest.mark.slow
EVAL = Path(__file__).parent.parent / "data" / "prompts" / "eval.jsonl"


@pytest.fixture(scope="module")
def target():
    return str(ensure_default_target())


@pytest.fixture(scope="module")
def spec(target):
    return LLM(target, default_drafter_dir(), max_model_len=2048)


def chat(llm, messages):
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_capital_of_france(spec):
    out = spec.generate(chat(spec, [{"role": "user", "content": "What is the capital of France?"}]),
                        SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.metrics.mean_acceptance_length > 1.0


def test_greedy_identical_with_and_without_drafter_on_eval_set(target, spec):
    """The default engine (drafter + prompt-lookup drafts) and the drafter
    alone emit exactly the target's greedy tokens on every eval prompt."""
    rows = [json.loads(line) for line in EVAL.read_text().splitlines() if line.strip()]
    assert len(rows) >= 40
    prompts = [chat(spec, r["messages"]) for r in rows]
    params = SamplingParams(max_tokens=48, temperature=0)
    without = LLM(target, None, max_model_len=2048).generate(prompts, params)
    drafter_only = LLM(target, default_drafter_dir(), max_model_len=2048, prompt_lookup_min=0)
    lookups = []
    for llm in (spec, drafter_only):
        with_drafter = llm.generate(prompts, params)
        for r, a, b in zip(rows, with_drafter, without):
            assert a.token_ids == b.token_ids, r["id"]
        lengths = [x for o in with_drafter for x in o.metrics.acceptance_lengths]
        assert max(lengths) > 2  # drafts do get accepted
        lookups.append(sum(o.metrics.num_lookup_steps for o in with_drafter))
    assert lookups[0] > 0 and lookups[1] == 0


def test_acceptance_lengths_equal_reference_with_trained_drafter(target, spec):
    """Batch 1, a real drafter: every step's accepted length equals the
    DFlash authors' dflash_generate on the same weights."""
    import dflash.model as dm
    from transformers import AutoModelForCausalLM

    dm._cuda_time = time.perf_counter  # the reference times with cuda.synchronize
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ref = dm.DFlashDraftModel.from_pretrained(default_drafter_dir(), dtype=torch.float32).eval()
    rows = [json.loads(line) for line in EVAL.read_text().splitlines() if line.strip()]
    # The reference verifies chains.
    drafter_only = LLM(target, default_drafter_dir(), max_model_len=2048, prompt_lookup_min=0, draft_tree=False)
    for row in (rows[0], rows[13]):
        ids = spec.tokenizer(chat(spec, row["messages"]), add_special_tokens=False)["input_ids"]
        r = dm.dflash_generate(ref, hf, torch.tensor([ids]), 40, [2], return_stats=True)
        out = drafter_only.generate([ids], SamplingParams(max_tokens=40, temperature=0))[0]
        assert out.token_ids == r.output_ids[0, len(ids):].tolist()
        assert out.metrics.acceptance_lengths == r.acceptance_lengths
        assert max(r.acceptance_lengths) > 1
