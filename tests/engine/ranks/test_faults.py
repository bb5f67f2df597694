"""Faults of a tensor-parallel engine end it with one clear error, within seconds, never a hang:
a worker killed mid-run, a worker that raises, a head count that does not split (refused
before anything loads), and ``pagedkv serve`` whose worker dies (the server exits 1 naming the
rank). SIGTERM (or Ctrl-C) to ``serve`` stops every rank; rank 0 killed outright takes its
workers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.errors import RankFailure, UsageError
from tests.kvstore.redis_server import free_port
from tests.model.tiny import make_tiny_model

# A hang would last the collectives' timeout (300 s); a failure seen is seen in about a second.
WITHIN_S = 30.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tp-faults")
    make_tiny_model("llama", folder)
    return folder


def _engine(folder) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            kv_cache_memory_bytes=8 << 20,
            tensor_parallel_size=2,
            log_startup=False,
        )
    )


def _run_until_failure(engine: LLMEngine) -> tuple[RankFailure, int]:
    steps = 0
    with pytest.raises(RankFailure) as failure:
        while engine.has_unfinished():
            engine.step()
            steps += 1
    return failure.value, steps


def test_a_worker_killed_mid_run_ends_the_engine(folder):
    engine = _engine(folder)
    try:
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        for i in range(16):
            engine.add_request([10 + i, 20, 30], params)
        engine.step()  # running: every rank is in the step loop
        pid = engine.parts.ranks.workers.procs[0].pid
        killed = time.monotonic()
        threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()  # inside some step
        error, steps = _run_until_failure(engine)
        assert time.monotonic() - killed < WITHIN_S
        assert steps < 99  # it did not run to the end
        assert f"rank 1 (pid {pid}) was killed by SIGKILL" in str(error)
        assert engine.ranks_failure == str(error)
        with pytest.raises(RankFailure):  # and stays ended
            engine.generate([[1, 2, 3]], params)
    finally:
        engine.close()


def test_a_worker_that_raises_ends_the_engine_with_its_error(folder):
    engine = _engine(folder)
    try:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        engine.parts.ranks.workers.send("not a message")  # the worker raises on it
        error, _ = _run_until_failure(engine)
        assert "rank 1 failed: RuntimeError: unexpected message 'not a message'" in str(error)
        worker = engine.parts.ranks.workers.procs[0]
        worker.join(WITHIN_S)
        assert worker.exitcode == 1
    finally:
        engine.close()


def test_one_tensor_parallel_engine_a_process_at_a_time(folder):
    engine = _engine(folder)
    try:
        with pytest.raises(UsageError, match="another tensor-parallel engine runs in this process"):
            _engine(folder)
    finally:
        engine.close()
    again = _engine(folder)  # once closed, the next one starts
    again.close()


def _pagedkv(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", *argv], capture_output=True, text=True, timeout=timeout
    )


def test_heads_that_do_not_split_are_refused_in_one_line():
    # The embedded SmolLM2 has 9 query heads and 3 KV heads: 2 ranks split neither.
    done = _pagedkv("generate", "--tensor-parallel-size", "2", "hi")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [
        "pagedkv generate: error: --tensor-parallel-size 2 does not divide the model's 9 query "
        "heads (sizes that do: 1, 3, 9)"
    ]
    assert "loading" not in done.stderr  # refused before the weights load


def _serving(folder) -> tuple[subprocess.Popen, int]:
    """``pagedkv serve --tensor-parallel-size 2`` answering, and its worker's pid."""
    port = free_port()
    env = {**os.environ, "PAGEDKV_API_KEY": ""}
    argv = ["serve", "--model", str(folder), "--port", str(port), "--kv-cache-memory", "8MiB"]
    argv += ["--tensor-parallel-size", "2"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    serve = subprocess.Popen([sys.executable, "-m", "pagedkv", *argv], **pipes)
    deadline = time.monotonic() + 90
    info = None
    while info is None and time.monotonic() < deadline and serve.poll() is None:
        try:
            info = httpx.get(f"http://127.0.0.1:{port}/pagedkv/info", timeout=1).json()
        except httpx.HTTPError:
            time.sleep(0.2)
    assert info is not None, serve.stderr.read() if serve.poll() is not None else "no answer"
    assert info["tensor_parallel"] == {"size": 2, "heads_per_rank": 2, "kv_heads_per_rank": 1}
    return serve, _only_child(serve.pid)


def _gone(pid: int, within_s: float = WITHIN_S) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):  # a zombie has ended
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopping_serve_stops_its_worker(folder, how):
    """SIGTERM: serve's graceful stop stops the worker; SIGKILL: the worker dies with it."""
    serve, worker = _serving(folder)
    try:
        serve.send_signal(getattr(signal, how))
        serve.wait(WITHIN_S)
        assert _gone(worker), f"the worker {worker} outlived serve's {how}"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_serve_ends_when_a_worker_dies(folder):
    serve, worker = _serving(folder)
    try:
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        _, err = serve.communicate(timeout=WITHIN_S)  # it ends by itself, idle as it is
        assert time.monotonic() - killed < WITHIN_S
        assert serve.returncode == 1, err
        assert f"pagedkv serve: error: tensor-parallel rank 1 (pid {worker}) was killed by " in err
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def _only_child(pid: int) -> int:
    """The one worker ``pid`` spawned (not multiprocessing's resource tracker), from /proc."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    workers = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                workers.append(child)
    assert len(workers) == 1, children
    return workers[0]
