"""``pagedkv serve --replicas N`` as a user runs it: its own local Ray, started and stopped by
the command. Ctrl-C or SIGTERM leaves no process behind (no raylet, GCS, Serve actor or
worker of its Ray); bad configuration is one line and exit 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.kvstore.redis_server import free_port
from tests.serve_ray.ray_app import complete, tiny_model

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny"), context_len=256)


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            out[int(entry)] = raw.replace(b"\0", b" ").decode(errors="replace")
    return out


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _serve(model: Path, port: int, log: Path, *flags: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "pagedkv",
        "serve",
        "--replicas",
        "2",
        "--model",
        str(model),
        "--replica-cpus",
        "0",
        "--ray-num-cpus",
        "2",
        "--kv-cache-memory",
        "8MiB",
        "--block-size",
        "4",
        "--port",
        str(port),
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_ready(proc: subprocess.Popen, log: Path, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while "listening on" not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "not ready: " + log.read_text()[-3000:]
        time.sleep(0.3)
    assert complete(base, "hello there").status_code == 200


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_every_process_it_started(model, tmp_path, sig):
    before = set(_cmdlines())
    port = free_port()
    proc = _serve(model, port, tmp_path / "serve.log")
    try:
        _wait_ready(proc, tmp_path / "serve.log", f"http://127.0.0.1:{port}")
        session = os.path.realpath("/tmp/ray/session_latest")
        started = _descendants(proc.pid)
        ours = {p for p, cmd in _cmdlines().items() if session in cmd} | started
        names = " ".join(_cmdlines().get(p, "") for p in ours)
        assert "raylet" in names and "gcs_server" in names  # what must be gone after
        proc.send_signal(sig)
        assert proc.wait(60) == 130, (tmp_path / "serve.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 20
    while left := {p: c for p, c in _cmdlines().items() if p in ours or session in c}:
        if time.monotonic() > deadline:
            for pid in left:  # leave the machine clean, then fail
                with __import__("contextlib").suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(f"processes left after {sig.name}: {sorted(left.values())[:5]}")
        time.sleep(0.3)
    assert not (set(_cmdlines()) - before) & ours
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_replica_that_cannot_start_is_one_line_and_exit_2(model, tmp_path):
    port = free_port()
    proc = _serve(model, port, tmp_path / "serve.log", "--kv-cache-memory", "1KiB")
    assert proc.wait(START_TIMEOUT_S) == 2
    last = (tmp_path / "serve.log").read_text().strip().splitlines()[-1]
    assert last.startswith("pagedkv serve: error: a replica could not start: ")
    assert "--kv-cache-memory 1 KiB has room for 0 blocks" in last


def test_an_unreachable_ray_address_is_one_line_and_exit_2(model, tmp_path):
    dead = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "serve",
            "--replicas",
            "1",
            "--ray-address",
            f"127.0.0.1:{dead}",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"pagedkv serve: error: --ray-address 127.0.0.1:{dead}: no Ray cluster answers there "
        "([Errno 111] Connection refused); start one with `ray start --head` or leave the flag "
        "out to start a local Ray"
    ]
