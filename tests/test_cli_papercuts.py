"""The command line's newcomer papercuts (issue 23): progress on stderr while a batch runs, a
warning when a busy machine will make threads slow, and no committed file overwritten unless
asked for with --force."""

from __future__ import annotations

import io
import json
import os
import subprocess

import pytest

from pagedkv import cli
from pagedkv.commands import busy_machine
from pagedkv.commands.overwrite import is_tracked_by_git
from pagedkv.commands.progress import BatchProgress, ProgressLines
from pagedkv.engine import CompletionOutput, RequestOutput
from pagedkv.errors import UsageError


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_progress_lines_are_rate_limited_and_the_last_is_never_skipped() -> None:
    clock, stream = FakeClock(), io.StringIO()
    lines = ProgressLines(4, "pagedkv x", "prompts", stream=stream, clock=clock, every_s=2.0)
    lines.advance(1, "a")  # the first line at once
    clock.now_s = 1.0
    lines.advance(1, "b")  # 1 s after the last line: skipped
    lines.advance(0, "c")  # nothing finished: never a line
    clock.now_s = 2.5
    lines.advance(1, "d", quiet=True)  # counted, not shown
    lines.advance(1, "e")  # the last one
    assert stream.getvalue().splitlines() == [
        "pagedkv x: 1/4 prompts done, a",
        "pagedkv x: 4/4 prompts done, e",
    ]


def _out(request_id: str, num_tokens: int, finished: bool) -> RequestOutput:
    reason = "length" if finished else None
    sample = CompletionOutput(0, token_ids=list(range(num_tokens)), finish_reason=reason)
    return RequestOutput(request_id, "", [], [sample])


def test_batch_progress_counts_finished_requests_and_every_token() -> None:
    clock, stream = FakeClock(), io.StringIO()
    progress = BatchProgress(2, "pagedkv generate", stream=stream, clock=clock, every_s=0.0)
    clock.now_s = 2.0
    progress.update([_out("a", 3, True), _out("b", 1, False)])
    clock.now_s = 4.0
    progress.update([_out("b", 5, True)])
    assert stream.getvalue().splitlines() == [
        "pagedkv generate: 1/2 prompts done, 4 tokens, 2.0 tok/s",
        "pagedkv generate: 2/2 prompts done, 8 tokens, 2.0 tok/s",
    ]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.model.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture
def quiet_machine(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))


def test_a_batch_of_prompts_reports_progress_on_stderr_only(tiny_folder, quiet_machine, capsys):
    argv = ["generate", "--model", str(tiny_folder), "--max-tokens", "3", "--ignore-eos"]
    assert cli.main([*argv, "--json", "first", "second"]) == 0
    printed = capsys.readouterr()
    rows = [json.loads(line) for line in printed.out.splitlines()]  # stdout: only the JSON
    assert [len(r["outputs"][0]["token_ids"]) for r in rows] == [3, 3]
    assert "pagedkv generate: 2/2 prompts done, 6 tokens, " in printed.err


def test_the_demo_reports_each_run_without_breaking_the_streamed_answer(
    tmp_path, quiet_machine, capsys
):
    from tests.model.tiny import make_tiny_model

    make_tiny_model("llama", tmp_path, context_len=512)  # the demo's prompts: ~270 tokens
    argv = ["demo", "--model", str(tmp_path), "--max-tokens", "4"]
    assert cli.main([*argv, "--num-requests", "3"]) == 0
    printed = capsys.readouterr()
    assert printed.out.count("\n") == 1  # the streamed answer's one line, as before
    for policy in ("vllm", "reserved"):
        assert f"pagedkv demo, policy {policy}: 3/3 requests done, 12 tokens" in printed.err


@pytest.mark.parametrize(
    ("threads", "load_1min", "words"),
    [
        (2, 0.2, None),  # an idle 2-core machine
        (2, 1.0, "pagedkv generate: warning: this machine is busy (1-minute load 1.0 on 2 cores)"
                 " and pagedkv runs 2 threads: threads that spin waiting for a busy core can "
                 "make every step many times slower; try OMP_NUM_THREADS=1"),
        (1, 1.0, None),  # one core left free for one thread
        (1, 2.0, "runs 1 thread: steps take longer than on a quiet machine"),
    ],
)  # fmt: skip
def test_a_busy_machine_is_told_once_at_start_up(monkeypatch, capsys, threads, load_1min, words):
    monkeypatch.delenv(busy_machine.QUIET_ENV)
    monkeypatch.setattr(os, "getloadavg", lambda: (load_1min, 0.0, 0.0))
    monkeypatch.setattr(busy_machine, "usable_cores", lambda: 2)
    message = busy_machine.warn_if_busy("generate", threads)
    err = capsys.readouterr().err
    if words is None:
        assert message is None and err == ""
    else:
        assert words in message and err == message + "\n"


def test_the_warning_of_an_engine_that_adapts_its_threads_says_so():
    message = busy_machine.busy_warning("serve", 2, 2, 1.0, "OMP_NUM_THREADS=1", adapts=True)
    assert message == (
        "pagedkv serve: warning: this machine is busy (1-minute load 1.0 on 2 cores) and pagedkv "
        "runs 2 threads: its steps run on fewer threads while other processes hold cores"
    )
    assert busy_machine.busy_warning("serve", 2, 2, 0.2, "", adapts=True) is None


def test_generate_warns_on_a_busy_machine_before_the_model_loads(tiny_folder, monkeypatch, capsys):
    monkeypatch.delenv(busy_machine.QUIET_ENV)
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 0.0, 0.0))
    argv = ["generate", "--model", str(tiny_folder), "--max-tokens", "2", "hi"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("pagedkv generate: warning: this machine is busy (1-minute load 64.0")
    assert err.count("warning") == 1


@pytest.fixture
def checkout(tmp_path):
    """A git repository with one tracked figure and one untracked scratch file."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tracked = tmp_path / "docs" / "img" / "plan.png"
    tracked.parent.mkdir(parents=True)
    tracked.write_bytes(b"committed")
    subprocess.run(["git", "-C", str(tmp_path), "add", "docs/img/plan.png"], check=True)
    (tmp_path / "scratch.png").write_bytes(b"mine")
    return tmp_path


def test_only_files_git_tracks_count_as_tracked(checkout, tmp_path_factory):
    assert is_tracked_by_git(checkout / "docs" / "img" / "plan.png")
    assert not is_tracked_by_git(checkout / "scratch.png")
    assert not is_tracked_by_git(checkout / "docs" / "img" / "new.png")  # not there yet
    outside = tmp_path_factory.mktemp("no-repo") / "x.png"
    outside.write_bytes(b"")
    assert not is_tracked_by_git(outside)


PLAN = ["plan", "--model", "llama-3-8b", "--num-seqs", "8", "--mean-len", "500"]


def test_plan_overwrites_a_committed_figure_only_with_force(checkout, capsys):
    pytest.importorskip("matplotlib")
    figure = checkout / "docs" / "img" / "plan.png"
    assert cli.main([*PLAN, "--plot", str(figure)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"pagedkv plan: error: --plot: {str(figure)!r} is a file tracked by git; give --force "
        "to overwrite it, or another path\n"
    )
    assert figure.read_bytes() == b"committed"
    assert cli.main([*PLAN, "--plot", str(checkout / "scratch.png")]) == 0  # not tracked
    assert cli.main([*PLAN, "--plot", str(figure), "--force"]) == 0
    assert figure.read_bytes().startswith(b"\x89PNG")


def test_experiment_writes_to_a_scratch_folder_and_refuses_committed_files(checkout, capsys):
    pytest.importorskip("matplotlib")
    assert cli.build_parser().parse_args(["experiment", "block-size"]).out == "results"
    committed = checkout / "docs" / "experiments" / "block-size.json"
    committed.parent.mkdir(parents=True)
    committed.write_text("{}")
    subprocess.run(["git", "-C", str(checkout), "add", "docs/experiments"], check=True)
    argv = ["experiment", "block-size", "--quick", "--out", str(checkout / "docs")]
    assert cli.main(argv) == 2  # refused before the sweep runs
    assert "--out: " in capsys.readouterr().err and committed.read_text() == "{}"


def test_the_overwrite_rule_is_a_usage_error_naming_the_flag(checkout):
    from pagedkv.commands.plot_path import prepare_plot_path

    with pytest.raises(UsageError) as e:
        prepare_plot_path(str(checkout / "docs" / "img" / "plan.png"))
    assert e.value.param == "--plot" and "--force" in str(e.value)
