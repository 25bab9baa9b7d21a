#!/usr/bin/env bash
# DeepEP's own test programs, run against epcomm.deep_ep on the GPU machine (one H200 shared by
# several ranks under MPS: ../shared/gpu/README.md), and the Python suite's CUDA variants.
#
# Usage (from the repository root): tools/deepep_compat.sh DEEPEP_DIR [STAGE...]
#   DEEPEP_DIR  a DeepEP source checkout of the V1 layout (tests/test_intranode.py,
#               tests/test_low_latency.py, tests/utils.py: before its 2026-04 "EPv2" release)
#   STAGE       build        pip install . into $PYTHON's environment (no network: torch,
#                            scikit-build-core and pytest must be there; --no-build-isolation)
#               pytest       python -m pytest tests/python (CPU and CUDA variants), under MPS
#               intranode    DeepEP's tests/test_intranode.py, once per rank count in $NPROCS
#               low_latency  DeepEP's tests/test_low_latency.py, likewise
#               patch        only copy and change DeepEP's tests (into $OUT/tests-gloo and
#                            $OUT/tests-nccl, the diffs beside them)
#               (default: build pytest intranode low_latency; each run is bounded by $TIMEOUT; split the stages over several
#               commands when one command may not run longer than 10 minutes)
#
# DeepEP's files are copied and changed only where they must be, at run time (nothing of DeepEP
# is committed here): `import deep_ep` becomes `import epcomm.deep_ep as deep_ep`, and
# init_dist() puts every rank on GPU 0 (DeepEP wants one GPU per rank). NCCL refuses two ranks of
# one communicator on one GPU, so the process group is either gloo (PG=gloo) or NCCL with every
# rank claiming its own host (PG=nccl: NCCL_HOSTID per rank, sockets over loopback). The default
# is gloo for test_intranode.py and nccl for test_low_latency.py, whose
# all_gather_into_tensor into a [ranks][tokens][topk] tensor gloo refuses. Each DeepEP run goes
# through `epcomm doctor verify`, so its log also says whether anything was printed at exit.
#
# Environment: OUT (logs; default ./deepep-compat), PYTHON (python3), NPROCS ("2 4"), PG (both),
# TIMEOUT (seconds per run, 420), WITH_MPS (default ../shared/gpu/with-mps, else
# shared/gpu/with-mps, else none), INTRANODE_ARGS, LL_ARGS (extra arguments of the programs).
# Ends with a summary (also $OUT/summary.txt); exit status 0 when every run passed.
# The stages are called as "stage_$s":
# shellcheck disable=SC2317
set -u
deepep=$(cd "${1:?usage: tools/deepep_compat.sh DEEPEP_DIR [build|pytest|intranode|low_latency]...}" && pwd) || exit 2
shift
stages=${*:-build pytest intranode low_latency}
repo=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$PWD/deepep-compat}
PYTHON=${PYTHON:-python3}
NPROCS=${NPROCS:-2 4}
PG_INTRANODE=${PG:-gloo}
PG_LL=${PG:-nccl}
TIMEOUT=${TIMEOUT:-420}
mkdir -p "$OUT"
summary=$OUT/summary.txt
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }

if [ -z "${WITH_MPS:-}" ]; then
  for m in "$repo/../shared/gpu/with-mps" "$repo/shared/gpu/with-mps"; do
    [ -x "$m" ] && WITH_MPS=$m && break
  done
fi
mps=()
[ -n "${WITH_MPS:-}" ] && mps=("$WITH_MPS")

epcomm_cli() { "$PYTHON" -c "import epcomm; print(epcomm.cli_path())"; }

stage_build() {
  local log=$OUT/build.log
  (cd "$repo" && "$PYTHON" -m pip install --no-build-isolation --no-deps -v .) >"$log" 2>&1
  local st=$?
  "$PYTHON" -c "import epcomm, torch; print('epcomm', epcomm.__version__, 'cuda backend:',
epcomm.backend_available('cuda'), 'torch', torch.__version__)" >>"$log" 2>&1
  note "build: status $st; $(tail -n 1 "$log")"
  return "$st"
}

stage_pytest() {
  local log=$OUT/pytest.log
  (cd "$repo" && EP_TIMEOUT_S=${EP_TIMEOUT_S:-60} timeout "$TIMEOUT" "${mps[@]}" "$PYTHON" -m pytest \
    tests/python -q -rs -p no:cacheprovider) >"$log" 2>&1
  local st=$?
  note "pytest (CPU and CUDA variants): status $st; $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)"
  return "$st"
}

# patch_tests DIR PG: copies DeepEP's tests to DIR and changes them as the header says, for
# process group PG; fails when a change does not apply (another DeepEP version).
patch_tests() {
  local dir=$1 pg=$2
  rm -rf "$dir" && mkdir -p "$dir" && cp "$deepep"/tests/*.py "$dir"/ || return 1
  sed -i 's/^import deep_ep$/import epcomm.deep_ep as deep_ep  # epcomm compat: the changed import/' \
    "$dir/test_intranode.py" "$dir/test_low_latency.py"
  sed -i "s/torch\.cuda\.set_device(local_rank)/torch.cuda.set_device(0)  # epcomm compat: one GPU/" \
    "$dir/utils.py"
  if [ "$pg" = gloo ]; then
    sed -i "s/'backend': 'nccl',/'backend': 'gloo',  # epcomm compat: NCCL wants a GPU per rank/; \
s/if 'device_id' in sig.parameters:/if False:  # epcomm compat: gloo binds no device/" "$dir/utils.py"
  else
    sed -i "s/torch\.device(f'cuda:{local_rank}')/torch.device('cuda:0')/; \
s/^def init_dist(local_rank: int, num_local_ranks: int):$/&\n    os.environ['NCCL_HOSTID'] = f'epcomm-compat-{local_rank}'  # epcomm compat/" "$dir/utils.py"
  fi
  local ok=0
  grep -q '^import epcomm.deep_ep as deep_ep' "$dir/test_intranode.py" || ok=1
  grep -q '^import epcomm.deep_ep as deep_ep' "$dir/test_low_latency.py" || ok=1
  grep -q 'set_device(0)  # epcomm compat' "$dir/utils.py" || ok=1
  grep -q 'epcomm compat: \(NCCL wants\|the changed\)\|NCCL_HOSTID' "$dir/utils.py" || ok=1
  diff -u "$deepep/tests" "$dir" >"$dir.diff"
  return $ok
}

# run_deepep NAME PROGRAM PG NPROCS ARGS...: one DeepEP program under doctor verify.
run_deepep() {
  local name=$1 prog=$2 pg=$3 n=$4 log=$OUT/$1.r$4.log
  shift 4
  local t0=$SECONDS
  patch_tests "$OUT/tests-$pg" "$pg" ||
    { note "$name: a change of DeepEP's tests did not apply (see $OUT/tests-$pg.diff)"; return 1; }
  (cd "$OUT/tests-$pg" && env -u RANK -u WORLD_SIZE -u LOCAL_RANK MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$((29500 + RANDOM % 2000)) NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
    NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 EP_TIMEOUT_S="${EP_TIMEOUT_S:-120}" \
    "$(epcomm_cli)" doctor verify --log "$OUT/$name.r$n.stamped" -- \
    timeout "$TIMEOUT" "${mps[@]}" "$PYTHON" "$prog" --num-processes "$n" "$@") >"$log" 2>&1
  local st=$?
  local passed failed
  passed=$(grep -c ' passed' "$log")
  failed=$(grep -m 1 -E 'Error|assert|Traceback|Unsupported' "$log")
  note "$name, $n ranks ($pg): status $st after $((SECONDS - t0)) s; '$(grep -m 1 '^verdict' "$log")'; \
$passed 'passed' lines${failed:+; first error: $failed}"
  return "$st"
}

stage_intranode() {
  local st=0 n
  # shellcheck disable=SC2086
  for n in $NPROCS; do run_deepep intranode test_intranode.py "$PG_INTRANODE" "$n" ${INTRANODE_ARGS:-} || st=1; done
  return "$st"
}

stage_low_latency() {
  local st=0 n
  # shellcheck disable=SC2086
  for n in $NPROCS; do run_deepep low_latency test_low_latency.py "$PG_LL" "$n" ${LL_ARGS:-} || st=1; done
  return "$st"
}

dsha='(not a git checkout)' # a tree without .git would report the enclosing repository's commit
[ -e "$deepep/.git" ] && dsha=$(git -C "$deepep" rev-parse --short HEAD 2>/dev/null)
note "deepep_compat: DeepEP $dsha, \
epcomm $(git -C "$repo" rev-parse --short HEAD 2>/dev/null), ranks: $NPROCS, MPS: ${WITH_MPS:-none}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$summary" 2>&1
status=0
for s in $stages; do
  case $s in
    build) stage_build || status=1 ;;
    pytest) stage_pytest || status=1 ;;
    patch)
      for pg in gloo nccl; do
        if patch_tests "$OUT/tests-$pg" "$pg"; then
          note "DeepEP's tests for $pg: $OUT/tests-$pg.diff"
        else
          note "DeepEP's tests for $pg: a change did not apply"
          status=1
        fi
      done ;;
    intranode | low_latency) "stage_$s" || status=1 ;;
    *) note "unknown stage '$s'"; status=2 ;;
  esac
done
note "logs in $OUT"
exit $status
