"""What users of the offline API and the command line hand specray by
mistake, or in vLLM's habits, gets a clear error or what vLLM would do
(no Ray here)."""

import json
import shutil

import pytest
from factories import make_models

from specray import LLM, ConfigError, SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("inputs"))


def test_generate_chat_is_not_given_a_second_bos(models, tmp_path, capsys):
    """`specray generate --chat` encoded the rendered template with the
    tokenizer's special tokens: <s><s>user: ... where the template writes
    its own BOS (Llama); the server encodes it as it is."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    from specray.cli import main

    t = tmp_path / "t"
    shutil.copytree(models / "t", t)
    tok = Tokenizer.from_file(str(t / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(t / "tokenizer.json"))
    hf_tok = AutoTokenizer.from_pretrained(str(t))
    text = hf_tok.apply_chat_template([{"role": "user", "content": "Hello world"}], tokenize=False,
                                      add_generation_prompt=True)
    ids = hf_tok.encode(text, add_special_tokens=False)
    want = LLM(t, models / "d", num_kv_blocks=200).generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
    assert main(["generate", "--target", str(t), "--drafter", str(models / "d"), "--max-tokens", "8",
                 "--chat", "--json", "Hello world"]) == 0
    printed = capsys.readouterr().out
    assert printed.rsplit("\n", 2)[0] == want.text


def test_an_unknown_device_is_named(models, tmp_path, capsys):
    """It reached torch in the worker: a RuntimeError traceback from
    `specray generate`, a failed replica (\"rerun to resume\") from a batch
    job on a cluster."""
    from specray.batch import main as batch_main
    from specray.cli import main

    for device in ("tpu", "gpu", "cuda:x"):
        with pytest.raises(ConfigError, match=f"device must be cpu, cuda or cuda:N, got '{device}'"):
            LLM(models / "t", device=device)
    assert main(["generate", "--target", str(models / "t"), "--device", "gpu", "x"]) == 2
    assert "device must be" in capsys.readouterr().err
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": "hi"}) + "\n")
    assert batch_main(["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--target", str(models / "t"),
                       "--no-drafter", "--device", "gpu", "--address", "127.0.0.1:1"]) == 2
    assert "device must be" in capsys.readouterr().err


def test_a_drafter_given_as_the_target_is_named(models):
    """DFlash configs say model_type qwen3: the drafter loaded as a target
    and failed on a missing embedding tensor."""
    with pytest.raises(ConfigError, match="is a DFlash drafter, not a target"):
        LLM(models / "d")
