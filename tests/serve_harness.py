"""A deployed specray Serve application for the serving tests (test_serve.py,
test_serve_traffic.py): deploy/ray/serve.yaml with its model paths, ports
and sizes pointed at tiny random checkpoints, deployed by `serve run` (a
subprocess joined to a loopback Ray cluster through RAY_ADDRESS), and the
clients the tests use: raw HTTP over sockets, the openai client, gRPC stubs."""

import asyncio
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

# Ray reads this when it is imported: set it before (see also deploy()).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from factories import add_tokenizer, free_port, make_drafter, make_target  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
API_KEY = "test-key-123"
APP = "specray"
MODEL = "tiny-qwen3"
MAX_NUM_SEQS = 8
MAX_QUEUED = 8
LIMIT = MAX_NUM_SEQS + MAX_QUEUED  # generation requests a replica admits at once
BODY_LIMIT, BODY_TIMEOUT = 1 << 20, 3.0
PROMPTS = [
    "The capital of France is", "Hello world, this is", "Speculative decoding drafts", "a test of the",
    "Paris is", "The tokenizer", "blocks of tokens and", "verifies them at once.",
    "Hello", "France", "world, this is a test", "The capital", "drafts a block", "of the tokenizer",
    "at once", "is Paris.",
]


class Server:
    def __init__(self, root: Path, http_port: int, grpc_port: int):
        self.root, self.http_port, self.grpc_port = root, http_port, grpc_port
        self.base = f"http://127.0.0.1:{http_port}"

    # ---- raw HTTP (stdlib), for what the openai client hides
    def request(self, method: str, path: str, body=None, key: str | None = API_KEY, timeout: float = 120):
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = raw.decode()
        return resp.status, resp.headers, payload  # headers: case-insensitive

    def client(self, key: str = API_KEY, async_: bool = False):
        import openai

        cls = openai.AsyncOpenAI if async_ else openai.OpenAI
        return cls(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=120)

    def stats(self) -> dict:
        from ray import serve

        return serve.get_app_handle(APP).engine_stats.remote().result()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Until no request is in flight and every KV block is free."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            idle = (st["in_flight"] == 0 and st["num_unfinished"] == 0 and st["running"] == 0
                    and all(free == cap for free, cap in st["pools"].values()))
            if idle or time.monotonic() > deadline:
                return st
            time.sleep(0.1)


async def open_stream(port: int, body: dict, key: str = API_KEY, path: str = "/v1/completions",
                      first_event: bool = True):
    """A streaming request on a raw socket; returns once the first SSE event
    arrived (the request is generating), or once sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data)
    await writer.drain()
    if not first_event:
        return reader, writer
    status_line = await asyncio.wait_for(reader.readline(), 120)
    assert b" 200 " in status_line, status_line
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    while True:
        line = await asyncio.wait_for(reader.readline(), 120)
        if b"data: " in line:
            return reader, writer


def grpc_stub(server):
    import grpc

    from specray.serve import specray_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    return channel, pb_grpc.SpecRayStub(channel)


def run_app(tmp_path_factory, name: str, args: dict, attempts: int = 1, timeout: float = 180):
    """deploy/ray/serve.yaml with ``args`` over its application's, its models
    tiny random checkpoints, run by `serve run` on a fresh loopback Ray
    cluster: (checkpoint root, HTTP port, gRPC port). The caller waits for
    it and shuts Serve and Ray down."""
    import ray
    from ray import serve

    from specray.serve.loopback import prepare_local_ray

    # Loopback only: Ray (even if another test module imported it before the
    # variable was set), the engine's gloo group, and Serve's gRPC proxy
    # (which Serve would bind to [::]); the actors inherit this environment.
    prepare_local_ray("127.0.0.1")
    root = tmp_path_factory.mktemp(name)
    hf = make_target(root / MODEL, seed=2)
    add_tokenizer(root / MODEL, hf.config.vocab_size)
    make_drafter(root / "drafter", hf.config, seed=12, block_size=8)
    # address="local": a fresh cluster even if `ray start` left an address file.
    ray.init(address="local", num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False,
             logging_level="ERROR")
    # A Serve client cached by an earlier module names that cluster's
    # controller, which is gone with it: serve.status() would call a dead actor.
    from ray.serve.context import _set_global_client

    _set_global_client(None)
    http_port, grpc_port = free_port(), free_port()
    cfg = yaml.safe_load((REPO / "deploy/ray/serve.yaml").read_text())
    cfg["http_options"].update(host="127.0.0.1", port=http_port)
    cfg["grpc_options"]["port"] = grpc_port
    cfg["applications"][0]["args"].update(target=str(root / MODEL), drafter=str(root / "drafter"), device="cpu",
                                          **args)
    (root / "serve.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    for _ in range(attempts):  # on a busy 2-core machine Serve's proxy may miss its 5 s readiness check
        proc = subprocess.run([sys.executable, "-m", "ray.serve.scripts", "run", str(root / "serve.yaml"),
                               "--non-blocking"], env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            break
        serve.shutdown()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, http_port, grpc_port


def deploy(tmp_path_factory):
    """The application on a fresh loopback Ray cluster: yields a Server,
    then shuts Serve and Ray down (a module's fixture)."""
    import ray
    from ray import serve

    root, http_port, grpc_port = run_app(tmp_path_factory, "serve", dict(
        max_model_len=256, num_kv_blocks=160, kv_block_size=8, max_num_seqs=MAX_NUM_SEQS,
        max_queued_requests=MAX_QUEUED, api_key=API_KEY, max_request_bytes=BODY_LIMIT,
        request_body_timeout_s=BODY_TIMEOUT))
    srv = Server(root, http_port, grpc_port)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if srv.request("GET", "/health", key=None, timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the app did not come up"
            time.sleep(0.5)
        yield srv
    finally:
        serve.shutdown()
        ray.shutdown()


def engine_calls(stats: dict, kind: str) -> int:
    """Rank 0's ``submit`` or ``abort`` calls: Ray calls and the replica's engine channel's frames."""
    return stats["calls"][kind] + ((stats.get("channel") or {}).get(kind) or 0)
