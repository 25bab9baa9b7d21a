#!/usr/bin/env bash
# The shared library exports exactly the public API: every dynamic symbol libepcomm.so defines is
# an ep_* function declared with EP_API in include/epcomm.h, and every such function is exported.
# Backend symbols (cpu_*, cuda_*, epk_*) and the core's internal ep_* functions (ep_reg_*,
# ep_boot_*, ...) must stay hidden: a user could otherwise link against them.
# Usage: tests/test_symbols.sh BUILD_DIR HEADER    (exit 0 pass; 1 fail, offenders on stderr)
set -u
b=${1:?usage: test_symbols.sh BUILD_DIR HEADER}
header=${2:?usage: test_symbols.sh BUILD_DIR HEADER}
lib=$b/libepcomm.so
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
say() { echo "test_symbols.sh: $*" >&2; fail=1; }

[ -e "$lib" ] || { say "$lib was not built"; exit 1; }
nm -D --defined-only "$lib" >"$tmp/nm" || { say "nm -D failed on $lib"; exit 1; }
awk '{ print $NF }' "$tmp/nm" | sort -u >"$tmp/exported"

# The declarations as the compiler sees them (comments gone, EP_API expanded), read a statement
# at a time: a function's name is the first identifier followed by '(' after the attribute.
mark='__attribute__((visibility("default")))'
"${CC:-cc}" -E -P -x c "$header" >"$tmp/pp" || { say "cannot preprocess $header"; exit 1; }
awk -v mark="$mark" 'BEGIN { RS = ";" }
  { i = index($0, mark); if (!i) next
    s = substr($0, i + length(mark))
    if (match(s, /[A-Za-z_][A-Za-z0-9_]*[ \t\n]*\(/)) {
      name = substr(s, RSTART, RLENGTH); sub(/[ \t\n]*\($/, "", name); print name } }' \
  "$tmp/pp" | sort -u >"$tmp/declared"
[ -s "$tmp/declared" ] || { say "found no EP_API declaration in $header"; exit 1; }

report() { # file message: names the offenders, one a line
  [ -s "$1" ] || return 0
  say "$2 ($(wc -l <"$1")):"
  sed 's/^/    /' "$1" >&2
}
grep -v '^ep_' "$tmp/exported" >"$tmp/not_ep"
grep '^ep_' "$tmp/exported" | comm -23 - "$tmp/declared" >"$tmp/undeclared"
comm -13 "$tmp/exported" "$tmp/declared" >"$tmp/missing"
report "$tmp/not_ep" "$lib exports symbols outside the ep_ namespace"
report "$tmp/undeclared" "$lib exports ep_* symbols that $header does not declare with EP_API"
report "$tmp/missing" "$header declares functions that $lib does not export"
exit $fail
