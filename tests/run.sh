#!/usr/bin/env bash
# The test runner: runs every test of tests/TESTS, one line per test with its time, a total line
# "N passed, N failed, N skipped" at the end, exit 1 on any failure.
#
# A test fails when it exits non-zero (77 = skipped, with its reason), when it writes anything on
# stderr (any warning fails a test: a correct run is silent), or when it leaves an epcomm segment
# in /dev/shm. Usage: tests/run.sh BUILD_DIR [NAME_FILTER_REGEX]
set -u
build=${1:?usage: tests/run.sh BUILD_DIR [FILTER]}
filter=${2:-.}
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$build" && pwd)
logs=$build/test-logs
mkdir -p "$logs"
export EP_TEST_BUILD=$build EP_TEST_SRC=$here
export PATH=$build/bin:$PATH
pass=0 fail=0 skip=0 failed=()

shm_snapshot() { ls /dev/shm 2>/dev/null | grep -i epcomm | sort; }

run_one() { # name timeout command...
  local name=$1 tmo=$2; shift 2
  local out=$logs/$name.out err=$logs/$name.err before after rc t0 t1 dt reason
  before=$(shm_snapshot)
  t0=$(date +%s.%N)
  timeout -k 5 "$tmo" "$@" >"$out" 2>"$err" </dev/null
  rc=$?
  t1=$(date +%s.%N)
  dt=$(printf '%.1f' "$(echo "$t1 - $t0" | bc)")
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
# otherwise under `epcomm launch -n RANKS`). Commands run in BUILD_DIR; $SRC is the source tree.
cd "$build" || exit 1
t_start=$(date +%s)
while read -r name tmo ranks cmd; do
  case "$name" in ""|\#*) continue ;; esac
  [[ "$name" =~ $filter ]] || continue
  cmd=${cmd//\$SRC/$here/..}
  # shellcheck disable=SC2086
  if [ "$ranks" = "-" ]; then
    run_one "$name" "$tmo" $cmd
  else
    run_one "$name" "$tmo" "$build/bin/epcomm" launch -n "$ranks" --timeout "$tmo" $cmd
  fi
done < "$here/TESTS"

echo "took $(( $(date +%s) - t_start ))s; logs in $logs"
[ ${#failed[@]} -gt 0 ] && echo "failed: ${failed[*]}"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ]
