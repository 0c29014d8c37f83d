"""scripts/rerun-if-crashed (what `.ci/run` runs the suite with): a pytest-xdist run that a crashed worker stopped,
with no failing test, runs once more; a failing test, or a crash that comes back, fails."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rerun-if-crashed"
RERUN = "rerun-if-crashed: a test worker crashed"


def _run(*command: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_crash_reruns_the_suite_once(tmp_path):
    """A real xdist worker killed by SIGSEGV in its first run (the suite's pytest options): its output names the
    crash as the script reads it; the second run passes and the script with it."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "--dist loadgroup --max-worker-restart=0 -p no:cacheprovider"\n'
    )
    (tmp_path / "test_flaky.py").write_text(
        "import os, signal\nfrom pathlib import Path\n"
        "def test_passes():\n    pass\n"
        "def test_crashes_once_in_a_test_whose_name_is_longer_than_the_summary_line_that_names_it_when_cut():\n"
        "    flag = Path(__file__).with_name('crashed')\n"
        "    if not flag.exists():\n"
        "        flag.touch()\n"
        "        os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    # only xdist among the installed plugins (each pytest start would load them all: seconds)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    r = _run(sys.executable, "-m", "pytest", "-q", "-p", "xdist", "-n", "1", "test_flaky.py", cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stdout.count(RERUN) == 1, r.stdout[-3000:]
    assert "crashed while running 'test_flaky.py::test_crashes_once_in_a" in r.stdout and "2 passed" in r.stdout


def test_a_failing_test_a_hang_or_a_crash_that_comes_back_fails(tmp_path):
    """Commands that print what pytest and xdist print: a failing test beside a crash is not rerun, nor a worker
    ended by pytest-timeout (no fatal error); a crash in both runs fails after one rerun; the exit status is the
    command's."""
    fatal = "Fatal Python error: Segmentation fault"
    crash = ("worker 'gw0' crashed while running 'test_a.py::test_x'", "FAILED test_a.py::test_x")
    fail = "FAILED test_a.py::test_y - assert 1 == 2"

    def run(*lines: str, status: int = 1) -> subprocess.CompletedProcess:
        return _run("sh", "-c", f"printf '%s\\n' {' '.join(repr(x) for x in lines)}; exit {status}", cwd=tmp_path)

    failing = run(fatal, *crash, fail)
    assert failing.returncode == 1 and RERUN not in failing.stdout and fail in failing.stdout
    assert run(fail, status=3).returncode == 3
    hung = run("+++++++ Timeout +++++++", *crash)
    assert hung.returncode == 1 and RERUN not in hung.stdout
    again = run(fatal, *crash)
    assert again.returncode == 1 and again.stdout.count(RERUN) == 1 and again.stdout.count(fatal) == 2
    assert run("1 passed", status=0).returncode == 0
