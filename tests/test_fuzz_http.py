"""bench/fuzz_http.py against a real ``specray serve`` (tiny random
checkpoints, CPU, loopback): a bounded number of cases drawn from the
app's OpenAPI schema plus every hand case. Each must end in a 4xx with
OpenAI's error JSON or a proper 200, none in a 5xx or a hang, and the
server must serve afterwards with nothing left in flight."""

import os
import sys
import time
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from factories import add_tokenizer, make_drafter, make_target  # noqa: E402

pytest.importorskip("ray")
pytest.importorskip("schemathesis")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import fuzz_http  # noqa: E402
import serving  # noqa: E402

API_KEY = "fuzz-key"
MAX_MODEL_LEN = 256

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    hf = make_target(root / "t", seed=3)
    add_tokenizer(root / "t", hf.config.vocab_size)
    make_drafter(root / "d", hf.config, seed=13, block_size=8)
    srv = serving.LocalServer(
        ["--target", str(root / "t"), "--drafter", str(root / "d"), "--model-name", "tiny",
         "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "160", "--kv-block-size", "8",
         "--max-num-seqs", "8", "--max-queued", "8"],
        str(root / "serve.log"), api_key=API_KEY)
    try:
        yield srv
    finally:
        srv.stop()


def test_fuzzed_and_hostile_requests_get_4xx_or_a_completion(server):
    t = time.monotonic()
    report = fuzz_http.fuzz(server.url, API_KEY, cases=48, seed=20261203, concurrency=4, timeout=60, budget_s=120)
    s = report["summary"]
    failures = report["generated"]["failures"] + report["hand"]["failures"]
    assert s["failures"] == 0 and s["5xx"] == 0, failures[:5]
    assert s["server_alive"], report["alive_after"]
    assert report["generated"]["cases"] >= 40 and report["hand"]["passed"] == report["hand"]["cases"] >= 400
    assert s["valid_200"] >= 3 and s["rejected_4xx"] >= 60, s
    # Refused by their size alone, in well under a second each.
    assert set(s["refusal_seconds"]) >= {"prompt_2mb", "chat_2mb", "body_5mb_prompt", "messages_1e5"}
    assert max(s["refusal_seconds"].values()) < 1.0, s["refusal_seconds"]
    codes = {r["name"]: (r["status"], r["code"]) for r in report["hand"]["results"] if "status" in r}
    assert codes["prompt_2mb"] == codes["chat_2mb"] == (400, "context_length_exceeded")
    assert codes["max_tokens_1e12"] == (400, "invalid_value")
    assert codes["stop_10000"] == codes["messages_1e5"] == (400, "array_above_max_length")
    assert codes["content_type_text_plain"] == (415, "unsupported_media_type")
    assert codes["api_key_wrong"] == (401, "invalid_api_key")
    assert codes["prompt_ids_bools"][0] == 400
    # Nothing left behind: every slot and KV block free again.
    st = serving.engine_stats()
    deadline = time.monotonic() + 30
    while st["in_flight"] or any(free != cap for free, cap in st["pools"].values()):
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
        st = serving.engine_stats()
    assert time.monotonic() - t < 240
