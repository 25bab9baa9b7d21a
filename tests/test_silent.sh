#!/usr/bin/env bash
# Silent exit and logging (docs/SEMANTICS.md §7.3, §7.6):
#  - every example and a clean test program, under the launcher at the default log level, print
#    nothing on stderr, and nothing at all after their last epcomm call (test_lifecycle prints
#    LAST right after its final destroy; it must be the last line of every rank);
#  - EP_LOG=info and debug print lines tagged "host:pid:tid [rank r] phase" with the phases
#    init, run and teardown; EP_LOG_FILE sends them to a file and leaves stderr empty.
# Usage: tests/test_silent.sh BUILD_DIR     (exit 0 pass, 1 fail; silent when passing)
set -u
b=${1:?usage: test_silent.sh BUILD_DIR}
e=$b/bin/epcomm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
say() { echo "test_silent.sh: $*" >&2; fail=1; }

for ex in "$b"/examples/*; do
  [ -f "$ex" ] && [ -x "$ex" ] || continue
  "$e" launch -n 3 "$ex" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc = 0 ] || say "$(basename "$ex"): exit status $rc"
  [ -s "$tmp/err" ] && say "$(basename "$ex") wrote on stderr: $(head -3 "$tmp/err")"
done

"$e" launch -n 3 "$b/tests/test_lifecycle" silent >"$tmp/out" 2>"$tmp/err" ||
  say "test_lifecycle silent: exit status $?"
[ -s "$tmp/err" ] && say "stderr not empty at the default log level: $(head -3 "$tmp/err")"
for r in 0 1 2; do
  last=$(grep "^\[$r\] " "$tmp/out" | tail -n 1)
  [ "$last" = "[$r] LAST" ] || say "rank $r printed after its last epcomm call: '$last'"
done

EP_LOG=debug "$e" launch -n 2 "$b/tests/test_lifecycle" silent >"$tmp/out" 2>"$tmp/err" ||
  say "EP_LOG=debug run failed"
host=$(hostname)
for phase in init run teardown; do
  grep -Eq "^\[[01]\] epcomm: (info|debug): $host:[0-9]+:[0-9]+ \[rank [01]\] $phase: " "$tmp/err" ||
    say "EP_LOG=debug: no '$phase' line tagged host:pid:tid [rank r]"
done

EP_LOG=info EP_LOG_FILE="$tmp/log" "$e" launch -n 2 "$b/tests/test_lifecycle" silent \
  >"$tmp/out" 2>"$tmp/err" || say "EP_LOG_FILE run failed"
[ -s "$tmp/err" ] && say "EP_LOG_FILE set, yet stderr has: $(head -3 "$tmp/err")"
grep -q "\[rank 1\] teardown: " "$tmp/log" 2>/dev/null || say "EP_LOG_FILE has no teardown line"
exit $fail
