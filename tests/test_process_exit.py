"""``exit_now`` ends a process as Python would, less the teardown of its modules: other threads
finish, atexit callbacks run, buffered output is written, and the exit status is sys.exit's."""

import subprocess
import sys

import pytest
from conftest import CHILD_ENV, run_benchmark

SCRIPT = """
import atexit, logging, sys, threading, time
from wavelet.common.process_exit import exit_now

def late():
    time.sleep(0.3)
    print("thread done", flush=True)

threading.Thread(target=late).start()  # not a daemon: the interpreter would wait for it
atexit.register(lambda: print("atexit ran"))
logging.basicConfig(stream=sys.stderr)
logging.getLogger("x").warning("logged")
sys.stdout.write("buffered, no newline")
exit_now({code})
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code, status", [("3", 3), ("None", 0), ("'one line'", 1)])
def test_exit_now_keeps_what_python_does_on_its_way_out(tmp_path, code, status):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(code=code)],
        env=CHILD_ENV,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == status, done.stderr
    assert done.stdout.index("thread done") < done.stdout.index("atexit ran")
    assert "buffered, no newline" in done.stdout
    assert "logged" in done.stderr
    assert ("one line" in done.stderr) == (status == 1)


@pytest.mark.timeout(120)
def test_the_exit_benchmark_runs():
    done = run_benchmark("bench_exit.py", "--rounds", "1", "--no-dynamo", timeout=100)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["the interpreter's exit", "exit_now"]
    assert "exit_now / interpreter, time to exit:" in done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "body, status, said",
    [("lambda: 4", 4, ""), ("lambda: sys.exit(2)", 2, ""), ("lambda: 1 / 0", 1, "ZeroDivision")],
)
def test_run_and_exit_ends_with_the_bodys_status(body, status, said):
    code = (
        "import atexit, sys\nfrom wavelet.common.process_exit import run_and_exit\n"
        f"atexit.register(lambda: print('atexit ran'))\nrun_and_exit({body})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=CHILD_ENV, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == status, done.stderr
    assert "atexit ran" in done.stdout and said in done.stderr
