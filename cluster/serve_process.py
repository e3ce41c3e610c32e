"""``specray serve`` as a child process that a benchmark starts, waits for
and stops: its own session (so its Ray, which it starts and stops itself,
goes with it), its output in a log file, readiness from ``/health``."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


class ServerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, outside the kernel's ephemeral range and
    Ray's worker ports (10002-19999): Ray takes ports from those as it
    starts, after we chose ours."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise ServerError("no free port in 20000-32000")


def get_json(url: str, timeout: float, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
        return json.loads(resp.read())


class ServerProcess:
    """One ``specray serve`` child on loopback, HTTP only (no gRPC port)."""

    def __init__(self, serve_args: list[str], port: int | None = None, host: str = "127.0.0.1"):
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.cmd = [sys.executable, "-m", "specray.cli", "serve", "--host", host, "--port", str(self.port),
                    "--grpc-port", "0", *serve_args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specray-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float, api_key: str | None = None) -> dict:
        """Start and wait until ``/health`` answers; returns the model card.
        Raises ServerError (with the log's end) if the server exits or is
        not ready in time, after stopping whatever it started."""
        env = dict(os.environ)
        env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"specray serve exited with {self.proc.returncode} while starting:\n"
                                  f"{self.log_tail()}")
            try:
                if get_json(f"{self.url}/health", 5).get("status") == "ok":
                    return get_json(f"{self.url}/v1/models", 10, api_key)["data"][0]
            except (urllib.error.URLError, OSError, ValueError):
                pass  # not listening yet, or Serve still deploying (it answers 503/404 meanwhile)
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"specray serve was not ready within {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 90.0) -> None:
        """Ctrl-C (the server shuts Serve and its Ray down), then wait for
        every process of its session to be gone (Ray's workers, each in a
        process group of its own, hold the GPU's memory until they are);
        SIGKILL what is left of the session past the timeout."""
        if self.proc is None:
            return
        sid = self.proc.pid  # start_new_session: the child leads its own session
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the child itself: a zombie would count as alive
            if not session_pids(sid):
                break
            time.sleep(0.25)
        for pid in session_pids(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None

    def log_tail(self, chars: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def close(self) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(d))
    return pids
