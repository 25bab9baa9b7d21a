#!/usr/bin/env bash
# The test runner: runs every test of tests/TESTS, one line per test with its time, a total line
# "N passed, N failed, N skipped" at the end, exit 1 on any failure.
#
# A test fails when it exits non-zero (77 = skipped, with its reason), when it writes anything on
# stderr (any warning fails a test: a correct run is silent), or when it leaves an epcomm segment
# in /dev/shm. Usage: tests/run.sh [--filter REGEX] BUILD_DIR [BUILD_DIR...]
# With several build directories (e.g. build and build-asan) the suite runs once per directory,
# test names prefixed with the directory's name, and one total line ends the run.
set -u
filter=.
if [ "${1:-}" = "--filter" ]; then filter=$2; shift 2; fi
[ $# -ge 1 ] || { echo "usage: tests/run.sh [--filter REGEX] BUILD_DIR..." >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
pass=0 fail=0 skip=0 failed=()

shm_snapshot() { ls /dev/shm 2>/dev/null | grep -i epcomm | sort; }

run_one() { # name timeout command...
  local name=$1 tmo=$2; shift 2
  local out=$logs/${name##*/}.out err=$logs/${name##*/}.err before after rc t0 t1 dt reason
  before=$(shm_snapshot)
  t0=$(date +%s.%N)
  timeout -k 5 "$tmo" "$@" >"$out" 2>"$err" </dev/null
  rc=$?
  t1=$(date +%s.%N)
  dt=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  after=$(shm_snapshot)
  if [ "$rc" = 77 ]; then
    reason=$(grep -i 'skip' "$out" | tail -n 1)
    printf 'SKIP %-34s %6ss  %s\n' "$name" "$dt" "${reason:-skipped}"
    skip=$((skip + 1))
    return
  fi
  reason=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then reason="timed out after ${tmo}s"
  elif [ "$rc" != 0 ]; then reason="exit status $rc"
  elif [ -s "$err" ]; then reason="wrote to stderr (a correct run is silent)"
  elif [ "$before" != "$after" ]; then reason="left /dev/shm entries: $(comm -13 <(echo "$before") <(echo "$after") | tr '\n' ' ')"
  fi
  if [ -z "$reason" ]; then
    printf 'PASS %-34s %6ss\n' "$name" "$dt"
    pass=$((pass + 1))
  else
    printf 'FAIL %-34s %6ss  %s\n' "$name" "$dt" "$reason"
    sed -n '1,15p' "$err" | sed 's/^/     | /'
    fail=$((fail + 1))
    failed+=("$name")
  fi
}

# tests/TESTS: one test a line: NAME TIMEOUT_S RANKS COMMAND...   (RANKS "-": run directly;
# "once": run directly, only for the first build directory; a number: under
# `epcomm launch -n RANKS`). Commands run in BUILD_DIR; $SRC is the source tree.
run_suite() { # build_dir
  local build prefix name tmo ranks cmd
  build=$(cd "$1" && pwd) || return
  prefix=""
  [ "$nsuites" -gt 1 ] && prefix="$(basename "$build")/"
  logs=$build/test-logs
  mkdir -p "$logs"
  cd "$build" || return
  while read -r name tmo ranks cmd; do
    case "$name" in ""|\#*) continue ;; esac
    [[ "$name" =~ $filter ]] || continue
    cmd=${cmd//\$SRC/$here/..}
    # shellcheck disable=SC2086
    if [ "$ranks" = "once" ]; then # not per build directory: once per run, in the first
      [ "$1" = "$first_suite" ] && run_one "$name" "$tmo" $cmd
    elif [ "$ranks" = "-" ]; then
      run_one "$prefix$name" "$tmo" $cmd
    else
      run_one "$prefix$name" "$tmo" "$build/bin/epcomm" launch -n "$ranks" --timeout "$tmo" $cmd
    fi
  done < "$here/TESTS"
  cd - >/dev/null || return
}

nsuites=$#
first_suite=$1
t_start=$(date +%s)
for b in "$@"; do run_suite "$b"; done
echo "took $(( $(date +%s) - t_start ))s; logs in <build>/test-logs"
[ ${#failed[@]} -gt 0 ] && echo "failed: ${failed[*]}"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
