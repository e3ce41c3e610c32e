"""specray.batch without a Ray head: input rows checked and turned into
tasks, the JSONL and Parquet output logs a resumed job appends to, the
command line's refusals of bad files, settings and addresses, and a replica's
encoding of messages rows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from batch_helpers import REPO, _env, batch_models
from factories import free_port

pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from specray.batch_io import BatchError, JsonlLog, Sink, _dump_line, id_key, validate_record


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return batch_models(tmp_path_factory)


# --------------------------------------------------------------- unit tests
def test_validate_record():
    d = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": None}
    task, why = validate_record({"id": 3, "prompt": "hi", "temperature": 0.5, "max_tokens": 4.0}, d)
    assert why is None and task["params"]["temperature"] == 0.5 and task["params"]["max_tokens"] == 4
    assert validate_record({"prompt": "hi"}, d)[1] == "missing id"
    assert validate_record({"id": "a"}, d)[1] == "missing prompt or messages"
    assert "either prompt or messages" in validate_record({"id": "a", "prompt": "x", "messages": []}, d)[1]
    assert "top_p" in validate_record({"id": "a", "prompt": "x", "top_p": 0}, d)[1]
    assert validate_record({"id": "a", "prompt": "x", "min_tokens": 5.0}, d)[0]["params"]["min_tokens"] == 5
    assert "min_tokens" in validate_record({"id": "a", "prompt": "x", "min_tokens": 9}, d)[1]  # > max_tokens 8
    pen = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2}
    assert validate_record({"id": "a", "prompt": "x", **pen}, d)[0]["params"].items() >= pen.items()
    assert "repetition_penalty" in validate_record({"id": "a", "prompt": "x", "repetition_penalty": 0}, d)[1]
    assert "content" in validate_record({"id": "a", "messages": [{"role": "user"}]}, d)[1]
    assert "id must be" in validate_record({"id": True, "prompt": "x"}, d)[1]
    # Parquet written by pandas holds nullable int ids as floats
    assert validate_record({"id": 3.0, "prompt": "x"}, d)[0]["id"] == 3
    assert "id must be" in validate_record({"id": 3.5, "prompt": "x"}, d)[1]
    # A Parquet null (or pandas NaN) is an absent field.
    assert validate_record({"id": "a", "prompt": "x", "messages": None, "seed": float("nan")}, d)[1] is None
    assert id_key(1) != id_key("1")


def test_engine_flags_reach_the_engine_config():
    from specray.batch import _engine_kwargs, build_parser

    base = ["--input", "in.jsonl", "--output", "out.jsonl", "--target", "t", "--drafter", "d"]
    args = build_parser().parse_args(base)
    assert "prompt_lookup_min" not in _engine_kwargs(args, "t", "d")  # the engine's default
    args = build_parser().parse_args([*base, "--prompt-lookup-min", "0", "--engine-arg", "max_num_seqs=4"])
    kw = _engine_kwargs(args, "t", "d")
    assert kw["prompt_lookup_min"] == 0 and kw["max_num_seqs"] == 4


def test_bad_files_and_settings_exit_2_naming_the_problem(models, tmp_path, capsys):
    """Checked before any Ray work: each was a traceback (exit 1) or, for a
    bad --engine-arg value, a worker failure that said to rerun."""
    from specray.batch import main

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    (tmp_path / "odir").mkdir()
    (tmp_path / "bad.parquet").write_text("not parquet")
    model = ["--target", str(models / "t"), "--drafter", str(models / "d")]
    for argv, said in [
        (["--input", str(inp), "--output", str(tmp_path / "odir")], "is a directory"),
        (["--input", str(tmp_path / "bad.parquet"), "--output", str(tmp_path / "o.parquet")], "as Parquet"),
        (["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--engine-arg", "num_kv_blocks=x"],
         "num_kv_blocks must be int"),
        (["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--engine-arg", "kv_block_size=abc"],
         "kv_block_size must be int"),
        (["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--batch-size", "-3"],
         "--batch-size must be at least 1"),
        # these three were a worker failure that said to rerun, or "does not exist"
        (["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--max-model-len", "100000"],
         "max_model_len 100000 exceeds the target's max_position_embeddings 512"),
        (["--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--num-speculative-tokens", "50"],
         "num_speculative_tokens 50 is more than the drafter drafts in one pass"),
        (["--input", str(tmp_path / "odir"), "--output", str(tmp_path / "o.jsonl")], "odir is a directory: give one"),
    ]:
        assert main([*argv, *model]) == 2, argv
        assert said in capsys.readouterr().err, argv


def test_unreadable_lines_are_error_rows_not_crashes(tmp_path):
    from specray.batch_io import read_records

    d = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": None}
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join([
        b'"just a string"',  # a JSON string is a record (of the wrong kind), not a reason
        b"[" * 100_000 + b"]" * 100_000,  # RecursionError in json
        b'{"id": 1, "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",  # int beyond 4300 digits
        b'{"id": 2, "prompt": "x", "temperature": 1' + b"0" * 400 + b"}",  # OverflowError as a float
        b'{"id": 3, "prompt": "x"}',
    ]))
    got = [(line, validate_record(rec, d)) for line, rec in read_records(path, "jsonl")]
    assert [line for line, _ in got] == [1, 2, 3, 4, 5]
    reasons = [why for _, (_, why) in got]
    assert reasons[0] == "a row must be a JSON object, got str"
    assert reasons[1].startswith("invalid JSON: RecursionError") and reasons[2].startswith("invalid JSON: ValueError")
    assert "temperature must be a finite number" in reasons[3] and reasons[4] is None


def test_resume_names_settings_that_changed(tmp_path):
    from specray.batch import _changed_settings

    settings = {"target": "t", "drafter": "d", "sampling": {"max_tokens": 8, "temperature": 0.0},
                "engine": {"device": "cpu", "num_kv_blocks": 2000}}
    path = tmp_path / "s.json"
    assert _changed_settings(path, settings) == []  # no earlier run
    path.write_text(json.dumps({"status": "complete", "settings": settings}))
    assert _changed_settings(path, settings) == []
    now = {**settings, "sampling": {"max_tokens": 2, "temperature": 1.0}, "drafter": None}
    assert _changed_settings(path, now) == ["drafter: 'd' -> None", "max_tokens: 8 -> 2", "temperature: 0.0 -> 1.0"]


def test_jsonl_rows_are_single_lines():
    line = _dump_line({"id": "a", "text": "x\u2028y\nz\u00e9"})
    assert line.count(b"\n") == 1 and len(line.decode().splitlines()) == 1
    assert json.loads(line)["text"] == "x\u2028y\nz\u00e9"


def test_jsonl_log_discards_a_torn_last_line_and_refuses_a_foreign_file(tmp_path):
    p = tmp_path / "o.jsonl"
    p.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": 3, "te')
    log = JsonlLog(p).open()
    assert [r["id"] for r in log.rows] == [1, 2] and log.discarded_bytes == len(b'{"id": 3, "te')
    log.append([{"id": 3}])
    with pytest.raises(BatchError, match="another batch job"):
        JsonlLog(p).open()  # one writer at a time
    log.close()
    assert p.read_bytes() == b'{"id": 1}\n{"id": 2}\n{"id": 3}\n'
    p.write_bytes(b'{"id": 1}\nnot json\n{"id": 2}\n')
    with pytest.raises(BatchError, match="not a JSON row"):
        JsonlLog(p).open()


def test_parquet_finalize_merges_once_per_id(tmp_path):
    """A kill between renaming the merged Parquet into place and deleting
    the staging file leaves both; the next merge keeps one row per id."""
    out = tmp_path / "o.parquet"
    row = lambda i: {"id": f"r{i}", "text": f"t{i}", "prompt_tokens": 3, "completion_tokens": 2,
                     "finish_reason": "length", "mean_acceptance_length": 1.0}
    pq.write_table(pa.Table.from_pylist([row(0), row(1)]), out)
    (tmp_path / "o.parquet.staging.jsonl").write_text("".join(json.dumps(row(i)) + "\n" for i in (1, 2)) + '{"id"')
    sink = Sink(out, "parquet")
    assert sink.open() == {id_key("r0"), id_key("r1"), id_key("r2")}
    sink.finalize({id_key(f"r{i}"): i for i in range(3)})
    assert pq.read_table(out).to_pylist() == [row(0), row(1), row(2)]
    assert not (tmp_path / "o.parquet.staging.jsonl").exists()


def test_parquet_ids_past_int64_are_written_as_strings(tmp_path):
    """Whole-number ids that int64 cannot hold: the merge at the very end
    must not fail after every row was generated."""
    out = tmp_path / "o.parquet"
    row = lambda i: {"id": i, "text": "t", "prompt_tokens": 3, "completion_tokens": 2,
                     "finish_reason": "length", "mean_acceptance_length": 1.0}
    (tmp_path / "o.parquet.staging.jsonl").write_text("".join(json.dumps(row(i)) + "\n" for i in (1, 2**64 - 1)))
    sink = Sink(out, "parquet")
    sink.open()
    sink.finalize({id_key(1): 0, id_key(2**64 - 1): 1})
    assert [r["id"] for r in pq.read_table(out).to_pylist()] == ["1", str(2**64 - 1)]


def test_an_address_nothing_listens_on_is_refused(models, tmp_path):
    """A mistyped --address: ray.init retried it for good (minutes, not a
    word on what was wrong)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    cmd = [sys.executable, "-m", "specray.cli", "batch", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
           "--target", str(models / "t"), "--drafter", str(models / "d"), "--address", f"127.0.0.1:{free_port()}"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "no Ray cluster answers at 127.0.0.1:" in r.stderr, r.stderr[-2000:]


def bos_adding_copy(models, dst: Path) -> Path:
    """The target with a tokenizer that adds BOS to what it encodes (as
    Llama's do); its chat template writes <s> itself too."""
    from tokenizers import Tokenizer, processors

    shutil.copytree(models / "t", dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(dst / "tokenizer.json"))
    return dst


def test_messages_rows_are_not_given_a_second_bos(models, tmp_path):
    """A messages row was rendered to text and encoded again with the
    tokenizer's special tokens: <s><s>user: ... on a BOS-adding tokenizer,
    where the server and vLLM encode the rendered template as it is."""
    from transformers import AutoTokenizer

    from specray import LLM, SamplingParams
    from specray.batch import Replica

    t = bos_adding_copy(models, tmp_path / "t")
    msgs = [{"role": "user", "content": "The capital of France"}]
    tok = AutoTokenizer.from_pretrained(str(t))
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    params = {"max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": None}
    row = {"line": 1, "id_json": id_key("a"), "task": json.dumps({"id": "a", "messages": msgs, "params": params})}
    replica = Replica({"target": str(t), "drafter": str(models / "d"), "num_kv_blocks": 200})
    (got,) = replica.run([row])
    want = LLM(t, models / "d", num_kv_blocks=200).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert got["prompt_tokens"] == len(ids)
    assert got["text"] == want.text
