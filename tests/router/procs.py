"""Real processes for the router tests: ``pagedkv serve`` replicas and ``pagedkv route``,
on loopback, started in parallel and stopped by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tests.kvstore.redis_server import free_port

START_TIMEOUT_S = 120.0


def _env() -> dict[str, str]:
    return {**os.environ, "PAGEDKV_API_KEY": "", "OMP_NUM_THREADS": "1"}


class Proc:
    """One ``pagedkv`` process on ``port``; output goes to a file (a full pipe would block)."""

    def __init__(self, args: list[str], port: int, log_path) -> None:
        self.port, self.url, self.log_path = port, f"http://127.0.0.1:{port}", log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedkv", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=_env())  # fmt: skip

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}: {self.log()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.url} did not become healthy: {self.log()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def serve(tmp_path, name: str, *flags: str) -> Proc:
    """An embedded SmolLM2 replica (small KV pool)."""
    port = free_port()
    args = ["serve", "--port", str(port), "--kv-cache-memory", "64MiB", *flags]
    return Proc(args, port, tmp_path / f"{name}.log")


def route(tmp_path, name: str, replicas: list[str], *flags: str) -> Proc:
    port = free_port()
    reps = [x for url in replicas for x in ("--replica", url)]
    args = ["route", *reps, "--port", str(port), "--health-interval", "0.5", *flags]
    return Proc(args, port, tmp_path / f"{name}.log")


def metric_values(url: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric family from ``url``'s /metrics."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels.strip()] = float(value)
    return out
