"""What the client checks share: the embedded model's files, an offline tokenizer folder, and
one `pagedkv serve` started on a free loopback port and always stopped by its PID.

These scripts run in the *client* venv (guidellm, lm-eval, transformers, gguf), not in the
project's: pagedkv is reached only as a command (``--pagedkv``, default the checkout's
``.venv/bin/pagedkv``) and over HTTP, as a third-party client would reach it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PAGEDKV = REPO / ".venv" / "bin" / "pagedkv"


def cache_dir() -> Path:
    """Where exported tokenizers and run outputs live (``$XDG_CACHE_HOME/pagedkv/clients``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "pagedkv" / "clients"


def embedded_gguf(pagedkv: Path) -> Path:
    """The GGUF `pagedkv serve` loads without --model, asked of pagedkv's own interpreter."""
    python = Path(pagedkv).parent / "python"
    code = "from pagedkv.model.embedded import embedded_model_path; print(embedded_model_path())"
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def tokenizer_dir(gguf_path: Path) -> Path:
    """A Hugging Face tokenizer folder exported (once) from the GGUF's own vocabulary, so that
    clients needing a `processor`/`tokenizer` load it offline with AutoTokenizer."""
    out = cache_dir() / f"{gguf_path.stem}.tokenizer"
    if (out / "tokenizer.json").is_file() and out.stat().st_mtime >= gguf_path.stat().st_mtime:
        return out
    from transformers import AutoTokenizer

    print(f"exporting the tokenizer of {gguf_path.name} to {out}", flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


@contextlib.contextmanager
def pagedkv_serve(
    pagedkv: Path, log_path: Path, extra: list[str] | None = None, start_timeout: float = 180.0
) -> Iterator[tuple[str, str]]:
    """Run `pagedkv serve` on a free loopback port; yield (server root URL, served model id).
    The server's output goes to ``log_path``; it is stopped by PID (SIGINT, then SIGKILL)."""
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    cmd = [str(pagedkv), "serve", "--port", str(port), *(extra or [])]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        print(f"starting: {' '.join(cmd)}  (log: {log_path})", flush=True)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"pagedkv serve exited with {proc.returncode}; see {log_path}"
                    )
                try:
                    if get_json(f"{root}/health", timeout=2).get("status") == "ok":
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no /health after {start_timeout:.0f} s; see {log_path}")
                time.sleep(0.5)
            model = get_json(f"{root}/v1/models")["data"][0]["id"]
            print(f"pagedkv serve up at {root} (pid {proc.pid}), model {model!r}", flush=True)
            yield root, model
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            print(f"pagedkv serve (pid {proc.pid}) stopped, exit {proc.returncode}", flush=True)


def refused(log_path: Path) -> list[str]:
    """The server log's lines about what it would not take: its 4xx/5xx answers (uvicorn logs
    one line per request) and the request fields it ignored (logged once per name)."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    pattern = r'HTTP/[0-9.]+" [45][0-9][0-9]|ignoring the request field'
    return [ln for ln in lines if re.search(pattern, ln)]


def verdict(failures: list[str], ok: str = "OK") -> int:
    """Print each failure (or ``ok``); the script's exit status: 1 on any failure, else 0."""
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print(ok)
    return 1 if failures else 0
