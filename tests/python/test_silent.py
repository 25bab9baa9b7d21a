"""The scenario this project started from: a test suite passes, then floods its exit with
warnings. Here a run of (part of) this suite must print nothing on stderr, at exit or before,
and `epcomm doctor verify` must call it clean. (make test runs the whole suite under
`epcomm doctor verify` too: tests/test_python.sh.)"""

import os
import subprocess
import sys

import pytest

import epcomm

HERE = os.path.dirname(os.path.abspath(__file__))
SUBSET = "cpu and (test_layout or test_dispatch_combine) and -2]"
NESTED = "EPCOMM_TEST_NESTED"

pytestmark = pytest.mark.skipif(os.environ.get(NESTED) == "1",
                                reason="skipped: inside the nested run of this test")


def _pytest_cmd():
    return [sys.executable, "-m", "pytest", HERE, "-q", "-p", "no:cacheprovider", "-k", SUBSET]


def test_suite_exit_is_silent():
    r = subprocess.run(_pytest_cmd(), capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, **{NESTED: "1"}))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
    assert r.stderr == "", f"the suite wrote to stderr:\n{r.stderr}"


def test_doctor_verify_says_clean():
    r = subprocess.run([epcomm.cli_path(), "doctor", "verify", "--", *_pytest_cmd()],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, **{NESTED: "1"}))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "verdict: clean" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
