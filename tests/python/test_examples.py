"""The README's Python example is examples/minimal.py, and it runs (silently) as written; so
does examples/moe_layer.py, which checks its own result."""

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


def test_examples_moe_layer_py_runs():
    """The MoE layer example checks its own output against the layer computed on one rank."""
    r = subprocess.run([epcomm.cli_path(), "launch", "-n", "3", sys.executable,
                        os.path.join(ROOT, "examples", "moe_layer.py")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = sorted(r.stdout.split("\n"))[1:]
    assert [re.match(r"\[(\d)\] rank \1: ok on (cpu|cuda), \d+ token-expert pairs here$", s)
            is not None for s in lines] == [True] * 3, r.stdout
