#!/usr/bin/env bash
# Run the argument-space fuzzer for a bounded time and report how many inputs it executed.
# Usage: tests/fuzz/run.sh FUZZ_BUILD_DIR SECONDS       (exit 0: no crash, no sanitizer report)
set -u
dir=${1:?usage: run.sh FUZZ_BUILD_DIR SECONDS}
secs=${2:-60}
bin=$dir/tests/fuzz_args
[ -x "$bin" ] || { echo "skipped: fuzz target not built (needs clang with libFuzzer)"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus"
# -rss_limit_mb: a leak or runaway allocation fails the run; -timeout: a hang does.
"$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work/corpus" >"$work/log" 2>&1
rc=$?
execs=$(grep -E '^stat::number_of_executed_units' "$work/log" | awk '{print $2}')
if [ $rc != 0 ]; then
  echo "fuzz_args: failed (exit $rc) after ${execs:-?} executions" >&2
  grep -E 'ERROR|SUMMARY|runtime error|==[0-9]+==' "$work/log" | head -20 >&2
  ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* 2>/dev/null | head -3 | while read -r f; do
    echo "reproducer: $(xxd -p "$f" | tr -d '\n' | head -c 400)" >&2; done
  exit 1
fi
echo "fuzz_args: ${execs:-?} executions in ${secs}s, no crash, no sanitizer report"
