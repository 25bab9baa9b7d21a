#!/usr/bin/env bash
# Groups across (pretend) hosts, beyond the data matrices (tests/TESTS net.* lines): which
# libraries a job maps, bad splits into hosts, and a rank killed mid-run (tests/test_net.c).
# Usage: tests/test_net.sh BUILD_DIR [cuda]  (exit 0 pass, 1 fail, 77 skip; silent when passing)
# cuda: the parts that concern a backend's buffers (deaths, silent teardown, the bench) on the
# CUDA backend, NCCL between the pretend hosts on one GPU; skipped without a GPU.
set -u
b=${1:?usage: test_net.sh BUILD_DIR [cuda]}
mode=${2:-cpu}
epcomm=$b/bin/epcomm prog=$b/tests/test_net
command -v mpirun >/dev/null || { echo "skipped: no mpirun (Open MPI) for the MPI engine"; exit 77; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI's own allocations are never freed: not ours to report (sanitized builds).
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
say() { echo "test_net.sh: $*" >&2; fail=1; }
mpi() { timeout 60 mpirun -n "$1" --oversubscribe --bind-to none --mca btl self,vader "${@:2}"; }
if [ "$mode" = cuda ]; then
  export EP_BACKEND=cuda
  out=$("$prog" gpu 2>&1) || { echo "$out"; exit 77; }
fi

if [ "$mode" = cpu ]; then
# A job on one host never maps libmpi nor libnccl (under epcomm launch or mpirun alike); a job
# across hosts maps libmpi (the engine), still never libnccl.
"$epcomm" launch -n 3 "$prog" maps >"$tmp/o" 2>&1 || say "maps, one host: $(cat "$tmp/o")"
mpi 3 "$prog" maps >"$tmp/o" 2>&1 || say "maps, one host under mpirun: $(cat "$tmp/o")"
"$epcomm" launch -n 4 --hosts 2 "$prog" maps >"$tmp/o" 2>&1 || say "maps, 2 hosts: $(cat "$tmp/o")"
grep -q "2 host(s): libmpi mapped" "$tmp/o" || say "maps, 2 hosts: $(cat "$tmp/o")"

# Bad splits fail on every rank alike, naming the rule: each case lists the words of
# EP_HOST_ID per rank ("-": unset), the extra mpirun options, and what every rank must say.
split() { # expect args...
  local want=$1; shift
  mpi 4 "$@" >"$tmp/o" 2>&1
  local n; n=$(grep -c "$want" "$tmp/o")
  [ "$n" = 4 ] || say "hosts $*: $n of 4 ranks said '$want': $(head -c 600 "$tmp/o")"
}
split "hosts 2 (host" "$prog" hostid a a b b
split "hosts 2 (host" "$prog" hostid a b a b
split "status EP_ERR_SHAPE: .*host 1 (id:b) has 1 rank(s) and host 0 (id:a) has 3" \
  "$prog" hostid a a a b
split "status EP_ERR_INVALID_ARG: .*EP_HOST_ID is set on rank 0 ('a') but not on rank 3" \
  -x EP_HOSTS=2 "$prog" hostid a a b -
split "status EP_ERR_SHAPE: .*EP_HOSTS=3 does not divide the 4 ranks" -x EP_HOSTS=3 "$prog" hostid - - - -
"$epcomm" launch -n 4 --hosts 3 "$prog" maps >"$tmp/o" 2>&1
[ $? = 2 ] && grep -q "does not divide -n 4" "$tmp/o" || say "launch --hosts 3 -n 4: $(cat "$tmp/o")"
EP_HOSTS=2 "$epcomm" launch -n 2 "$prog" maps >"$tmp/o" 2>&1
grep -q "EP_HOSTS=2 splits the job into 2 hosts, which talk through MPI" "$tmp/o" ||
  say "EP_HOSTS without mpirun: $(cat "$tmp/o")"

# Calls that do not pair across hosts: a rejection, ranks in different calls, sizes that differ,
# a lost buffer handle: every rank fails at once, as on one host (tests/test_pairing.c).
for m in reject-create barrier-destroy barrier-gdestroy allgather-size bad-buffer; do
  "$epcomm" launch -n 4 --hosts 2 --timeout 60 "$b/tests/test_pairing" "$m" >"$tmp/o" 2>&1 ||
    say "pairing $m across hosts: $(head -c 800 "$tmp/o")"
done

fi

# Ranks killed before a round: every survivor, on its host and on the others, fails promptly
# naming a victim and its host. --enable-recovery: mpirun leaves the survivors running when a
# rank dies (by default it ends the job at once, and a survivor killed before it wrote its
# verdict read as a failure: a race). A whole host killed ("host"): nobody is left there to see
# the deaths, and the engine (MPI) reports none: with the heartbeats off the survivors fail at
# the group's deadline (3 s), naming a victim and its host; with them on ("beat", 1 s) the ranks
# watching that host find it silent and tell the others, long before a 60 s deadline.
kill_case() { # ranks hosts victims(comma-separated) [host|beat|ll]
  rm -rf "$tmp/k" && mkdir "$tmp/k"
  local hb=5 # the default; "host": off (found at the deadline), "beat": 1 s (found by them)
  case ${4:-} in host) hb=0 ;; beat) hb=1 ;; esac
  EP_HEARTBEAT_S=$hb mpi "$1" --enable-recovery -x EP_HOSTS="$2" -x EP_HEARTBEAT_S \
    ${EP_BACKEND:+-x EP_BACKEND} "$prog" kill "$3" "$tmp/k" ${4:-} >"$tmp/o" 2>&1
  local nv; nv=$(echo "$3" | tr ',' '\n' | wc -l)
  local got; got=$(cat "$tmp/k"/rank.* 2>/dev/null | grep -cE "detected death of rank (${3//,/|}) \(host")
  [ "$got" = $(($1 - nv)) ] ||
    say "kill $3 of $1 on $2 hosts: $got of $(($1 - nv)) survivors: $(cat "$tmp/k"/rank.* 2>/dev/null | head -c 600) $(grep -v 'PMIX ERROR' "$tmp/o" | head -c 800)"
}
kill_case 4 2 3
kill_case 6 3 4
kill_case 4 2 2,3 host # host 1 dies
kill_case 4 2 2,3 beat # the same, found by the heartbeats
kill_case 4 2 1 ll     # during low-latency calls
if [ "$mode" = cpu ]; then
  kill_case 4 2 0
  kill_case 6 3 0,1 host # host 0 dies
  kill_case 6 3 0,1 beat
fi

# Teardown is silent: a job across hosts that ends well prints nothing on stderr (no warning of
# Open MPI's at finalize, nor of the engines'), under epcomm launch and under mpirun alike, for
# both modes.
quiet() { # what command...
  local what=$1; shift
  "$@" >"$tmp/o" 2>"$tmp/e" || say "$what: $(head -c 600 "$tmp/o") $(head -c 600 "$tmp/e")"
  [ ! -s "$tmp/e" ] || say "$what: stderr is not empty: $(head -c 800 "$tmp/e")"
}
if [ "$mode" = cpu ]; then
  quiet "silent teardown, normal mode, launch" "$epcomm" launch -n 4 --hosts 2 "$prog" maps
  quiet "silent teardown, normal mode, mpirun" mpi 4 -x EP_HOSTS=2 "$prog" maps
  quiet "silent teardown, low-latency mode" "$epcomm" launch -n 4 --hosts 2 --timeout 60 \
    "$b/tests/test_ll" all 4
else # NCCL's and MPI's endpoints closed in order, nothing of theirs on stderr
  quiet "silent teardown, cuda normal mode, launch" "$epcomm" launch -n 4 --hosts 2 --timeout 100 \
    "$b/tests/test_normal"
  quiet "silent teardown, cuda normal mode, mpirun" mpi 4 -x EP_HOSTS=2 -x EP_BACKEND "$b/tests/test_normal"
  quiet "silent teardown, cuda low-latency mode" "$epcomm" launch -n 4 --hosts 2 --timeout 100 \
    "$b/tests/test_ll" all 4
fi

# epcomm bench --hosts: checked outputs (the combine in its hierarchical order, the MPI baseline's
# in its flat one), the bytes through the network and inside hosts next to the flat baseline's.
"$epcomm" launch -n 4 --hosts 2 --timeout 100 "$epcomm" bench --hosts 2 --tokens 64 --hidden 256 \
  --topk 4 --experts 16 --warmup 1 --iters 2 --variants main --backend "$mode" >"$tmp/o" 2>&1 ||
  say "bench --hosts 2: $(tail -c 800 "$tmp/o")"
for want in "4 ranks on 2 hosts" "epcomm dispatch (measured)" \
  "flat all-to-all combine (routing)" "bytes per (token, other host) pair" \
  "check: epcomm matches the reference on every rank; baseline matches"; do
  grep -q "$want" "$tmp/o" || say "bench --hosts 2: no '$want': $(tail -c 800 "$tmp/o")"
done
# Low-latency mode: the bytes through the network and inside hosts, measured (no flat baseline).
"$epcomm" launch -n 4 --hosts 2 --timeout 100 "$epcomm" bench --mode ll --hosts 2 --tokens 16 \
  --hidden 256 --topk 4 --experts 16 --warmup 1 --iters 2 --backend "$mode" >"$tmp/o" 2>&1 ||
  say "bench --mode ll --hosts 2: $(tail -c 800 "$tmp/o")"
for want in "low-latency mode (one row per selected expert" "epcomm dispatch (measured)" \
  "check: epcomm matches the reference on every rank"; do
  grep -q "$want" "$tmp/o" || say "bench --mode ll --hosts 2: no '$want': $(tail -c 800 "$tmp/o")"
done
exit $fail
