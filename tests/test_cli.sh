#!/usr/bin/env bash
# The `epcomm` command line (issue 16 item 11, issue 11 item 3): usage and help of every
# command, `version`, `info` through the public registry, stdin to rank 0, and `bench`'s option
# errors (rank 0 only, with the valid range), progress on a terminal, legend and columns.
# usage: tests/test_cli.sh PATH/TO/epcomm      one line per check; exit 0 all passed, 1 otherwise
set -u
bin=${1:?usage: $0 path/to/epcomm}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

# check NAME WHY: passes when WHY is empty.
check() {
  if [ -z "$2" ]; then
    passed=$((passed + 1)); printf 'PASS %s\n' "$1"
  else
    failed=$((failed + 1)); printf 'FAIL %s: %s\n' "$1" "$2"
  fi
}

# run CMD...: stdout in $tmp/out, stderr in $tmp/err, status in $rc; bounded, so a hang fails.
run() {
  timeout -s KILL 60 "$@" >"$tmp/out" 2>"$tmp/err" </dev/null
  rc=$?
}
has() { grep -qE -- "$2" "$tmp/$1"; }
count() { grep -cE -- "$2" "$tmp/$1"; }
bench() { run "$bin" launch -n "$1" "$bin" bench "${@:2}"; }

# ---- top level
why=""
run "$bin"
[ "$rc" = 2 ] && has err '^usage: epcomm COMMAND' || why="no arguments: status $rc, want 2 and the usage on stderr"
run "$bin" --help
[ "$rc" = 0 ] || why="$why; --help: status $rc"
for want in '--grace S' '--no-tag' 'classify LOG' '\| rules' '^  version ' 'EP_TIMEOUT_S' \
            'launch --timeout S'; do
  has out "$want" || why="$why; usage lacks /$want/"
done
check "usage names every command and option" "$why"

why=""
run "$bin" version
[ "$rc" = 0 ] && has out '^epcomm [0-9]+\.[0-9]+\.[0-9]+$' || why="version: status $rc: $(cat "$tmp/out")"
v1=$(cat "$tmp/out")
run "$bin" --version
[ "$(cat "$tmp/out")" = "$v1" ] || why="$why; --version differs"
run "$bin" version --bogus
[ "$rc" = 2 ] || why="$why; version --bogus: status $rc"
check "epcomm version" "$why"

# ---- info: usage, and the library's registry through the public API
why=""
run "$bin" info --help
[ "$rc" = 0 ] && has out '^usage: epcomm info' && ! has out '^EP_LOG ' || why="--help: status $rc"
run "$bin" info --bogus
[ "$rc" = 2 ] && has err "unknown argument '--bogus'" && [ ! -s "$tmp/out" ] || why="$why; --bogus: status $rc"
check "info --help and a bad argument" "$why"

why=""
run "$bin" info
[ "$rc" = 0 ] && [ ! -s "$tmp/err" ] || why="status $rc, stderr $(cat "$tmp/err")"
for want in '^backends:' '^  cpu +available' '^  cuda ' '^EP_SPIN_US +cpu ' '^EP_CUDA_SMS +cuda ' \
            '^EP_LOCAL_RANK ' '^EP_QUEUE_BYTES +core +size +1M ' 'accepted: N\[K\|M\|G\] bytes' \
            '^EP_DOCTOR_RULES +doctor ' '^EP_BENCH_REFUSE +bench ' '^EP_BENCH_LL_FILL +bench '; do
  has out "$want" || why="$why; no line /$want/"
done
EP_QUEUE_BYTES=2X EP_LGO=1 run "$bin" info
[ "$rc" = 1 ] || why="$why; an invalid value: status $rc, want 1"
has out '^EP_QUEUE_BYTES .* 2X +<- INVALID' || why="$why; the invalid value is not flagged"
has out 'INVALID: environment variable EP_QUEUE_BYTES=2X: not a size; accepted: N\[K\|M\|G\] bytes in \[4K, 16G\]' ||
  why="$why; no reason with the accepted form"
has out '^unknown: EP_LGO is set' || why="$why; the unknown name is not flagged"
EP_QUEUE_BYTES=2M run "$bin" info
[ "$rc" = 0 ] && ! has out INVALID || why="$why; EP_QUEUE_BYTES=2M flagged"
check "info: the registry, invalid and unknown values" "$why"

# ---- demo and launch help
why=""
run "$bin" demo --help
[ "$rc" = 0 ] && has out '^usage: epcomm demo' || why="demo --help: status $rc"
run "$bin" launch -n 3 "$bin" demo --help
[ "$rc" = 0 ] && [ "$(count out 'usage: epcomm demo')" = 1 ] || why="$why; under launch: $rc, $(count out usage) usages"
run "$bin" launch -n 2 "$bin" demo --tokens 0
[ "$rc" = 2 ] && [ "$(count err 'epcomm demo:')" = 1 ] && has err "\[0\] epcomm demo: --tokens '0': want an integer from 1 to 65536" ||
  why="$why; --tokens 0: $rc: $(cat "$tmp/err")"
run "$bin" launch --help
[ "$rc" = 0 ] && has out 'EP_TIMEOUT_S' && has out '^stdin: rank 0' && has out '--grace S' ||
  why="$why; launch --help: $rc"
check "demo --help, demo options, launch --help" "$why"

# ---- stdin goes to rank 0 only (a pipe or a file; a terminal would stop a background rank)
why=""
printf 'a\nb\n' | timeout -s KILL 30 "$bin" launch -n 3 sh -c 'cat; echo "$EP_RANK end"' >"$tmp/out" 2>"$tmp/err"
rc=$?
[ "$rc" = 0 ] || why="status $rc"
[ "$(grep -c '^\[0\] [ab]$' "$tmp/out")" = 2 ] || why="$why; rank 0 did not get the input: $(cat "$tmp/out")"
grep -qE '^\[[12]\] [ab]$' "$tmp/out" && why="$why; another rank read the input"
[ "$(grep -c ' end$' "$tmp/out")" = 3 ] || why="$why; a rank did not reach EOF"
printf 'x\n' >"$tmp/in"
timeout -s KILL 30 "$bin" launch -n 2 cat <"$tmp/in" >"$tmp/out" 2>&1
[ "$(cat "$tmp/out")" = "[0] x" ] || why="$why; < file: $(cat "$tmp/out")"
check "launch: stdin to rank 0" "$why"

# ---- bench: option errors come once, from rank 0, with the valid range
why=""
bench 4 --experts 3
[ "$rc" = 2 ] || why="status $rc, want 2"
[ "$(count err 'epcomm bench:')" = 1 ] || why="$why; $(count err 'epcomm bench:') messages, want 1: $(cat "$tmp/err")"
has err '^\[0\] epcomm bench: --experts 3: with 4 ranks and --topk 8, want a multiple of 4 from 8 to 65536' ||
  why="$why; not the real problem with its range: $(cat "$tmp/err")"
has err 'topk exceeds' && why="$why; still says --topk exceeds --experts"
check "bench --experts 3 on 4 ranks" "$why"

why=""
bench 3 --tokens abc
[ "$rc" = 2 ] && [ "$(count err 'epcomm bench:')" = 1 ] && [ "$(count err 'usage: epcomm bench')" = 1 ] ||
  why="status $rc; $(count err 'epcomm bench:') messages, $(count err 'usage:') usages"
has err "^\[0\] epcomm bench: --tokens 'abc': want an integer from 0 to 16777216$" || why="$why; no range"
bench 2 --mode fast
has err "epcomm bench: --mode 'fast': want one of normal\|ll$" || why="$why; --mode: $(head -1 "$tmp/err")"
bench 2 --topk
has err "epcomm bench: option --topk needs a value" || why="$why; --topk without a value"
bench 2 --hidden 100 --dtype fp8
has err "epcomm bench: --dtype fp8 needs --hidden a multiple of 128" || why="$why; fp8 hidden"
bench 2 --help
[ "$rc" = 0 ] && [ "$(count out 'usage: epcomm bench')" = 1 ] || why="$why; --help printed $(count out usage) times"
check "bench: bad options, rank 0 only, with ranges" "$why"

# ---- bench: legend, columns, cpu%
small=(--tokens 64 --hidden 256 --topk 4 --experts 16 --warmup 1 --iters 3 --baseline off)
cpus=$(nproc)
why=""
bench 3 "${small[@]}"
[ "$rc" = 0 ] && [ ! -s "$tmp/err" ] || why="status $rc; stderr $(cat "$tmp/err")"
legend=$(sed 's/^\[0\] //' "$tmp/out" | tr '\n' ' ')
[[ "$legend" == *"3 ranks on $cpus CPU"?" share $((cpus * 100))%"* ]] || [[ "$legend" == *"3 ranks on $cpus CPU share $((cpus * 100))%"* ]] ||
  why="$why; legend does not count this machine's CPUs"
[[ "$legend" == *"4 ranks on 2 cores"* ]] && why="$why; the fixed '4 ranks on 2 cores'"
hdr=$(grep -m1 'time ms: median' "$tmp/out"); row=$(grep -m1 '^\[0\] epcomm dispatch ' "$tmp/out")
hdr=${hdr#\[0\] }; row=${row#\[0\] }
h=${hdr%%p90]*}; r=${row%%]*}
[ $((${#h} + 4)) = $((${#r} + 1)) ] ||
  why="$why; the header's ']' at column $((${#h} + 4)), the figures' at $((${#r} + 1))"
awk -v max=$((cpus * 100)) '/^\[0\] +[0-9]+ +[0-9]+ +[0-9]+ / { if ($6 > max || $10 > max) bad = 1 }
  END { exit bad }' "$tmp/out" || why="$why; cpu% above $((cpus * 100))"
bench 2 --mode ll --tokens 16 --hidden 256 --topk 3 --experts 8 --warmup 1 --iters 2
[ "$rc" = 0 ] || why="$why; ll: status $rc"
has out "low-latency test counts" || why="$why; ll legend missing"
legend=$(sed 's/^\[0\] //' "$tmp/out" | tr '\n' ' ')
[[ "$legend" == *"Normal mode"* || "$legend" == *"rows received x row bytes"* ]] &&
  why="$why; the ll legend carries normal-mode text"
check "bench: legend, header, cpu%" "$why"

# ---- bench: progress on a terminal (script gives the launcher a pty), never with --json
if command -v script >/dev/null 2>&1; then
  why=""
  script -qec "$bin launch -n 2 $bin bench ${small[*]}" /dev/null </dev/null >"$tmp/tty" 2>&1
  grep -qa '^\[0\] epcomm bench: normal mode, warm-up and timed: 4 iterations' "$tmp/tty" ||
    why="no progress on a terminal: $(head -3 "$tmp/tty")"
  grep -qa '^\[1\] epcomm bench: normal mode' "$tmp/tty" && why="$why; rank 1 shows progress"
  script -qec "$bin launch -n 2 $bin bench ${small[*]} --json" /dev/null </dev/null >"$tmp/tty" 2>&1
  grep -qa 'warm-up and timed' "$tmp/tty" && why="$why; progress with --json"
  check "bench: progress on a terminal only" "$why"
else
  printf 'SKIP bench: progress on a terminal (no `script` to make a terminal)\n'
fi

# ---- the CLI uses the public API only: no src/ header, no library symbol that libepcomm.so does
# not export (the tool links the static archive, where hidden symbols would still resolve)
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$(dirname "$bin")/.." && pwd)
why=""
grep -lE '#include "(core|cpu|cuda)/' "$here"/../tools/*.[ch] >"$tmp/inc" && why="includes src/: $(cat "$tmp/inc")"
objs=("$build"/tools/CMakeFiles/epcomm_cli.dir/*.o)
if [ -f "$build/libepcomm.so" ] && [ -f "${objs[0]}" ] && command -v nm >/dev/null; then
  nm -D --defined-only "$build/libepcomm.so" | awk '{ print $3 }' | sort -u >"$tmp/exported"
  for o in "${objs[@]}"; do nm -u "$o"; done | awk '$2 ~ /^ep_/ && $2 !~ /^ep_cmd_/ { print $2 }' |
    sort -u >"$tmp/used"
  extra=$(comm -23 "$tmp/used" "$tmp/exported" | tr '\n' ' ')
  [ -z "$extra" ] || why="$why; internal symbols used: $extra"
fi
check "CLI: public API only" "$why"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
