#!/usr/bin/env bash
# The Python package's suite (tests/python) as the seed's users run theirs, under
# `epcomm doctor verify`: it must pass, `verify` must call it clean (no run- or exit-phase
# warning), and nothing may reach stderr, at exit or before.
#
# Usage: tests/test_python.sh BUILD_DIR. The Python is $EPCOMM_PYTHON, else python3 (.ci/run
# puts a virtual environment with torch, pytest and the package first on the PATH). The package
# tested is BUILD_DIR/python/epcomm when the build was configured with -DEP_PYTHON=ON, else the
# installed one (`pip install .`), which must have been installed from this tree.
# Exit 77 (skipped, with the reason) without torch, pytest or the package.
set -u
b=$(cd "${1:?usage: test_python.sh BUILD_DIR}" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
py=${EPCOMM_PYTHON:-python3}
skip() { echo "skipped: $*"; exit 77; }

command -v "$py" >/dev/null || skip "no $py on the PATH"
"$py" -c "import torch, pytest" 2>/dev/null ||
  skip "torch and pytest are not installed for $py (pip install torch pytest, then pip install . from the repository root)"
if [ -f "$b/python/epcomm/_C.abi3.so" ]; then
  export PYTHONPATH="$b/python${PYTHONPATH:+:$PYTHONPATH}"
fi
pkg=$("$py" -c "import epcomm, os; print(os.path.dirname(epcomm.__file__))" 2>/dev/null) ||
  skip "the epcomm package is not installed for $py (pip install . from the repository root)"
echo "testing the package in $pkg with $("$py" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
for f in "$src"/python/epcomm/*.py; do
  if ! cmp -s "$f" "$pkg/$(basename "$f")"; then
    echo "the epcomm package in $pkg is not this tree's ($(basename "$f") differs): pip install . again" >&2
    exit 1
  fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$src" || exit 1
"$b/bin/epcomm" doctor verify --log "$tmp/log" -- "$py" -m pytest tests/python -q -rs \
  -p no:cacheprovider >"$tmp/out" 2>"$tmp/report"
rc=$?
tail -n 40 "$tmp/out"
sed -n '/^epcomm doctor verify:/,$p' "$tmp/report"
if grep -q '^\[ *[0-9.]*\] err|' "$tmp/log"; then
  echo "the suite wrote to stderr (a correct run is silent):" >&2
  grep '^\[ *[0-9.]*\] err|' "$tmp/log" | head -20 >&2
  exit 1
fi
if [ "$rc" != 0 ]; then
  echo "epcomm doctor verify: status $rc (pytest failed, or warnings remain):" >&2
  tail -n 30 "$tmp/report" >&2
  exit 1
fi
