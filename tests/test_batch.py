"""Batch generation as a Ray job (specray.batch, deploy/ray/batch_job.py).

One loopback Ray head (``ray start --head``, private temp dir and ports) serves
every job in this file; jobs run as subprocesses of the CLI, like a user runs
them, or through ``ray job submit``. A tiny random target (with tokenizer and
chat template) and a tiny drafter keep 240 rows fast on CPU. The pieces that
need no head (row checks, output logs, refusals): test_batch_io.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from batch_helpers import REPO, _env, batch_models
from factories import free_port

pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

EVAL = REPO / "data" / "prompts" / "eval.jsonl"
MAX_TOKENS = 12
SHORT_MAX_TOKENS = 5
CONTENT_CHARS = 90  # truncated eval prompts: short prompts for a tiny model


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return batch_models(tmp_path_factory)


class Head:
    """A Ray head on loopback with the job server, in its own process group
    and temp dir (so no other Ray on this machine finds it or is touched by
    it). It starts in the background; ``wait()`` blocks until it serves."""

    def __init__(self):
        ports = {k: free_port() for k in ("port", "dashboard-port", "ray-client-server-port",
                                           "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                           "runtime-env-agent-port", "metrics-export-port")}
        self.temp_dir = tempfile.mkdtemp(prefix="rb", dir="/tmp")
        self.gcs = f"127.0.0.1:{ports['port']}"
        self.dashboard = f"http://127.0.0.1:{ports['dashboard-port']}"
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
               "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", "--num-cpus=4",
               "--disable-usage-stats", f"--temp-dir={self.temp_dir}", "--object-store-memory=300000000",
               *(f"--{k}={v}" for k, v in ports.items())]
        self.log = open(Path(self.temp_dir) / "head.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=_env(),
                                     start_new_session=True)
        self.started = time.monotonic()
        self.up = False

    def wait(self, timeout: float = 120) -> Head:
        import urllib.request

        # The job server answers once the head is up (no proxies: loopback).
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while not self.up:
            assert self.proc.poll() is None, Path(self.temp_dir, "head.log").read_text()[-3000:]
            try:
                opener.open(self.dashboard + "/api/jobs/", timeout=2).read()
                self.up = True
            except Exception:
                if time.monotonic() - self.started > timeout:
                    raise
                time.sleep(0.5)
        return self

    def stop(self) -> None:
        """Kill exactly the process group this head was started in (its
        pgid is the `ray start` pid): gcs, raylet, dashboard, workers."""
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
            os.killpg(pgid, signal.SIGKILL)  # `ray start --block` and gcs ignore SIGTERM
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        yield h
    finally:
        h.stop()


def eval_rows():
    return [json.loads(line) for line in EVAL.read_text().splitlines() if line.strip()]


def build_input(path: Path, copies: int = 5) -> list[dict]:
    """copies x 48 eval prompts: messages rows (one copy with a per-row
    max_tokens), and prompt-string rows; each copy with its own seed."""
    rows = []
    for k in range(copies):
        for r in eval_rows():
            content = r["messages"][0]["content"][:CONTENT_CHARS]
            row = {"id": f"{r['id']}-{k}", "seed": k}
            if k == copies - 1:
                row["prompt"] = content
            else:
                row["messages"] = [{"role": "user", "content": content}]
            if k == 2:
                row["max_tokens"] = SHORT_MAX_TOKENS
            rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def expected_texts(models, rows) -> dict:
    """What LLM.generate gives for the same rows (greedy), computed on the
    distinct (prompt, max_tokens) pairs."""
    from specray import LLM, SamplingParams

    llm = LLM(models / "t", models / "d", num_kv_blocks=2000)
    tok = llm.tokenizer

    def render(r):
        if "prompt" in r:
            return r["prompt"]
        return tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)

    keys = {}
    for r in rows:
        keys.setdefault((render(r), r.get("max_tokens", MAX_TOKENS)), []).append(r["id"])
    pairs = list(keys)
    outs = llm.generate([p for p, _ in pairs], [SamplingParams(max_tokens=n, temperature=0) for _, n in pairs])
    return {rid: o.text for (pair, o) in zip(pairs, outs) for rid in keys[pair]}


@pytest.fixture(scope="module")
def job240(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("job240")
    rows = build_input(d / "in.jsonl")
    return d / "in.jsonl", rows, expected_texts(models, rows)


def batch_cmd(models, inp, out, head, *extra) -> list[str]:
    return [sys.executable, "-m", "specray.cli", "batch", "--input", str(inp), "--output", str(out),
            "--target", str(models / "t"), "--drafter", str(models / "d"), "--max-tokens", str(MAX_TOKENS),
            "--temperature", "0", "--engine-arg", "num_kv_blocks=2000", "--address", head.wait().gcs, *extra]


def run_batch(cmd, timeout=240) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line]


def assert_exactly_once(out_rows, rows, want):
    ids = [r["id"] for r in out_rows]
    assert len(ids) == len(set(ids)), "duplicate ids in the output"
    assert set(ids) == {r["id"] for r in rows}
    for r in out_rows:
        assert r["text"] == want[r["id"]], r["id"]
        assert set(r) == {"id", "text", "prompt_tokens", "completion_tokens", "finish_reason",
                          "mean_acceptance_length"}


# ------------------------------------------------------------ jobs on Ray
def test_jsonl_job_killed_and_resumed_matches_llm_generate(models, head, job240, tmp_path):
    """240 rows over 2 replicas: SIGKILL the driver once some rows are out,
    rerun the same command, and get every id exactly once with the texts
    LLM.generate gives."""
    inp, rows, want = job240
    out = tmp_path / "out.jsonl"
    cmd = batch_cmd(models, inp, out, head, "--replicas", "2", "--batch-size", "8")
    err = open(tmp_path / "killed.stderr", "w")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, start_new_session=True)
    try:
        n = 0
        while time.perf_counter() - t < 180 and proc.poll() is None:
            n = out.read_bytes().count(b"\n") if out.exists() else 0
            if n >= 24:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"finished before the kill ({n} rows)"
        os.kill(proc.pid, signal.SIGKILL)  # the driver: Ray then reaps its replica actors
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        err.close()
    partial = read_jsonl(out)  # whole lines only
    assert 24 <= len(partial) < len(rows), len(partial)
    assert len({r["id"] for r in partial}) == len(partial)
    # What a machine crash mid-write could leave: a torn last line.
    with open(out, "ab") as f:
        f.write(b'{"id": "eval-math-01-0", "text": "tor')
    r = run_batch(cmd)
    wall = time.perf_counter() - t
    assert "discarded a partial last line" in r.stderr
    final = read_jsonl(out)
    assert final[: len(partial)] == partial  # appended, never rewritten
    assert len(final) == len(rows) >= 200
    assert_exactly_once(final, rows, want)
    by_id = {r["id"]: r for r in final}
    assert by_id["eval-chat-01-2"]["completion_tokens"] <= SHORT_MAX_TOKENS  # per-row max_tokens
    assert all(r["completion_tokens"] >= 1 and r["prompt_tokens"] > 0 for r in final)
    assert all(r["mean_acceptance_length"] >= 1.0 for r in final)

    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert json.loads(r.stdout) == summary
    assert summary["status"] == "complete" and summary["errors"] == 0 and summary["rows_ok"] == len(rows)
    assert summary["rows_resumed"] == len(partial) and summary["rows_generated"] == len(rows) - len(partial)
    resumed_ids = {x["id"] for x in partial}
    assert summary["output_tokens"] == sum(x["completion_tokens"] for x in final if x["id"] not in resumed_ids)
    assert summary["output_tokens_per_s"] > 0 and summary["mean_acceptance_length"] >= 1.0
    assert "row" in r.stderr and "tok/s" in r.stderr and "acc" in r.stderr  # the progress bar
    print(f"\nkilled at {len(partial)} rows; both runs {wall:.1f} s; resumed run: {summary}")


def test_malformed_rows_go_to_the_errors_file(models, head, tmp_path):
    """Also the Ray-engine replica (--tp 2: a TP group + drafter actor per
    replica), where the refusal of a too-long prompt comes back from
    generate."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    msg = [{"role": "user", "content": "Why is the sky blue?"}]
    lines = [
        json.dumps({"id": "ok-1", "messages": msg}),                          # 1
        "{not json",                                                        # 2
        json.dumps({"prompt": "no id here"}),                               # 3
        json.dumps({"id": "no-prompt"}),                                    # 4
        json.dumps({"id": "dup", "prompt": "The capital of France"}),       # 5
        json.dumps({"id": "dup", "prompt": "again"}),                       # 6
        json.dumps({"id": "bad-temp", "prompt": "hi", "temperature": -1}),  # 7
        json.dumps({"id": "bad-max", "prompt": "hi", "max_tokens": 0}),     # 8
        json.dumps({"id": "too-long", "prompt": "Hello world, " * 400}),    # 9: the engine refuses it
        "[1, 2, 3]",                                                        # 10
        json.dumps({"id": "bad-msg", "messages": "hello"}),                 # 11
        "",                                                                 # 12: blank, skipped
        json.dumps({"id": 7, "prompt": "Hello world", "max_tokens": 4}),    # 13
    ]
    inp.write_text("\n".join(lines) + "\n")
    r = run_batch(batch_cmd(models, inp, out, head, "--no-progress", "--tp", "2"))
    got = {x["id"]: x["text"] for x in read_jsonl(out)}
    assert sorted(map(str, got)) == ["7", "dup", "ok-1"]
    want = expected_texts(models, [{"id": "ok-1", "messages": msg}, {"id": "dup", "prompt": "The capital of France"},
                                   {"id": 7, "prompt": "Hello world", "max_tokens": 4}])
    assert got == want
    errors = {e["line"]: e for e in read_jsonl(tmp_path / "out.jsonl.errors.jsonl")}
    assert sorted(errors) == [2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert "invalid JSON" in errors[2]["reason"]
    assert errors[3]["reason"] == "missing id"
    assert errors[4]["reason"] == "missing prompt or messages" and errors[4]["id"] == "no-prompt"
    assert "duplicate id (first on line 5)" == errors[6]["reason"]
    assert "temperature" in errors[7]["reason"] and "max_tokens" in errors[8]["reason"]
    assert errors[9]["stage"] == "engine" and errors[9]["id"] == "too-long"
    assert errors[9]["reason"].startswith("prompt has")  # its own reason, not the batch's
    assert "JSON object" in errors[10]["reason"] and "messages" in errors[11]["reason"]
    summary = json.loads(r.stdout)
    assert summary["errors"] == 9 and summary["rows_ok"] == 3 and summary["status"] == "complete"
    assert summary["backend"] == "ray" and summary["tp"] == 2
    # A rerun neither repeats rows nor errors.
    before = (out.read_bytes(), (tmp_path / "out.jsonl.errors.jsonl").read_bytes())
    r2 = run_batch(batch_cmd(models, inp, out, head, "--no-progress", "--tp", "2"))
    assert (out.read_bytes(), (tmp_path / "out.jsonl.errors.jsonl").read_bytes()) == before
    assert json.loads(r2.stdout)["errors_new"] == 0 and json.loads(r2.stdout)["rows_resumed"] == 4
    # The input edited between runs: rows are matched by id, not by line (a
    # new row where the refused one was used to be skipped as "done", and a
    # fixed row stayed in the errors file beside its output).
    lines[8] = json.dumps({"id": "new-row", "prompt": "Hello", "max_tokens": 4})  # where too-long was
    lines[6] = json.dumps({"id": "bad-temp", "prompt": "hi", "max_tokens": 4})  # fixed
    inp.write_text("\n".join(lines) + "\n")
    r3 = json.loads(run_batch(batch_cmd(models, inp, out, head, "--no-progress", "--tp", "2")).stdout)
    assert sorted(str(x["id"]) for x in read_jsonl(out)) == ["7", "bad-temp", "dup", "new-row", "ok-1"]
    errors = read_jsonl(tmp_path / "out.jsonl.errors.jsonl")
    assert sorted(e["line"] for e in errors) == [2, 3, 4, 6, 8, 10, 11]
    assert r3["rows_generated"] == 2 and r3["rows_ok"] + r3["errors"] == r3["rows_input"] == 12


def test_engine_errors_stay_and_rows_cut_by_a_lost_engine_run_again(models, head, tmp_path):
    """A row that fails alone in the engine (a test hook makes the seed-666
    row's step raise) is an engine error of its own, the other rows run;
    rows an earlier run lost to an engine fault (stage "unavailable") run
    again on the rerun, and leave the errors file."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": f"r{i}", "prompt": p, "max_tokens": 6} for i, p in
            enumerate(["Hello world", "The capital of France", "Why is the sky blue?", "Paris is"])]
    rows[1]["seed"] = 666
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    errors_path = tmp_path / "out.jsonl.errors.jsonl"
    errors_path.write_text(json.dumps({"line": 3, "id": "r2", "stage": "unavailable",
                                       "reason": "the engine was unavailable: ..."}) + "\n")
    hook = 'extra={"fault_injection": {"seed": 666, "where": "step"}}'
    r = json.loads(run_batch(batch_cmd(models, inp, out, head, "--no-progress", "--engine-arg", hook)).stdout)
    assert sorted(x["id"] for x in read_jsonl(out)) == ["r0", "r2", "r3"]
    (err,) = read_jsonl(errors_path)
    assert err["id"] == "r1" and err["stage"] == "engine" and "injected step failure" in err["reason"]
    assert r["rows_generated"] == 3 and r["errors"] == 1 and r["status"] == "complete"
    r2 = json.loads(run_batch(batch_cmd(models, inp, out, head, "--no-progress", "--engine-arg", hook)).stdout)
    assert r2["rows_generated"] == 0 and r2["rows_resumed"] == 4  # an engine error stands (--retry-errors)


def test_a_replica_the_cluster_cannot_place_is_refused(models, tmp_path):
    """On the private cluster it starts, it waited for resources forever (a
    GPU on a CPU-only cluster, more CPUs than the cluster has)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    cmd = [sys.executable, "-m", "specray.cli", "batch", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
           "--target", str(models / "t"), "--drafter", str(models / "d"), "--num-cpus", "2", "--no-progress"]
    env = {k: v for k, v in _env().items() if k != "RAY_ADDRESS"}
    for extra in (["--cpus-per-replica", "3"], ["--device", "cuda"]):
        r = subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
        assert r.returncode == 2 and "too small for this engine" in r.stderr, (extra, r.stderr[-2000:])


def test_parquet_in_parquet_out(models, head, job240, tmp_path):
    _, rows, want = job240
    sub = rows[:10] + rows[-6:]  # messages rows and prompt rows
    table = pa.Table.from_pylist([
        {"id": r["id"], "prompt": r.get("prompt"), "messages": r.get("messages"), "seed": r["seed"],
         "max_tokens": r.get("max_tokens")} for r in sub
    ] + [{"id": "too-long", "prompt": "Hello world, " * 400, "messages": None, "seed": None, "max_tokens": None}])
    inp, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(table, inp)
    r = run_batch(batch_cmd(models, inp, out, head, "--no-progress", "--batch-size", "6"))
    got = pq.read_table(out).to_pylist()
    assert [g["id"] for g in got] == [x["id"] for x in sub]  # input order
    assert all(g["text"] == want[g["id"]] for g in got)
    assert not (tmp_path / "out.parquet.staging.jsonl").exists()
    (err,) = read_jsonl(tmp_path / "out.parquet.errors.jsonl")
    assert err["id"] == "too-long" and err["line"] == len(sub) + 1 and err["stage"] == "engine"
    assert json.loads(r.stdout)["rows_ok"] == len(sub)


def test_ray_job_submit_end_to_end(models, head, job240, tmp_path):
    """`ray job submit` with the documented runtime_env: the working dir and
    a py_modules copy of specray travel to the job."""
    inp, rows, want = job240
    work = tmp_path / "work"
    (work / "deploy" / "ray").mkdir(parents=True)
    for f in ("batch_job.py", "runtime_env.yaml"):
        shutil.copy(REPO / "deploy" / "ray" / f, work / "deploy" / "ray" / f)
    shutil.copy(inp, work / "in.jsonl")
    env = _env()
    subprocess.run([sys.executable, "deploy/ray/batch_job.py", "--stage-py-modules", "build/py_modules"],
                   cwd=work, env=env, check=True, capture_output=True)
    assert (work / "build/py_modules/specray/actors/target.py").is_file()
    out = tmp_path / "out.jsonl"
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", head.wait().dashboard,
           "--working-dir", ".", "--runtime-env", "deploy/ray/runtime_env.yaml", "--",
           "python", "deploy/ray/batch_job.py", "--input", "in.jsonl", "--output", str(out),
           "--target", str(models / "t"), "--drafter", str(models / "d"), "--max-tokens", str(MAX_TOKENS),
           "--temperature", "0", "--engine-arg", "num_kv_blocks=2000", "--replicas", "2", "--batch-size", "16"]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0 and "succeeded" in log, log[-4000:]
    assert "runtime_resources" in log.split("batch_job: specray from", 1)[1].splitlines()[0], "py_modules unused"
    assert_exactly_once(read_jsonl(out), rows, want)
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["status"] == "complete" and summary["rows_generated"] == len(rows)
