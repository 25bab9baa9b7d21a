#!/usr/bin/env bash
# The README's "short example" must be examples/minimal.c exactly (that file is built and run by
# the suite, so the README's example compiles and works as written).
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
got=$(awk '/^## A short example/ {s = 1} s && /^```c$/ {c = 1; next} c && /^```$/ {exit} c' \
      "$src/README.md")
if [ -z "$got" ]; then echo "README.md has no C block under '## A short example'" >&2; exit 1; fi
if ! diff <(printf '%s\n' "$got") "$src/examples/minimal.c" >/dev/null; then
  echo "README.md's example differs from examples/minimal.c:" >&2
  diff <(printf '%s\n' "$got") "$src/examples/minimal.c" | head -20 >&2
  exit 1
fi
echo "README example = examples/minimal.c"
