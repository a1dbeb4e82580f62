"""tools.Runner: deadlines that fire whatever the child does with its output, and cancels that leave nothing.

Real child processes (Python, sh, sleep); no Docker needed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

from imagebuild.core.runner import EXIT_CANCELLED, EXIT_TIMED_OUT, Runner

from .conftest import REPO_ROOT


def alive(marker: str) -> list[str]:
    """PIDs of processes whose command line holds `marker` (ps, independent of the code under test)."""
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False).stdout.split()


def gone_within(marker: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def sigterm_once_running(program: str, args: list[str], marker: str, children: int = 1) -> tuple[int, str]:
    """Run the Python `program` in a process of its own (signal handlers and the cancel are per process);
    SIGTERM it once `children` processes have `marker` in their command line. Its exit code and output."""
    proc = subprocess.Popen([sys.executable, "-c", program, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        deadline = time.monotonic() + 30
        while len(alive(marker)) < children:
            assert time.monotonic() < deadline, "the children never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, out


def test_a_child_printing_forever_is_stopped_at_its_deadline():
    marker = f"chatty-{uuid.uuid4().hex}"
    chatty = f"import time\nwhile True:\n    print('{marker} line', flush=True)\n    time.sleep(0.1)\n"
    started = time.monotonic()
    result = Runner().run([sys.executable, "-c", chatty], timeout=2)
    elapsed = time.monotonic() - started
    assert result.returncode == EXIT_TIMED_OUT and result.timed_out
    assert 2 <= elapsed < 5, elapsed
    assert result.output.count(f"{marker} line") >= 5  # it was read while it ran, not after
    assert result.output.rstrip().endswith("imagebuild: timed out after 2 s")
    assert gone_within(marker, 5)


def test_a_child_that_prints_nothing_and_hangs_is_stopped_at_its_deadline():
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"  # a unique sleep length
    started = time.monotonic()
    result = Runner().run(["sleep", marker], timeout=1.5)
    assert result.timed_out and result.returncode == EXIT_TIMED_OUT
    assert time.monotonic() - started < 5
    assert gone_within(f"sleep {marker}", 5)


def test_a_timeout_stops_the_grandchildren_that_hold_the_output_open():
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    script = f"sleep {marker} & echo started; wait"  # the grandchild keeps stdout open after sh is gone
    started = time.monotonic()
    result = Runner().run(["sh", "-c", script], timeout=1.5)
    assert result.timed_out
    assert "started" in result.output
    assert time.monotonic() - started < 5
    assert gone_within(f"sleep {marker}", 5)


def test_a_finished_child_reports_its_exit_code_and_every_line_including_a_last_partial_one():
    result = Runner().run(["sh", "-c", "echo one; echo two >&2; printf three; exit 7"], timeout=30)
    assert (result.returncode, result.timed_out, result.cancelled) == (7, False, False)
    assert result.output.splitlines() == ["one", "two", "three"]


def test_output_is_decoded_line_by_line_even_when_a_character_spans_two_reads(tmp_path):
    # 65535 ASCII bytes, then a 2-byte character: os.read's 64 KiB boundary falls inside it.
    script = "import sys; sys.stdout.buffer.write(b'a' * 65535 + 'é\\n'.encode()); sys.stdout.flush()"
    result = Runner().run([sys.executable, "-c", script], log=tmp_path / "out.log", timeout=30)
    assert result.returncode == 0
    assert result.output == "a" * 65535 + "é\n"
    assert (tmp_path / "out.log").read_text(encoding="utf-8") == result.output


def test_a_stopped_runner_ends_its_running_command_and_starts_no_other():
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    runner, results = Runner(), []
    worker = threading.Thread(target=lambda: results.append(runner.run(["sleep", marker + "1"])))
    worker.start()
    deadline = time.monotonic() + 10
    while not alive(f"sleep {marker}1"):
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)

    runner.stop_all()

    worker.join(15)
    assert results and results[0].cancelled and results[0].returncode == -signal.SIGTERM
    later = runner.run(["sleep", marker + "2"])
    assert later.cancelled and later.returncode == EXIT_CANCELLED
    assert not alive(f"sleep {marker}")


def test_sigterm_raises_cancelled_in_the_main_thread_and_no_child_outlives_it(tmp_path):
    # A process of its own: signal handlers and the cancel are per process.
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    program = textwrap.dedent("""
        import sys, threading
        from imagebuild.core.runner import Cancelled, Runner, cancel_children, install_signal_handlers
        marker = sys.argv[1]
        install_signal_handlers()
        runner = Runner()
        worker = threading.Thread(target=runner.run, args=(["sleep", marker + "1"],))
        worker.start()
        try:
            runner.run(["sh", "-c", "echo running; sleep " + marker + "2"])
        except Cancelled as exc:
            cancel_children()
            worker.join(30)
            late = Runner().run(["sleep", marker + "3"])
            print("cancelled", exc.signum, worker.is_alive(), late.cancelled, flush=True)
            sys.exit(143)
    """)
    # The marker reaches the program as an argument, so only the children's command lines say "sleep MARKER".
    returncode, out = sigterm_once_running(program, [marker], f"sleep {marker}", children=2)
    assert returncode == 143
    assert out.split() == ["cancelled", str(int(signal.SIGTERM)), "False", "True"]
    assert gone_within(f"sleep {marker}", 5), "a child of the cancelled process is still running"


def test_input_reaches_the_childs_stdin_which_then_closes():
    result = Runner().run(["sh", "-c", 'read first; echo "got $first"; cat | wc -l'], input="one\ntwo\nthree\n",
                          timeout=30)
    assert result.returncode == 0 and result.output.split() == ["got", "one", "2"]
    assert Runner().run(["cat"], timeout=30).output == ""  # no input: /dev/null, not this process's stdin


def test_a_child_that_reads_no_input_cannot_hold_past_its_deadline_however_much_there_is():
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    started = time.monotonic()
    result = Runner().run(["sleep", marker], input="x" * (4 << 20), timeout=1.5)  # far more than a pipe holds
    assert result.timed_out and time.monotonic() - started < 5
    assert gone_within(f"sleep {marker}", 5)
    done = Runner().run(["head", "-c", "10"], input="y" * (4 << 20), timeout=30)  # stops reading half-way
    assert done.returncode == 0 and done.output == "y" * 10


def test_stderr_apart_from_stdout_both_redacted_and_both_in_the_log(tmp_path):
    log = tmp_path / "out.log"
    script = "echo 'answer s3cr3t-value'; echo 'warning s3cr3t-value' >&2; echo tail >&2"
    result = Runner().run(["sh", "-c", script], secrets=["s3cr3t-value"], separate_stderr=True, log=log, timeout=30)
    assert (result.returncode, result.output, result.stderr) == (0, "answer ***\n", "warning ***\ntail\n")
    assert sorted(log.read_text().splitlines()) == ["answer ***", "tail", "warning ***"]
    merged = Runner().run(["sh", "-c", script], timeout=30)
    assert merged.stderr == "" and "warning s3cr3t-value" in merged.output
