#!/usr/bin/env bash
# ep_group_create_from_env with the environment of each launcher it knows, without the launcher:
# torchrun's (RANK, WORLD_SIZE, the job from MASTER_ADDR:MASTER_PORT or TORCHELASTIC_RUN_ID),
# mpirun's, and EP_JOB_ID overriding them; a rank without a job name is refused with a message
# naming the variable. The ranks run examples/minimal (checked, silent).
# Usage: tests/test_env_bootstrap.sh BUILD_DIR
set -u
b=${1:?usage: test_env_bootstrap.sh BUILD_DIR}
prog=$b/examples/minimal
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

# ranks N VAR=VALUE...: N ranks of the example, each with RANK_VAR set below and the given
# variables; no EP_* variable reaches them (the launcher's names must do). Returns the worst status.
ranks() {
  local n=$1 rank_var=$2 size_var=$3 pids=() st=0
  shift 3
  for ((r = 0; r < n; r++)); do
    env -u EP_RANK -u EP_NRANKS -u EP_JOB_ID -u EP_NOTIFY_FD "$rank_var=$r" "$size_var=$n" "$@" \
      EP_TIMEOUT_S=10 timeout -k 2 30 "$prog" >"$tmp/out.$r" 2>"$tmp/err.$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || st=$?; done
  return $st
}

check() { # name expected_status n rank_var size_var env...
  local name=$1 want=$2
  shift 2
  ranks "$@"
  local st=$?
  if [ "$st" != "$want" ]; then
    echo "FAIL $name: status $st, want $want: $(cat "$tmp"/err.* | head -c 400)"
    fail=1
  elif [ "$want" = 0 ] && [ -s "$tmp/err.0" ]; then
    echo "FAIL $name: wrote to stderr: $(head -c 400 "$tmp/err.0")"
    fail=1
  else
    echo "ok   $name"
  fi
}

port=$((20000 + RANDOM % 20000))
check "torchrun: MASTER_ADDR:MASTER_PORT" 0 3 RANK WORLD_SIZE MASTER_ADDR=127.0.0.1 \
  MASTER_PORT=$port TORCHELASTIC_RUN_ID=none
check "torchrun: TORCHELASTIC_RUN_ID" 0 2 RANK WORLD_SIZE TORCHELASTIC_RUN_ID=run-$$-$RANDOM
check "mpirun: OMPI_*" 0 2 OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE \
  OMPI_MCA_ess_base_jobid=job-$$-$RANDOM
check "EP_JOB_ID names the job of torchrun's ranks" 0 2 RANK WORLD_SIZE EP_JOB_ID=ep-$$-$RANDOM
# torchrun before SLURM: under srun every torchrun child has SLURM_PROCID 0.
check "torchrun inside srun" 0 2 RANK WORLD_SIZE SLURM_PROCID=0 SLURM_NTASKS=1 \
  SLURM_STEP_ID=7 TORCHELASTIC_RUN_ID=run-$$-$RANDOM
check "a rank without a job name" 1 1 RANK WORLD_SIZE
grep -q "no job id (EP_JOB_ID, torchrun's MASTER_ADDR and MASTER_PORT" "$tmp/err.0" ||
  { echo "FAIL message without a job name: $(cat "$tmp/err.0")"; fail=1; }
exit $fail
