"""The README's Python example is examples/minimal.py, and it runs (silently) as written."""

import os
import re
import subprocess
import sys

import epcomm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_example_is_examples_minimal_py():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Python"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == open(os.path.join(ROOT, "examples", "minimal.py")).read()


def test_examples_minimal_py_runs():
    r = subprocess.run([epcomm.cli_path(), "launch", "-n", "3", sys.executable,
                        os.path.join(ROOT, "examples", "minimal.py")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert sorted(r.stdout.split("\n"))[1:] == [f"[{i}] rank {i}: ok" for i in range(3)]
