#!/usr/bin/env bash
# One test of tests/TESTS for CTest (tests/CMakeLists.txt registers every line). It runs through
# tests/run.sh, so the suite's rules hold under ctest too (output on stderr fails, so does a
# leftover in /dev/shm; run.sh's timeout), and run.sh's closing line becomes CTest's exit
# status: 0 passed, 77 skipped, 1 failed (or no test of that name).
# Usage: tests/ctest_one.sh NAME BUILD_DIR
set -u
name=${1:?usage: ctest_one.sh NAME BUILD_DIR}
build=${2:?usage: ctest_one.sh NAME BUILD_DIR}
here=$(cd "$(dirname "$0")" && pwd)
# run.sh takes a regex; test names are letters, digits, '_', '-' and '.', which must match itself.
exact="^${name//./\\.}\$"
out=$(bash "$here/run.sh" --filter "$exact" "$build")
printf '%s\n' "$out"
case "${out##*$'\n'}" in
  "1 passed, 0 failed, 0 skipped") exit 0 ;;
  "0 passed, 0 failed, 1 skipped") exit 77 ;;
  *) exit 1 ;;
esac
