#!/usr/bin/env bash
# Runs a test program with a CUDA trace switched on (EP_CUDA_TRACE / EP_CUDA_LL_TRACE, set by the
# caller): the trace is a requested diagnostic on stderr, so here stderr is captured, must hold
# trace lines and nothing else, and is shown on stdout. Usage: test_trace.sh PROGRAM ARGS...
set -u
err=$(mktemp)
"$@" 2>"$err"
rc=$?
cat "$err"
other=$(grep -v '^epcomm \(ll \)\?trace rank ' "$err")
rm -f "$err"
[ "$rc" = 0 ] || exit "$rc"
if [ -n "$other" ]; then echo "unexpected stderr: $other" >&2; exit 1; fi
exit 0
