#!/usr/bin/env bash
# Tests of `epcomm doctor`: the rulebook against log fixtures, run/verify end to end on shell
# commands, the rulebook loader's errors, and env on this machine.
# usage: tests/test_doctor_rules.sh PATH/TO/epcomm        exit 0 all passed, 1 otherwise
#
# Each tests/doctor/fixtures/NAME.log has NAME.expect: "end LINE KIND" (where the work ends) and
# one "LINE PHASE CAUSE-ID [WORD]" per warning line; WORD must appear in the fix. The doctor's
# `classify --lines` output must list exactly those warning lines, no more, no fewer.
set -u
bin=${1:?usage: $0 path/to/epcomm}
here=$(cd "$(dirname "$0")" && pwd)
export EP_DOCTOR_RULES=${EP_DOCTOR_RULES:-$here/../share/doctor-rules.txt}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

# result NAME START_NS STATUS [WHY]: one line per test, with its time.
result() {
  local ms=$(( ($(date +%s%N) - $2) / 1000000 ))
  if [ "$3" = 0 ]; then
    passed=$((passed + 1)); printf 'PASS %-40s (%d ms)\n' "$1" "$ms"
  else
    failed=$((failed + 1)); printf 'FAIL %-40s (%d ms): %s\n' "$1" "$ms" "${4:-}"
  fi
}

# Compares classify --lines with NAME.expect; prints the differences, returns 1 on any.
check_fixture() { # LOG [EXPECT]
  local log=$1 exp=${2:-${1%.log}.expect} out=$tmp/out bad=0
  "$bin" doctor classify --lines "$log" >"$out" || { echo "classify exited $?"; return 1; }
  local want_end got_end
  want_end=$(awk '$1 == "end" { $1 = ""; sub(/^ /, ""); print }' "$exp")
  got_end=$(awk -F'\t' '$1 == "end" { print $2 " " $3 }' "$out")
  if [ -n "$want_end" ] && [ "$want_end" != "$got_end" ]; then
    echo "end of work: want '$want_end', got '$got_end'"; bad=1
  fi
  grep -v '^#' "$exp" | awk 'NF >= 3 && $1 != "end" { print $1, $2, $3 }' | sort >"$tmp/want"
  awk -F'\t' '$1 != "end" { print $1, $2, $3 }' "$out" | sort >"$tmp/got"
  if ! diff "$tmp/want" "$tmp/got" >"$tmp/diff"; then
    echo "warning lines differ (< expected, > classified):"; sed 's/^/    /' "$tmp/diff"; bad=1
  fi
  while read -r line _ _ word; do
    [ -n "$word" ] || continue
    if ! awk -F'\t' -v l="$line" '$1 == l { print $4 }' "$out" | grep -qiF -- "$word"; then
      echo "line $line: fix does not mention '$word'"; bad=1
    fi
  done < <(grep -v '^#' "$exp" | awk 'NF >= 4 && $1 != "end"')
  return $bad
}

for log in "$here"/doctor/fixtures/*.log; do
  t0=$(date +%s%N)
  why=$(check_fixture "$log" 2>&1)
  rc=$? # before any other expansion: $(basename) in the next line would reset $?
  result "fixture $(basename "$log" .log)" "$t0" $rc "$why"
done

# The one-stream fixtures (*_tee.log: a `2>&1 | tee` capture) replayed through `run`: every line
# at once on stdout, then every line on stderr. Same phases as the file: only the order of the
# lines and what they say decide, never when they arrived or on which one stream.
for log in "$here"/doctor/fixtures/*_tee.log; do
  t0=$(date +%s%N)
  why=""
  for redirect in "" ">&2"; do
    "$bin" doctor run --log "$tmp/replay.log" -- sh -c "cat \"\$0\" $redirect" "$log" \
      >/dev/null 2>&1
    w=$(check_fixture "$tmp/replay.log" "${log%.log}.expect" 2>&1) || why="$why${redirect:-stdout}: $w; "
  done
  result "run, one stream: $(basename "$log" .log)" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"
done

# run: the command's own output passes through unchanged; a warning printed on stderr after the
# test summary is an exit-phase warning with the NCCL proxy cause; the status is the command's.
t0=$(date +%s%N)
cmd='echo "collected 2 items"; echo "===== 2 passed in 0.01s ====="; sleep 0.3
echo "host:7:8 [0] proxy.cc:1458 NCCL WARN [Service thread] Accept failed Resource temporarily unavailable" >&2
exit 3'
"$bin" doctor run --log "$tmp/run.log" -- sh -c "$cmd" >"$tmp/stdout" 2>"$tmp/stderr"
rc=$?
why=""
[ "$rc" = 3 ] || why="status $rc, want 3"
printf 'collected 2 items\n===== 2 passed in 0.01s =====\n' | cmp -s - "$tmp/stdout" || why="$why; stdout changed"
grep -q 'exit .* 1x  nccl-proxy-shutdown' "$tmp/stderr" || why="$why; no exit-phase nccl-proxy-shutdown in the report"
grep -q 'warnings: 0 init, 0 run, 1 exit' "$tmp/stderr" || why="$why; counts wrong"
result "run: NCCL warning after the summary" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

t0=$(date +%s%N)
"$bin" doctor run --json -- sh -c "$cmd" >"$tmp/run.json" 2>/dev/null
why=""
grep -q '"phase": "exit", "cause_id": "nccl-proxy-shutdown"' "$tmp/run.json" || why="no exit-phase line in JSON"
grep -q '"exit_status": 3,' "$tmp/run.json" || why="$why; exit_status"
if command -v python3 >/dev/null && ! python3 -m json.tool "$tmp/run.json" >/dev/null 2>&1; then why="$why; invalid JSON"; fi
result "run --json: phase and cause" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

# classify reads back what run --log wrote, timestamps and streams included.
t0=$(date +%s%N)
out=$("$bin" doctor classify --lines "$tmp/run.log" 2>&1)
printf '%s\n' "$out" | grep -q $'^3\texit\tnccl-proxy-shutdown' ; rc=$?
result "classify reads run --log" "$t0" $rc "$out"

# verify: the leaky command against its own baseline is not clean (1); a clean one is (0).
t0=$(date +%s%N)
"$bin" doctor verify --baseline "$tmp/run.json" -- sh -c "$cmd" >/dev/null 2>"$tmp/verify1"; rc1=$?
"$bin" doctor verify --baseline "$tmp/run.json" -- sh -c 'echo "===== 2 passed in 0.01s ====="; sleep 0.3' \
  >/dev/null 2>"$tmp/verify2"; rc2=$?
why=""
[ "$rc1" = 1 ] || why="leaky: status $rc1, want 1"
[ "$rc2" = 0 ] || why="$why; clean: status $rc2, want 0: $(cat "$tmp/verify2")"
grep -q 'exit warns *1 *0' "$tmp/verify2" || why="$why; before/after counts missing"
grep -q 'within noise' "$tmp/verify2" || why="$why; wall time not within noise"
result "verify: leaky 1, fixed 0" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

# The loader names the file and line of a mistake, and a missing rulebook is an error.
t0=$(date +%s%N)
printf 'rule a-b\ntool x\ncause c\nfix f\nmatch (\n' >"$tmp/bad.txt"
out=$(EP_DOCTOR_RULES=$tmp/bad.txt "$bin" doctor rules 2>&1); rc=$?
why=""
[ "$rc" = 2 ] && printf '%s' "$out" | grep -q "bad.txt:5: bad regular expression" || why="bad regex: $rc $out"
out=$(EP_DOCTOR_RULES=$tmp/none.txt "$bin" doctor classify "$log" 2>&1); rc=$?
[ "$rc" = 2 ] && printf '%s' "$out" | grep -q "none.txt" || why="$why; missing file: $rc $out"
result "rulebook errors" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

# env works on any machine (with or without GPU, NCCL, MPI) and says what it found about GPUs.
t0=$(date +%s%N)
out=$("$bin" doctor env 2>&1); rc=$?
why=""
[ "$rc" -le 1 ] || why="status $rc"
printf '%s' "$out" | grep -qE '^(gpu|cuda driver) ' || why="$why; no GPU line"
printf '%s' "$out" | grep -qE '^[0-9]+ OK, [0-9]+ WARN, [0-9]+ FAIL, [0-9]+ INFO$' || why="$why; no summary"
"$bin" doctor env --json >"$tmp/env.json"
if command -v python3 >/dev/null && ! python3 -m json.tool "$tmp/env.json" >/dev/null 2>&1; then why="$why; invalid JSON"; fi
result "env" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

# The GPU branch of env through a stand-in driver (tests/doctor/stub_driver.c): per-GPU checks,
# peer access per pair, NVML link types, and a driver without devices.
t0=$(date +%s%N)
cc=${CC:-cc}
if command -v "$cc" >/dev/null && "$cc" -shared -fPIC -o "$tmp/libcuda.so.1" "$here/doctor/stub_driver.c" \
     >"$tmp/cc.log" 2>&1; then
  cp "$tmp/libcuda.so.1" "$tmp/libnvidia-ml.so.1"
  stub_env() { LD_LIBRARY_PATH=$tmp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bin" doctor env 2>&1; }
  out=$(stub_env)
  why=""
  for want in '^cuda driver +OK +CUDA driver API 13\.0, 3 GPU' '^gpu 2 +OK +Stub GPU 2, 80\.0 GiB, sm_90' \
              '^peer 0<->1 +OK +peer access yes, NVLink$' '^peer 1<->2 +WARN +peer access no, PCIe across host'; do
    printf '%s\n' "$out" | grep -qE "$want" || why="$why; no line /$want/"
  done
  out=$(STUB_NO_DEVICE=1 stub_env)
  printf '%s\n' "$out" | grep -qE '^gpu +INFO .*no usable GPU: cuInit -> 100 CUDA_ERROR_NO_DEVICE' || why="$why; no-device case"
  result "env with a stand-in GPU driver" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"
else
  printf 'SKIP %-40s no C compiler to build the stand-in driver\n' "env with a stand-in GPU driver"
fi

# MPS: a process whose argv[0] is nvidia-cuda-mps-control plus the pipe directory's control pipe
# reads as a running daemon; the pipe without the daemon is stale.
t0=$(date +%s%N)
mkdir -p "$tmp/pipe" && mkfifo "$tmp/pipe/control"
( exec -a "$tmp/nvidia-cuda-mps-control" sleep 30 ) &
mps=$!
sleep 0.1
out=$(CUDA_MPS_PIPE_DIRECTORY=$tmp/pipe "$bin" doctor env 2>&1)
kill "$mps"; wait "$mps" 2>/dev/null
why=""
printf '%s\n' "$out" | grep -qE "^mps +OK +MPS control daemon running \(pid $mps\)" || why="daemon not seen"
out=$(CUDA_MPS_PIPE_DIRECTORY=$tmp/pipe "$bin" doctor env 2>&1)
printf '%s\n' "$out" | grep -qE '^mps +WARN .*exists but no nvidia-cuda-mps-control runs' || why="$why; stale pipe not seen"
result "env: MPS daemon and stale pipe" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

# Variables: a typo of an EP_ name, an empty CUDA_VISIBLE_DEVICES (FAIL, so env exits 1), P2P off.
t0=$(date +%s%N)
out=$(EP_LGO=info CUDA_VISIBLE_DEVICES= NCCL_P2P_DISABLE=1 EP_TIMEOUT_S=0.1 "$bin" doctor env 2>&1); rc=$?
why=""
[ "$rc" = 1 ] || why="status $rc, want 1"
for want in '^EP_LGO +WARN +=info: unknown EP_ variable' '^CUDA_VISIBLE_DEVICES +FAIL' \
            '^NCCL_P2P_DISABLE +WARN' '^EP_TIMEOUT_S +WARN'; do
  printf '%s\n' "$out" | grep -qE "$want" || why="$why; no line /$want/"
done
result "env: variables and bad values" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

# EP_* variables through the library's public registry (issue 11 item 3): the backends' own
# variables are known, invalid values FAIL with the accepted form (as group and buffer creation
# do), sizes take N[K|M|G] in both the library and --config-bytes, and the memfd segments are
# checked against RAM and the memory cgroup, not /dev/shm (issue 16 item 10).
t0=$(date +%s%N)
why=""
out=$(EP_CUDA_SMS=4 EP_SPIN_US=0 EP_LOCAL_RANK=0 EP_QUEUE_BYTES=2M EP_DOCTOR_RULES=$EP_DOCTOR_RULES \
      "$bin" doctor env 2>&1)
for want in '^EP_CUDA_SMS +INFO +=4: .*\(cuda\)$' '^EP_SPIN_US +INFO +=0: .*\(cpu\)$' \
            '^EP_LOCAL_RANK +INFO +=0: ' '^EP_QUEUE_BYTES +INFO +=2M: ' '^EP_DOCTOR_RULES +INFO .*\(doctor\)$' \
            '^shared memory +(OK|WARN|FAIL|INFO) +epcomm segments \(memfd\): .*RAM available' \
            '^/dev/shm .*not by epcomm'; do
  printf '%s\n' "$out" | grep -qE "$want" || why="$why; no line /$want/"
done
printf '%s\n' "$out" | grep -q 'unknown EP_ variable' && why="$why; a known variable called unknown"
out=$(EP_BACKEND=gpu EP_QUEUE_BYTES=1.5G "$bin" doctor env 2>&1); rc=$?
[ "$rc" = 1 ] || why="$why; invalid values: status $rc, want 1"
for want in '^EP_BACKEND +FAIL +environment variable EP_BACKEND=gpu: .*accepted: one of cpu\|cuda' \
            '^EP_QUEUE_BYTES +FAIL +environment variable EP_QUEUE_BYTES=1.5G: not a size; accepted: N\[K\|M\|G\]'; do
  printf '%s\n' "$out" | grep -qE "$want" || why="$why; no line /$want/"
done
"$bin" doctor env --config-bytes 2m >/dev/null 2>&1 || why="$why; --config-bytes 2m refused"
out=$("$bin" doctor env --config-bytes 1.5G 2>&1); rc=$?
[ "$rc" = 2 ] && printf '%s' "$out" | grep -q "config-bytes '1.5G'" || why="$why; --config-bytes 1.5G: $rc"
result "env: EP_* from the library's registry" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

# Jobs across hosts (issue 14 item 5): NCCL and Open MPI variables that name interfaces which do
# not exist here, lists Open MPI refuses, a split of ranks that cannot work.
t0=$(date +%s%N)
why=""
net_env() { env -u NCCL_SOCKET_IFNAME -u NCCL_HOSTID -u OMPI_MCA_btl -u OMPI_MCA_btl_tcp_if_include \
  -u OMPI_MCA_btl_tcp_if_exclude -u OMPI_MCA_oob_tcp_if_include -u OMPI_MCA_oob_tcp_if_exclude \
  "$@" "$bin" doctor env 2>&1; }
out=$(net_env NCCL_SOCKET_IFNAME=nosuch0 OMPI_MCA_btl_tcp_if_include=nosuch1 \
      OMPI_MCA_oob_tcp_if_include=lo,nosuch2 OMPI_MCA_btl=tcp,vader); rc=$?
[ "$rc" = 1 ] || why="status $rc, want 1"
for want in '^NCCL_SOCKET_IFNAME +FAIL +=nosuch0' 'fix: it matches no interface that is up here' \
            '^OMPI_MCA_btl_tcp_if_include +FAIL +=nosuch1: nosuch1 not here \(interfaces: .*lo' \
            '^OMPI_MCA_oob_tcp_if_include +WARN +=lo,nosuch2: nosuch2 not here' \
            '^OMPI_MCA_btl +FAIL .*without "self"'; do
  printf '%s\n' "$out" | grep -qE "$want" || why="$why; no line /$want/"
done
out=$(net_env NCCL_SOCKET_IFNAME=lo OMPI_MCA_btl_tcp_if_include=127.0.0.0/8 OMPI_MCA_oob_tcp_if_include=lo)
for want in '^NCCL_SOCKET_IFNAME +INFO' '^OMPI_MCA_btl_tcp_if_include +OK' '^OMPI_MCA_oob_tcp_if_include +OK'; do
  printf '%s\n' "$out" | grep -qE "$want" || why="$why; no line /$want/ (valid values)"
done
out=$(net_env OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_btl_tcp_if_exclude=lo)
printf '%s\n' "$out" | grep -qE '^OMPI_MCA_btl_tcp_if_include +FAIL .*both set' || why="$why; include and exclude"
out=$(net_env NCCL_HOSTID=a NCCL_IB_DISABLE=1)
n_ib=$(ls /sys/class/infiniband 2>/dev/null | wc -l)
want_ib=$([ "$n_ib" -gt 0 ] && echo WARN || echo INFO)
for want in '^NCCL_SOCKET_IFNAME +WARN +unset with NCCL_HOSTID' "^NCCL_IB_DISABLE +$want_ib "; do
  printf '%s\n' "$out" | grep -qE "$want" || why="$why; no line /$want/"
done
out=$(net_env EP_HOSTS=3 OMPI_COMM_WORLD_SIZE=4)
printf '%s\n' "$out" | grep -qE '^hosts +FAIL +EP_HOSTS=3 does not divide the 4 ranks' || why="$why; bad split"
result "env: NCCL and MPI variables across hosts" "$t0" "$([ -z "$why" ] && echo 0 || echo 1)" "$why"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
