"""``specray bench`` end to end on tiny random models: both engines, both
temperatures (the sampled one with top-p), a batch of two, async steps;
greedy outputs identical."""

import json

from factories import add_tokenizer, make_drafter, make_target


def models_and_prompts(root, n: int):
    """A tiny target + drafter under ``root`` and a prompt set of ``n``."""
    hf = make_target(root / "t", vocab_size=320, seed=4)
    add_tokenizer(root / "t", 320)
    make_drafter(root / "d", hf.config, seed=14, block_size=6)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "a b c d " * (i + 1)}) + "\n" for i in range(n)))
    return prompts


def test_bench_reports_both_engines(tmp_path):
    from specray.bench import main

    prompts = models_and_prompts(tmp_path, 3)
    out = tmp_path / "r.json"
    argv = ["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--prompts", str(prompts),
            "--max-tokens", "24", "--batch-size", "2", "--cuda-graphs", "--async-scheduling", "--top-p", "0.9",
            "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["async_scheduling"] and report["batch_size"] == 2 and report["top_p"] == 0.9
    greedy, sampled = report["by_temperature"]["0.0"], report["by_temperature"]["1.0"]
    assert greedy["token_identical_outputs"] == 3 and greedy["prompts"] == 3
    for r in (greedy, sampled):
        assert r["spec_tokens"] > 0 and r["ar_tokens"] > 0 and r["mean_acceptance_length"] >= 1
        assert len(r["per_prompt"]) == 3


def test_a_missing_prompt_set_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    """The default prompt set is relative to the repository root: run
    elsewhere, bench loaded both models and then failed with a traceback."""
    import pytest

    import specray
    from specray.bench import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(specray, "LLM", lambda *a, **k: pytest.fail("models loaded"))
    with pytest.raises(SystemExit) as e:
        main(["--target", str(tmp_path), "--drafter", str(tmp_path)])
    assert e.value.code == 2 and "data/prompts/eval.jsonl: no such file" in capsys.readouterr().err


def test_ab_engines_runs_variants_against_the_baseline(tmp_path):
    """``bench/ab_engines.py`` on tiny random models: two variants and the
    autoregressive engine, two passes; greedy output identical per variant,
    and the variant's settings reach its engine."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "bench" / "ab_engines.py"
    spec = importlib.util.spec_from_file_location("ab_engines", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    assert ab.parse_variant("x:prompt_lookup_min=1,prompt_lookup_agree=false,y=none") == (
        "x", {"prompt_lookup_min": 1, "prompt_lookup_agree": False, "y": None})
    prompts = models_and_prompts(tmp_path, 2)
    out = tmp_path / "ab.json"
    argv = ["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--prompts", str(prompts),
            "--max-tokens", "16", "--passes", "2", "--variant", "off:prompt_lookup_min=0",
            "--variant", "one:prompt_lookup_min=1,logprobs=2", "--out", str(out)]
    assert ab.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["variants"] == {"off": {"prompt_lookup_min": 0}, "one": {"prompt_lookup_min": 1, "logprobs": 2}}
    assert len(report["passes"]) == 2
    for row in report["passes"]:
        for name in ("off", "one"):
            assert row[name]["identical"] == 2 and row[name]["speedup"] > 0
            assert row[name]["mean_acceptance_length"] >= 1
