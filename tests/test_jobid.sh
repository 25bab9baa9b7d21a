#!/usr/bin/env bash
# Two SLURM jobs on one node (issue 16, item 2): jobs 1001 and 2002, both at step 0 with 2 tasks
# each, started at once, must form two separate groups (the rendezvous id is made of the job id
# and the step id, not the step id alone). Then two "jobs" whose ids collide (both 3003.0) but
# whose EP_JOB_SECRET differ: the secret keeps them apart; no group mixes them (one job may
# fail, with a clear error). Usage: tests/test_jobid.sh BUILD_DIR
set -u
b=${1:?usage: test_jobid.sh BUILD_DIR}
prog=$b/tests/test_jobid
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
say() { echo "test_jobid.sh: $*" >&2; fail=1; }

task() { # job step rank [secret]
  local secret=${4:-}
  env -u EP_JOB_ID -u EP_RANK -u EP_NRANKS -u EP_NOTIFY_FD -u EP_JOB_SECRET \
    -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u PMI_RANK -u PMI_SIZE \
    -u OMPI_MCA_ess_base_jobid -u PMIX_NAMESPACE \
    ${secret:+EP_JOB_SECRET=$secret} EP_TIMEOUT_S=5 SLURM_JOB_ID=$1 SLURM_STEP_ID=$2 SLURM_PROCID=$3 \
    SLURM_NTASKS=2 timeout 30 "$prog" >"$tmp/$1$secret.$3.out" 2>"$tmp/$1$secret.$3.err"
  echo $? >"$tmp/$1$secret.$3.rc"
}

task 1001 0 0 & task 2002 0 0 & task 1001 0 1 & task 2002 0 1 &
wait
for j in 1001 2002; do
  for r in 0 1; do
    rc=$(cat "$tmp/$j.$r.rc")
    [ "$rc" = 0 ] || say "job $j rank $r: exit $rc: $(cat "$tmp/$j.$r.out" "$tmp/$j.$r.err")"
    cat "$tmp/$j.$r.out"
  done
done

# Colliding ids, different secrets: never a mixed group (exit 1); failures name the cause.
task 3003 0 0 aaaa & task 3003 0 0 bbbb & task 3003 0 1 aaaa & task 3003 0 1 bbbb &
wait
for s in aaaa bbbb; do
  for r in 0 1; do
    rc=$(cat "$tmp/3003$s.$r.rc") out=$(cat "$tmp/3003$s.$r.out")
    case $rc in
      0) echo "collision, secret $s: $out" ;;
      2) echo "collision, secret $s: $out"
         echo "$out" | grep -q "EP_ERR_BOOTSTRAP\|EP_ERR_TIMEOUT\|EP_ERR_PEER_FAILED" ||
           say "secret $s rank $r: unclear failure: $out" ;;
      *) say "secret $s rank $r: exit $rc: $out $(cat "$tmp/3003$s.$r.err")" ;;
    esac
  done
done
exit $fail
