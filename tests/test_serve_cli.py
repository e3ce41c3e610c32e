"""`specray serve` as a user runs it: it starts its own loopback Ray, serves,
sends the sample chat request to itself, prints the answer and acceptance
stats, keeps serving, and shuts down cleanly on Ctrl-C (SIGINT)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from factories import add_tokenizer, free_port, make_drafter, make_target

pytest.importorskip("ray")



def test_specray_serve_sample_request_and_ctrl_c(tmp_path):
    hf = make_target(tmp_path / "t", seed=2)
    add_tokenizer(tmp_path / "t", hf.config.vocab_size)
    make_drafter(tmp_path / "d", hf.config, seed=12, block_size=8)
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0",
               SPECRAY_API_KEY="cli-key")
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "specray.cli", "serve", "--target", str(tmp_path / "t"), "--drafter",
           str(tmp_path / "d"), "--port", str(port), "--grpc-port", str(grpc_port), "--num-kv-blocks", "64",
           "--kv-block-size", "8", "--max-model-len", "256", "--max-num-seqs", "4", "--max-queued", "4",
           "--model-name", "tiny", "--sample-request", "--sample-max-tokens", "12"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "press Ctrl-C" in line:
                break
        out = "".join(lines)
        assert "press Ctrl-C" in out, out[-4000:]
        assert f"http://127.0.0.1:{port}/v1" in out
        assert "sample A:" in out and "mean acceptance length" in out and "/metrics" in out
        assert out.count("sample Q:") == 2 and "why the sky is blue" in out and " tok/s " in out
        assert "INFO" not in out and "(ServeController" not in out  # Ray's own logs stay in its files
        assert "HTTP served by the replica itself (direct ingress)" in out  # the default, one replica
        # still serving, with the key from SPECRAY_API_KEY
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                     headers={"Authorization": "Bearer cli-key"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            card = json.loads(resp.read())["data"][0]
        assert card["id"] == "tiny" and card["specray"]["http_ingress"] == "direct"
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest[-4000:]
        assert "shutting down" in rest
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    with pytest.raises(urllib.error.URLError) as gone:  # the server is gone: refused, not an HTTP error
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
    assert not isinstance(gone.value, urllib.error.HTTPError), gone.value


def test_direct_ingress_serves_on_the_port_from_the_replica(tmp_path):
    """Direct ingress (the default with one replica): the replica's own HTTP
    server answers on --port (streamed and plain requests, a client gone
    mid-stream), not Serve's proxy, which moves to a port of its own; a
    replica killed is replaced on the same port."""
    from specray.serve_process import ServerProcess

    hf = make_target(tmp_path / "t", seed=2)
    add_tokenizer(tmp_path / "t", hf.config.vocab_size)
    make_drafter(tmp_path / "d", hf.config, seed=12, block_size=8)
    server = ServerProcess(["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"),
                            "--num-kv-blocks", "64", "--kv-block-size", "8", "--max-model-len", "256",
                            "--max-num-seqs", "4", "--max-queued", "4", "--model-name", "tiny"])
    try:
        card = server.start(300)
        assert card["id"] == "tiny" and card["specray"]["http_ingress"] == "direct"
        deadline = time.monotonic() + 120  # the replica answers before `serve.run` returns and the line is printed
        while "direct ingress" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "HTTP served by the replica itself (direct ingress)" in server.log_tail()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "temperature": 0, "stream": True}

        def post(b):
            return urllib.request.urlopen(urllib.request.Request(
                f"{server.url}/v1/chat/completions", data=json.dumps(b).encode(),
                headers={"Content-Type": "application/json"}), timeout=60)

        with post(body) as resp:  # a client that leaves after the first chunk
            assert resp.readline().startswith(b"data: ")
        with post(body) as resp:
            events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        with post(dict(body, stream=False)) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 8
        psutil = pytest.importorskip("psutil")
        replica = listener(psutil, server.port)
        assert "ServeReplica" in " ".join(psutil.Process(replica).cmdline())
        # A replica lost: the one Serve starts in its place serves the same port.
        os.kill(replica, signal.SIGKILL)
        # Well inside the 150 s Serve would hold the port back (its quarantine, which direct ingress turns off).
        deadline = time.monotonic() + 100
        while (listener(psutil, server.port) in (None, replica)) and time.monotonic() < deadline:
            time.sleep(1)
        assert listener(psutil, server.port) not in (None, replica), server.log_tail()
        with post(dict(body, stream=False)) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 8
    finally:
        server.close()


def listener(psutil, port: int) -> int | None:
    """The pid listening on ``port`` on this machine."""
    pids = [c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == psutil.CONN_LISTEN]
    return pids[0] if pids else None


def test_no_direct_ingress_serves_through_the_proxy(tmp_path):
    """--no-direct-ingress: Serve's proxy serves --port."""
    from specray.serve_process import ServerProcess

    hf = make_target(tmp_path / "t", seed=2)
    add_tokenizer(tmp_path / "t", hf.config.vocab_size)
    server = ServerProcess(["--target", str(tmp_path / "t"), "--no-drafter", "--no-direct-ingress",
                            "--num-kv-blocks", "64", "--kv-block-size", "8", "--max-model-len", "256",
                            "--max-num-seqs", "4", "--max-queued", "4", "--model-name", "tiny"])
    try:
        card = server.start(300)
        assert card["id"] == "tiny" and card["specray"]["http_ingress"] == "proxy"
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
        with urllib.request.urlopen(urllib.request.Request(
                f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"}), timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 120  # the line comes once `serve.run` returns
        while "HTTP served through Serve's proxy" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "HTTP served through Serve's proxy" in server.log_tail()
        assert "direct ingress" not in server.log_tail()
        psutil = pytest.importorskip("psutil")
        assert "ServeReplica" not in " ".join(psutil.Process(listener(psutil, server.port)).cmdline())
    finally:
        server.close()


def test_direct_ingress_refuses_several_replicas():
    out = subprocess.run([sys.executable, "-m", "specray.cli", "serve", "--direct-ingress", "--num-replicas", "2",
                          "--target", "/nonexistent"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    assert out.returncode == 2 and "--direct-ingress serves one replica" in out.stderr, out.stderr


@pytest.mark.parametrize("argv, env, direct, said", [
    ([], {}, True, None),
    (["--direct-ingress"], {}, True, None),
    (["--no-direct-ingress"], {}, False, None),
    (["--num-replicas", "2"], {}, False, "got --num-replicas 2"),
    ([], {"RAY_ADDRESS": "127.0.0.1:6379"}, False, "RAY_ADDRESS is set"),
    (["--no-direct-ingress", "--num-replicas", "2"], {}, False, None),
])
def test_direct_ingress_default(argv, env, direct, said, monkeypatch, capsys):
    """Unset: direct ingress where it can run, else Serve's proxy with a note
    saying why; --no-direct-ingress: the proxy, no note."""
    from specray.serve.cli import build_parser, choose_direct_ingress

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert choose_direct_ingress(build_parser().parse_args(argv)) == (direct, None)
    out = capsys.readouterr().out
    if said:
        assert "HTTP through Serve's proxy, not direct ingress" in out and said in out, out
    else:
        assert out == ""


def test_the_proxy_port_is_outside_the_ephemeral_range(monkeypatch):
    """With direct ingress Serve's proxy gets a port chosen before Ray
    starts: one from the kernel's ephemeral range could be taken by an
    outgoing connection of Ray's first (CI saw "Failed to bind to address
    127.0.0.1:52365")."""
    from specray.serve.cli import direct_ingress_environment

    for name in ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", "RAY_SERVE_PORT_QUARANTINE_S"):
        monkeypatch.delenv(name, raising=False)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    for _ in range(20):
        port = free_port()
        proxy = direct_ingress_environment("127.0.0.1", port)
        assert proxy != port and not low <= proxy <= high
        assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == str(port)
