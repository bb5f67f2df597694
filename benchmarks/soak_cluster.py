"""The cluster ``soak.py`` runs: one redis-server, a P/D pair, two more replicas, one router.

Every process is a real ``pagedkv`` (or ``redis-server``) on loopback, started by this module
and stopped by its PID; logs go to files under the run's folder. The model is a tiny random
Llama built by the tests' helper (fast enough for many requests on two cores): the soak is
about the parts between the processes, not the model.

Roles (names are what the chaos thread and the report use):

* ``redis``: the KV store and the KV-event streams;
* ``prefill``: ``serve --role prefill`` (pushes prompt blocks to the store);
* ``decode``: ``serve --role decode --prefill-url`` (a replica the router sends to);
* ``r1``, ``r2``: plain replicas with the store and KV events;
* ``router``: ``route --policy prefix-aware`` over ``decode``, ``r1``, ``r2``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' helpers: tiny model, redis-server, free ports

from tests.kvstore.redis_server import RedisServer, free_port  # noqa: E402

START_TIMEOUT_S = 180.0
REPLICAS = ("decode", "r1", "r2")


def build_tiny_model(folder: Path) -> Path:
    from tests.model.tiny import make_tiny_model

    if not (folder / "config.json").exists():
        make_tiny_model("llama", folder, context_len=1024)  # room for a prompt and its answer
    return folder


class Proc:
    """One ``pagedkv`` process; ``args`` are kept so that ``restart`` runs the same again."""

    def __init__(self, name: str, args: list[str], port: int, logs: Path) -> None:
        self.name, self.args, self.port, self.logs = name, args, port, logs
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.stopped = False  # SIGSTOPped by the chaos thread

    def start(self) -> Proc:
        env = {**os.environ, "PAGEDKV_API_KEY": "", "OMP_NUM_THREADS": "1"}
        log = open(self.logs / f"{self.name}.log", "a")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedkv", *self.args], env=env,
                                     stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                tail = (self.logs / f"{self.name}.log").read_text()[-1500:]
                raise RuntimeError(f"{self.name} exited: {tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not become healthy in {timeout_s:.0f} s")

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)
            self.stopped = sig == signal.SIGSTOP or (self.stopped and sig != signal.SIGCONT)

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.stopped = False

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


class Cluster:
    """Start with ``start()``; ``procs`` by name; ``redis`` restarts on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.model = build_tiny_model(workdir / "tiny-llama")
        self.redis = RedisServer(workdir)
        self.procs: dict[str, Proc] = {}

    def _serve(self, name: str, *flags: str) -> Proc:
        port = free_port()
        args = ["serve", "--model", str(self.model), "--port", str(port), "--kv-cache-memory",
                "16MiB", "--kv-store", self.redis.url, *flags]  # fmt: skip
        self.procs[name] = proc = Proc(name, args, port, self.logs)
        return proc

    def start(self) -> Cluster:
        self.redis.start()
        events = ("--kv-events", self.redis.url)
        prefill = self._serve("prefill", "--role", "prefill").start()
        prefill.wait_healthy()
        self._serve("decode", "--role", "decode", "--prefill-url", prefill.url,
                    "--prefill-timeout", "5", *events).start()  # fmt: skip
        self._serve("r1", *events).start()
        self._serve("r2", *events).start()
        for name in REPLICAS:
            self.procs[name].wait_healthy()
        port = free_port()
        replicas = [x for n in REPLICAS for x in ("--replica", self.procs[n].url)]
        args = ["route", *replicas, "--model", str(self.model), "--port", str(port),
                "--policy", "prefix-aware", "--kv-events", self.redis.url,
                "--health-interval", "0.5", "--request-timeout", "30"]  # fmt: skip
        self.procs["router"] = Proc("router", args, port, self.logs).start()
        self.procs["router"].wait_healthy()
        return self

    @property
    def router(self) -> Proc:
        return self.procs["router"]

    def restart(self, name: str) -> None:
        """Bring ``name`` back (redis: on its port, empty), waiting until it answers."""
        if name == "redis":
            self.redis.stop()
            self.redis.start()
            return
        proc = self.procs[name]
        proc.kill()
        proc.start().wait_healthy()

    def heal(self) -> None:
        """SIGCONT every stopped process and restart every dead one (the end of the chaos)."""
        for proc in self.procs.values():
            proc.signal(signal.SIGCONT)
        if not self.redis.ping():
            self.redis.stop()
            self.redis.start()
        for proc in self.procs.values():
            if not proc.alive():
                proc.start().wait_healthy()

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.kill()
        self.redis.stop()
