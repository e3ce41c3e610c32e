"""A ``specray serve`` on loopback for the serving benchmarks (soak, fuzz):
a local Ray cluster started by this process, the server joined to it as a
subprocess (so this process can reach the app through a Serve handle), and
the processes that hold the app (the replica and the engine actors) for
their memory."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

APP = "specray"


def free_port() -> int:
    """A free loopback port above Ray's worker range (10002-19999) and below
    the kernel's ephemeral ports, where Ray's own processes take theirs."""
    for _ in range(500):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def start_ray(num_cpus: int = 8) -> str:
    """A fresh local Ray on loopback; returns its GCS address."""
    from specray.serve.loopback import prepare_local_ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    prepare_local_ray("127.0.0.1")
    import ray

    ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False,
             namespace="serve", logging_level="ERROR")
    return ray.get_runtime_context().gcs_address


def wait_healthy(url: str, timeout: float = 600.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"specray serve exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy in {timeout:.0f} s")
        time.sleep(1.0)


class LocalServer:
    """``specray serve ARGS`` joined to a Ray cluster this process starts;
    stopped (server, then Ray) by :meth:`stop`."""

    def __init__(self, serve_args: list[str], log_path: str, api_key: str | None = None, num_cpus: int = 8):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.serve_args = list(serve_args)
        self.command = ["specray", "serve", "--port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                        "--app-name", APP, *self.serve_args]
        self.gcs = start_ray(num_cpus)
        env = dict(os.environ, RAY_ADDRESS=self.gcs)
        if api_key:
            env["SPECRAY_API_KEY"] = api_key
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "specray.cli", *self.command[1:]], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, proc=self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        import ray

        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)  # the CLI deletes its app on the way out
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        finally:
            self.log.close()
            ray.shutdown()


def connect(address: str | None) -> None:
    """Join a running cluster (``--url`` mode) for the Serve handle."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace="serve", logging_level="ERROR")


def engine_stats(app: str = APP, timeout: float = 60.0) -> dict:
    from ray import serve

    return serve.get_app_handle(app).engine_stats.remote().result(timeout_s=timeout)


def app_processes(app: str = APP) -> dict[str, int]:
    """Name -> pid of the processes that hold the app on this node: its
    replicas and the engine actors they own (every live actor not Serve's
    own controller or proxy)."""
    from ray._private import state  # the GCS actor table: no dashboard needed, unlike ray.util.state

    out = {}
    for a in state.actors().values():
        name, pid = a.get("ActorClassName", ""), a.get("Pid")
        if a.get("State") != "ALIVE" or not pid or name in ("ServeController", "ProxyActor"):
            continue
        if name.startswith("ServeReplica:") and not name.startswith(f"ServeReplica:{app}:"):
            continue
        key, i = name, 1
        while key in out:
            i += 1
            key = f"{name}#{i}"
        out[key] = pid
    return out


def rss_mb(pids: dict[str, int]) -> dict[str, float | None]:
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            out[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[name] = None
    return out
