"""The service section's processes and HTTP (``gpu_check_service.py``): ``pagedkv serve`` and
``pagedkv route`` as real processes on loopback, a real ``redis-server`` (from PATH, or the one
``gpu_wheels.sh`` carries in ``wheels/redis/`` with its libraries), and a small HTTP client on
the standard library (the device image may lack httpx)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpu_check_run import WHEELS

START_TIMEOUT_S = 120.0  # a CUDA start: context, Triton compiles, CUDA graph capture (a bound:
# a server not up by then fails its own cases, and the check has a deadline)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One process on ``port``; stdout and stderr go to ``log_path`` (a full pipe blocks)."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict | None = None):
        self.port, self.url, self.log_path = port, f"http://127.0.0.1:{port}", log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})  # fmt: skip

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, path: str = "/health") -> int | None:
        """None once ``path`` answers 200; the exit code if the process ended first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (code := self.proc.poll()) is not None:
                return code
            try:
                if get(f"{self.url}{path}", timeout_s=2.0)[0] == 200:
                    return None
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.url} not ready after {timeout_s:.0f} s: {self.log()[-1500:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def pagedkv(name: str, scratch: Path, *args: str) -> Proc:
    """``python -m pagedkv serve|route ARGS --port P`` (a free port), logging to scratch."""
    port = free_port()
    env = {"PAGEDKV_API_KEY": "", "PAGEDKV_NO_BUSY_WARNING": "1"}
    return Proc([sys.executable, "-m", "pagedkv", *args, "--port", str(port)], port,
                scratch / f"{name}.log", env)  # fmt: skip


def redis_server(scratch: Path) -> Proc | None:
    """A throwaway redis-server on a free port (no persistence), or None where none exists."""
    binary = shutil.which("redis-server")
    env = {}
    if binary is None and (WHEELS / "redis" / "redis-server").is_file():
        binary = str(WHEELS / "redis" / "redis-server")
        env["LD_LIBRARY_PATH"] = ":".join(
            filter(None, [str(WHEELS / "redis" / "lib"), os.environ.get("LD_LIBRARY_PATH")])
        )
    if binary is None:
        return None
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(scratch)]  # fmt: skip
    proc = Proc(argv, port, scratch / "redis.log", env)
    proc.url = f"redis://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {proc.log()[-500:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("redis-server did not answer PING")


def _request(method: str, url: str, body: dict | None, timeout_s: float):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    return urllib.request.Request(url, data=data, method=method, headers=headers), timeout_s


def get(url: str, timeout_s: float = 30.0) -> tuple[int, str]:
    """(status, body text)."""
    req, t = _request("GET", url, None, timeout_s)
    try:
        with urllib.request.urlopen(req, timeout=t) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def post(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST."""
    req, t = _request("POST", url, body, timeout_s)
    try:
        with urllib.request.urlopen(req, timeout=t) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def stream(url: str, body: dict, timeout_s: float = 120.0) -> tuple[int, list[dict], bool]:
    """(status, the SSE events' JSON, whether ``[DONE]`` ended them) of a streamed POST."""
    req, t = _request("POST", url, {**body, "stream": True}, timeout_s)
    events, done = [], False
    with urllib.request.urlopen(req, timeout=t) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
        return resp.status, events, done


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample ``name{labels...}`` in a ``/metrics`` text (None: none)."""
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        head = series.split("{", 1)
        if head[0] != name:
            continue
        have = head[1].rstrip("}") if len(head) > 1 else ""
        if all(f'{k}="{v}"' in have for k, v in labels.items()):
            return float(value)
    return None
