"""Schema fuzzing and hostile hand cases against the HTTP API of a
``specray serve`` (loopback).

Generated cases: schemathesis draws bodies for ``/v1/completions`` and
``/v1/chat/completions`` from the OpenAPI document the server publishes
(``/openapi.json``), schema-valid ("positive") and schema-violating
("negative") in equal parts. Hand cases: the bodies that hurt servers
(megabyte prompts, invalid UTF-8, NaN and infinities, 10,000 stop strings,
deep nesting, absurd ``max_tokens`` and ``n``, unknown roles, wrong content
types and keys).

Every case must end in a 4xx carrying OpenAI's error JSON
(``{"error": {"message", "type", "param", "code"}}``) or in a 200 with a
proper completion (a stream: chunks of JSON, every choice's finish reason,
``[DONE]``, no error event); never a 5xx, never a hang (``--timeout``).
Afterwards the server must answer ``/health`` and a real request.

    python bench/fuzz_http.py --out results/cpu_fuzz_http.json          # starts its own server
    python bench/fuzz_http.py --url http://127.0.0.1:8000 --api-key KEY  # one already running

A server it starts serves the embedded pair on the CPU with a short
context and a small batch (``--max-model-len 128 --max-num-seqs 8
--max-queued 8``: at most 16 choices of at most 127 tokens), so that the
costliest valid request finishes well inside ``--timeout`` and a hang stands
out from a long generation.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import http.client
import json
import os
import platform
import secrets
import sys
import tempfile
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ERROR_KEYS = {"message", "type", "param", "code"}
OPERATIONS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# ------------------------------------------------------------------ HTTP
class Target:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        u = urllib.parse.urlsplit(url)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit(f"fuzz_http: loopback servers only, not {u.hostname}")
        self.host, self.port, self.api_key, self.timeout = u.hostname, u.port or 80, api_key, timeout

    def send(self, method: str, path: str, body: bytes | None, headers: dict | None = None,
             auth: bool = True) -> tuple[int, dict, bytes, float]:
        """(status, headers, body, seconds); reads a stream to its end
        within ``timeout`` in all."""
        h = {} if headers is None else dict(headers)
        if auth and self.api_key and "Authorization" not in h:
            h["Authorization"] = f"Bearer {self.api_key}"
        t = time.monotonic()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=body, headers=h)
            resp = conn.getresponse()
            parts = []
            while chunk := resp.read1(1 << 16):
                parts.append(chunk)
                if time.monotonic() - t > self.timeout:
                    raise TimeoutError(f"response still streaming after {self.timeout:.0f} s")
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, b"".join(parts), time.monotonic() - t
        finally:
            conn.close()

    def post_json(self, path: str, obj, **kw):
        return self.send("POST", path, json.dumps(obj).encode(), {"Content-Type": "application/json"}, **kw)


# ------------------------------------------------------------ verdicts
def error_shape_ok(body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(err, dict) and set(err) == ERROR_KEYS and isinstance(err["message"], str)
            and err["message"] != "" and isinstance(err["type"], str))


def completion_ok(body: bytes, headers: dict, n: int) -> str | None:
    """None when a 200 carries a proper completion of ``n`` choices, else why not."""
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in body.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "stream does not end with [DONE]"
        finished = set()
        for e in events[:-1]:
            try:
                chunk = json.loads(e)
            except ValueError:
                return f"stream event is not JSON: {e[:80]}"
            if "error" in chunk:
                return f"error event in a 200 stream: {e[:200]}"
            for c in chunk.get("choices", []):
                if c.get("finish_reason") in ("stop", "length"):
                    finished.add(c.get("index"))
        return None if finished == set(range(n)) else f"choices finished {sorted(finished)} of {n}"
    try:
        out = json.loads(body)
    except ValueError:
        return "200 body is not JSON"
    choices = out.get("choices") if isinstance(out, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        return f"200 without {n} choices"
    if any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return "a choice without a finish reason"
    return None


def verdict(status: int, headers: dict, body: bytes, n: int = 1) -> tuple[str, str | None]:
    """(outcome, failure or None): outcome is ok_200, rejected_4xx or a failure kind."""
    if status == 200:
        why = completion_ok(body, headers, n)
        return ("ok_200", None) if why is None else ("bad_200", why)
    if 400 <= status < 500:
        return ("rejected_4xx", None) if error_shape_ok(body) else ("bad_error_shape", body[:200].decode("utf-8",
                                                                                                         "replace"))
    return ("5xx" if status >= 500 else "other_status", f"{status}: {body[:300].decode('utf-8', 'replace')}")


def _choices(body) -> int:
    n = body.get("n") if isinstance(body, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


# ------------------------------------------------------ generated cases
def generate_cases(openapi: dict, per_mode: int, seed: int, model: str) -> list[dict]:
    """``per_mode`` schemathesis cases for each operation and mode."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi)
    cases = []
    for name, path in OPERATIONS.items():
        op = schema[path]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            drawn = []

            @hypothesis.seed(seed)
            @settings(max_examples=per_mode, database=None, deadline=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def draw(case):
                drawn.append(case)

            draw()
            for i, case in enumerate(drawn):
                body = case.body
                if isinstance(body, bytes):
                    raw = body
                elif type(body).__name__ == "NotSet":
                    raw = None
                else:
                    # Half the valid bodies name the served model (the schema cannot).
                    if mode == GenerationMode.POSITIVE and isinstance(body, dict) and i % 2 == 0:
                        body = dict(body, model=model)
                    raw = json.dumps(body).encode()
                cases.append({"operation": name, "mode": mode.value, "path": path, "raw": raw, "i": i,
                              "media_type": case.media_type or "application/json", "n": _choices(body)})
    # Round robin over the four groups: a budget that runs out cuts all alike.
    return sorted(cases, key=lambda c: c["i"])


def run_generated(target: Target, cases: list[dict], concurrency: int, budget_s: float) -> dict:
    counts = collections.Counter()
    by_group = collections.defaultdict(collections.Counter)
    statuses = collections.Counter()
    failures, latencies = [], []
    codes = collections.Counter()  # why valid-looking and invalid bodies were refused
    deadline = time.monotonic() + budget_s

    def one(c):
        if time.monotonic() > deadline:
            return c, None
        try:
            return c, target.send("POST", c["path"], c["raw"], {"Content-Type": c["media_type"]})
        except Exception as e:  # a hang or a dropped connection
            return c, e

    with cf.ThreadPoolExecutor(concurrency) as pool:
        for c, res in pool.map(one, cases):
            if res is None:
                continue
            group = f"{c['operation']}/{c['mode']}"
            if isinstance(res, Exception):
                outcome, why, status = ("timeout" if isinstance(res, TimeoutError) else "connection_error",
                                        f"{type(res).__name__}: {res}", None)
            else:
                status, headers, body, secs = res
                latencies.append(secs)
                outcome, why = verdict(status, headers, body, c["n"])
                if outcome == "rejected_4xx":
                    err = json.loads(body)["error"]
                    codes[f"{c['mode']}: {status} {err['code']} ({err['param']})"] += 1
                if outcome == "ok_200" and c["mode"] == "negative":
                    outcome = "negative_accepted"  # a schema-violating body the server took
                    why = "a body outside the published schema was accepted"
            statuses[str(status)] += 1
            counts[outcome] += 1
            by_group[group][outcome] += 1
            if why is not None:
                failures.append({"group": group, "outcome": outcome, "status": status, "why": why[:400],
                                 "body": (c["raw"] or b"")[:400].decode("utf-8", "replace")})
    latencies.sort()
    return {"cases": sum(counts.values()), "by_outcome": dict(counts), "by_status": dict(sorted(statuses.items())),
            "by_group": {k: dict(v) for k, v in sorted(by_group.items())},
            "max_seconds": round(latencies[-1], 3) if latencies else None,
            "rejections": dict(codes.most_common(40)), "failures": failures}


# ------------------------------------------------------------ hand cases
def hand_cases(model: str, max_model_len: int) -> list[dict]:
    """(name, expected status class, request) for each hostile input."""
    C, CH = OPERATIONS["completions"], OPERATIONS["chat"]
    msg = [{"role": "user", "content": "hi"}]
    J = lambda o: json.dumps(o).encode()  # noqa: E731
    deep = lambda n: b"[" * n + b"]" * n  # noqa: E731
    cases = [
        ("valid_completion", 200, C, J({"model": model, "prompt": "Hello", "max_tokens": 4})),
        ("valid_chat_stream", 200, CH, J({"model": model, "messages": msg, "max_tokens": 4, "stream": True,
                                          "stream_options": {"include_usage": True}})),
        ("valid_completion_n2_stream", 200, C, J({"prompt": "Hello", "max_tokens": 4, "n": 2, "stream": True})),
        ("prompt_2mb", 400, C, J({"prompt": "a " * (1 << 20), "max_tokens": 4})),
        ("prompt_2mb_multibyte", 400, C, J({"prompt": "\u00e9" * (1 << 20), "max_tokens": 4})),
        ("chat_2mb", 400, CH, J({"messages": [{"role": "user", "content": "a " * (1 << 20)}], "max_tokens": 4})),
        ("body_5mb_prompt", 400, C, J({"prompt": "x" * (5 << 20), "max_tokens": 4})),
        ("body_5mb_unknown_field", 400, C, J({"prompt": "x", "pad": "y" * (5 << 20)})),
        ("prompt_ids_over_context", 400, C, J({"prompt": [5] * max_model_len, "max_tokens": 4})),
        ("prompt_ids_1e6", 400, C, J({"prompt": [5] * 10**6, "max_tokens": 4})),
        ("prompt_list_of_1e5_strings", 400, C, J({"prompt": ["a"] * 10**5})),
        ("messages_1e5", 400, CH, J({"messages": [{"role": "user", "content": ""}] * 10**5})),
        ("content_parts_1e5", 400, CH, J({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]
                                                        * 10**5}]})),
        ("invalid_utf8", 400, C, b'{"prompt": "hi \xff\xfe", "max_tokens": 2}'),
        ("invalid_utf8_key", 400, C, b'{"prom\xc3pt": "hi"}'),
        ("lone_surrogate", 400, C, b'{"prompt": "hi \\ud800", "max_tokens": 2}'),
        ("utf16_body", 400, C, '{"prompt": "hi", "max_tokens": "x"}'.encode("utf-16")),
        ("nan_temperature", 400, C, b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}'),
        ("inf_top_p", 400, C, b'{"prompt": "hi", "max_tokens": 2, "top_p": Infinity}'),
        ("neg_inf_presence_penalty", 400, C, b'{"prompt": "hi", "max_tokens": 2, "presence_penalty": -Infinity}'),
        ("1e999_temperature", 400, CH, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'),
        ("nan_max_tokens", 400, C, b'{"prompt": "hi", "max_tokens": NaN}'),
        ("nan_seed", 400, C, b'{"prompt": "hi", "max_tokens": 2, "seed": NaN}'),
        ("nan_in_prompt_ids", 400, C, b'{"prompt": [5, NaN], "max_tokens": 2}'),
        ("stop_10000", 400, C, J({"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(10_000)]})),
        ("stop_string_100k", 400, C, J({"prompt": "hi", "max_tokens": 2, "stop": "x" * 100_000})),
        ("stop_token_ids_1e5", 400, C, J({"prompt": "hi", "max_tokens": 2, "stop_token_ids": list(range(10**5))})),
        ("nested_json_5000", 400, C, b'{"prompt": ' + deep(5000) + b"}"),
        ("nested_json_100000", 400, CH, b'{"messages": ' + deep(100_000) + b"}"),
        ("nested_metadata_900", 400, C, b'{"prompt": "hi", "metadata": {"a": ' + deep(900) + b"}}"),
        ("nested_content_part_900", 400, CH, b'{"messages": [{"role": "user", "content": [{"type": "text", '
                                             b'"text": "x", "z": ' + deep(900) + b"}]}]}"),
        ("nested_stop_900", 400, C, b'{"prompt": "hi", "stop": ' + deep(900) + b"}"),
        ("max_tokens_1e12", 400, C, J({"prompt": "hi", "max_tokens": 10**12})),
        ("max_completion_tokens_1e12", 400, CH, J({"messages": msg, "max_completion_tokens": 10**12})),
        ("max_tokens_1e400", 400, CH, J({"messages": msg, "max_tokens": 10**400})),
        ("max_tokens_context", 400, C, J({"prompt": "hi", "max_tokens": max_model_len})),
        ("max_tokens_true", 400, C, J({"prompt": "hi", "max_tokens": True})),
        ("prompt_ids_bools", 400, C, J({"prompt": [True, 5], "max_tokens": 2})),
        ("n_1e6", 400, C, J({"prompt": "hi", "max_tokens": 2, "n": 10**6})),
        ("n_0", 400, CH, J({"messages": msg, "max_tokens": 2, "n": 0})),
        ("n_negative", 400, C, J({"prompt": "hi", "max_tokens": 2, "n": -1})),
        ("seed_1e30", 400, C, J({"prompt": "hi", "max_tokens": 2, "seed": 10**30})),
        ("logprobs_1e9", 400, C, J({"prompt": "hi", "max_tokens": 2, "logprobs": 10**9})),
        ("metadata_1000_pairs", 400, C, J({"prompt": "hi", "metadata": {str(i): "v" for i in range(1000)}})),
        ("role_tool", 400, CH, J({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]})),
        ("role_function", 400, CH, J({"messages": [{"role": "function", "content": "x", "name": "f"}]})),
        ("role_unknown", 400, CH, J({"messages": [{"role": "wizard", "content": "x"}]})),
        ("role_empty", 400, CH, J({"messages": [{"role": "", "content": "x"}]})),
        ("role_missing", 400, CH, J({"messages": [{"content": "x"}]})),
        ("role_not_string", 400, CH, J({"messages": [{"role": 5, "content": "x"}]})),
        ("messages_empty", 400, CH, J({"messages": []})),
        ("content_part_image", 400, CH, J({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]})),
        ("unknown_model", 404, C, J({"model": "not-" + model, "prompt": "hi"})),
        ("empty_body", 400, C, b""),
        ("body_null", 400, C, b"null"),
        ("body_list", 400, CH, b"[]"),
        ("body_string", 400, C, b'"prompt"'),
        ("body_number", 400, CH, b"123"),
        ("body_garbage", 400, C, b"\x00\x01\x02garbage"),
        ("trailing_garbage", 400, C, b'{"prompt": "hi"} {"prompt": "again"}'),
        ("duplicate_keys_last_invalid", 400, C, b'{"prompt": "hi", "max_tokens": 2, "max_tokens": -1}'),
    ]
    out = [{"name": n, "expect": e, "method": "POST", "path": p, "raw": r, "headers": {"Content-Type":
                                                                                      "application/json"}}
           for n, e, p, r in cases]
    ok_body = J({"prompt": "hi", "max_tokens": 2})
    for name, ctype in (("content_type_text_plain", "text/plain"),
                        ("content_type_form", "application/x-www-form-urlencoded"),
                        ("content_type_multipart", "multipart/form-data; boundary=x"),
                        ("content_type_xml", "application/xml")):
        out.append({"name": name, "expect": 415, "method": "POST", "path": C, "raw": ok_body,
                    "headers": {"Content-Type": ctype}})
    for name, auth in (("api_key_wrong", "Bearer not-the-key"), ("api_key_basic_scheme", "Basic dXNlcjpwYXNz"),
                       ("api_key_empty", "Bearer "), ("api_key_missing", None)):
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = auth
        out.append({"name": name, "expect": 401, "method": "POST", "path": CH, "raw": J({"messages": msg}),
                    "headers": headers, "auth": False})
    # Nesting at every depth up to the parser's limit, which depends on how
    # deep in the stack the server parses: one depth overflowed the stack
    # when the error message showed the value (a 500).
    for d in range(800, 1001):
        for field, raw in (("stop", b'{"prompt": "hi", "stop": ' + b'{"a":' * d + b"1" + b"}" * d + b"}"),
                           ("metadata", b'{"prompt": "hi", "metadata": {"a": ' + deep(d) + b"}}")):
            out.append({"name": f"nested_{field}_{d}", "group": f"nested_{field}_800_to_1000", "expect": 400,
                        "method": "POST", "path": C, "raw": raw, "headers": {"Content-Type": "application/json"}})
    out.append({"name": "get_on_post_route", "expect": 405, "method": "GET", "path": C, "raw": None, "headers": {}})
    out.append({"name": "unknown_route", "expect": 404, "method": "POST", "path": "/v1/embeddings", "raw": ok_body,
                "headers": {"Content-Type": "application/json"}})
    return out


def run_hand(target: Target, cases: list[dict], needs_key: bool) -> dict:
    results, failures = [], []
    for c in cases:
        if c["expect"] == 401 and not needs_key:
            continue  # the server takes no key: nothing to refuse
        try:
            status, headers, body, secs = target.send(c["method"], c["path"], c["raw"], c["headers"],
                                                      auth=c.get("auth", True))
        except Exception as e:
            results.append({"name": c["name"], "status": None, "ok": False})
            failures.append({"name": c["name"], "why": f"{type(e).__name__}: {e}"})
            continue
        outcome, why = verdict(status, headers, body, 2 if "n2" in c["name"] else 1)
        ok = why is None and (status == c["expect"] if c["expect"] != 400 else 400 <= status < 500)
        code = None
        if outcome == "rejected_4xx":
            code = json.loads(body)["error"]["code"]
        results.append({"name": c["name"], "status": status, "code": code, "seconds": round(secs, 4),
                        "bytes_sent": len(c["raw"] or b""), "ok": ok, "group": c.get("group")})
        if not ok:
            failures.append({"name": c["name"], "status": status, "expected": c["expect"],
                             "why": why or body[:300].decode("utf-8", "replace")})
    statuses = collections.Counter(str(r["status"]) for r in results)
    shown, groups = [], {}
    for r in results:  # a sweep's cases as one line each
        g = r.pop("group")
        if g is None:
            shown.append(r)
            continue
        if g not in groups:
            groups[g] = {"name": g, "cases": 0, "by_status": collections.Counter(), "max_seconds": 0.0, "ok": True}
            shown.append(groups[g])
        groups[g]["cases"] += 1
        groups[g]["by_status"][str(r["status"])] += 1
        groups[g]["max_seconds"] = max(groups[g]["max_seconds"], r.get("seconds") or 0.0)
        groups[g]["ok"] &= r["ok"]
    for g in groups.values():
        g["by_status"] = dict(g["by_status"])
    return {"cases": len(results), "by_status": dict(sorted(statuses.items())),
            "5xx": sum(1 for r in results if (r["status"] or 0) >= 500),
            "passed": sum(r["ok"] for r in results), "results": shown, "failures": failures}


# ---------------------------------------------------------------- driver
def alive(target: Target, model: str) -> dict:
    try:
        health = target.send("GET", "/health", None)[0]
        status, headers, body, secs = target.post_json(OPERATIONS["chat"], {
            "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0})
        ok = health == 200 and verdict(status, headers, body)[0] == "ok_200"
        return {"health": health, "completion": status, "completion_seconds": round(secs, 3), "alive": ok}
    except Exception as e:
        return {"alive": False, "error": f"{type(e).__name__}: {e}"}


def fuzz(url: str, api_key: str | None, cases: int = 400, seed: int = 0, concurrency: int = 4,
         timeout: float = 120.0, budget_s: float = 900.0, hand: bool = True) -> dict:
    """The whole run against a server at ``url``; returns the report."""
    target = Target(url, api_key, timeout)
    status, _, body, _ = target.send("GET", "/openapi.json", None)
    assert status == 200, f"/openapi.json: {status}"
    openapi = json.loads(body)
    status, _, body, _ = target.send("GET", "/v1/models", None)
    assert status == 200, f"/v1/models: {status} {body[:200]!r}"
    card = json.loads(body)["data"][0]
    model, max_model_len = card["id"], card["max_model_len"]
    needs_key = target.send("GET", "/v1/models", None, auth=False)[0] == 401

    t = time.monotonic()
    generated = generate_cases(openapi, cases // 4, seed, model) if cases >= 4 else []
    gen_s = time.monotonic() - t
    report = {"model": model, "max_model_len": max_model_len, "api_key_required": needs_key,
              "generated": run_generated(target, generated, concurrency, budget_s)}
    report["generated"]["generation_seconds"] = round(gen_s, 1)
    if hand:
        report["hand"] = run_hand(target, hand_cases(model, max_model_len), needs_key)
    report["alive_after"] = alive(target, model)
    g, h = report["generated"], report.get("hand", {"cases": 0, "by_status": {}, "failures": [], "results": []})
    statuses = collections.Counter(g["by_status"]) + collections.Counter(h["by_status"])
    hand_ok = sum(1 for r in h["results"] if r.get("status") == 200)
    report["summary"] = {
        "cases": g["cases"] + h["cases"], "by_status": dict(sorted(statuses.items())),
        "5xx": sum(v for k, v in statuses.items() if k.isdigit() and int(k) >= 500),
        "valid_200": g["by_outcome"].get("ok_200", 0) + hand_ok,
        "rejected_4xx": sum(v for k, v in statuses.items() if k.isdigit() and 400 <= int(k) < 500),
        "timeouts": g["by_outcome"].get("timeout", 0), "failures": len(g["failures"]) + len(h["failures"]),
        "server_alive": report["alive_after"].get("alive", False)}
    sized = ("prompt_2mb", "chat_2mb", "body_5mb", "messages_1e5")
    timed = {r["name"]: r["seconds"] for r in h["results"] if r["name"].startswith(sized)}
    report["summary"]["refusal_seconds"] = timed
    return report


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback); default: start one")
    ap.add_argument("--api-key", help="its key (default: env SPECRAY_API_KEY; a started server gets a random one)")
    ap.add_argument("--cases", type=int, default=400,
                    help="generated cases, split over 2 operations x 2 modes (0: hand cases only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take, stream included")
    ap.add_argument("--budget", type=float, default=900.0, help="seconds for the generated cases")
    ap.add_argument("--no-hand", action="store_true", help="generated cases only")
    ap.add_argument("--max-model-len", type=int, default=128, help="of a server this script starts")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="of a server this script starts (and --max-queued)")
    ap.add_argument("--serve-arg", action="append", default=[], help="more `specray serve` arguments")
    ap.add_argument("--out", help="write the report (JSON) here")
    args = ap.parse_args(argv)

    server = None
    api_key = args.api_key or os.environ.get("SPECRAY_API_KEY")
    if args.url is None:
        import serving

        api_key = api_key or secrets.token_hex(8)
        log = os.path.join(tempfile.gettempdir(), f"specray_fuzz_serve_{os.getpid()}.log")
        server = serving.LocalServer(["--max-model-len", str(args.max_model_len), "--max-num-seqs",
                                      str(args.max_num_seqs), "--max-queued", str(args.max_num_seqs),
                                      *args.serve_arg], log, api_key=api_key)
    url = args.url or server.url
    t = time.monotonic()
    try:
        report = fuzz(url, api_key, args.cases, args.seed, args.concurrency, args.timeout, args.budget,
                      not args.no_hand)
    finally:
        if server is not None:
            server.stop()
    report = {"command": "python bench/fuzz_http.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "server": {"url": url, "started_here": server is not None,
                         "serve_command": " ".join(server.command) if server else None},
              "machine": f"{platform.node()} ({os.cpu_count()} cores, shared), Python {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_seconds": round(time.monotonic() - t, 1),
              **report}
    s = report["summary"]
    print(f"fuzz_http: {s['cases']} cases, by status {s['by_status']}, 5xx {s['5xx']}, failures {s['failures']}, "
          f"server alive {s['server_alive']}; refusals (s): {s['refusal_seconds']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    rep = main()
    sys.exit(0 if rep["summary"]["failures"] == 0 and rep["summary"]["server_alive"] else 1)
