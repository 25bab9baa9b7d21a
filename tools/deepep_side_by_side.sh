#!/usr/bin/env bash
# epcomm and DeepEP V1 side by side on one GPU machine, in one bounded command (issue 15 item 5,
# issue 12 item 8): builds DeepEP from a source tree, times it with tools/deepep_time.py (our
# harness: DeepEP's public calls, CUDA events) and `epcomm bench --backend cuda` at the same sizes
# and SMs per rank, ranks as processes on one GPU under MPS, then prints one table of ratios.
#
#   tools/deepep_side_by_side.sh WITH_MPS OUT_DIR DEEPEP_SRC [STEP...]
#   steps (default: build normal ll report):
#     build   epcomm (build-gpu/, as tools/gpu_check.sh) and DeepEP (a copy of DEEPEP_SRC built in
#             build-deepep/, skipped when that copy is already built from the same sources)
#     normal  intranode normal mode: R:SMs in $DS_NORMAL (default "2:24 4:24 8:16"), tokens in
#             $DS_TOKENS (default "4096 512 128"), H 7168, topk 8, E 256
#     ll      low-latency mode: R in $DS_LL (default "2 4 8"), $DS_LL_TOKENS tokens (128), H 7168,
#             topk 8, E 288 (rounded down to a multiple of R); DeepEP with its receive hook (send
#             kernel, then the hook's receive kernel); if R=2 does not finish, once more with
#             CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/R, then gives up on DeepEP's low-latency mode
#             ($DS_LL_ONE_KERNEL=1 also tries DeepEP's one-kernel form at R=2, bounded)
#     python  epcomm's Python package at the normal sizes (bench/py_combine_input.py: the experts'
#             write + combine from a plain tensor, a Buffer.mem_pool tensor, the combine buffer;
#             JSON per size), which the report sets against DeepEP's write + combine
#     report  the table (also in OUT_DIR/table.txt)
# Every run is bounded by `timeout`; logs: OUT_DIR/{epcomm,deepep}-*.log, and epcomm-*.json (one
# `epcomm bench --json` per size and dtype), which the report reads; nothing in the repository or
# in DEEPEP_SRC is modified (DeepEP is built in a copy).
# DeepEP's build: setup.py finds NVSHMEM through the nvidia-nvshmem wheel (low-latency kernels
# need it); DS_NVSHMEM=0 builds without it (normal mode only; DeepEP 567632d built so does not
# import: deep_ep_cpp lacks internode_ll::update_mask_buffer, seen on an H100 in the twenty-first
# session). Build flags as seen working on the
# H200 image (../shared/gpu/README.md): CPATH/NVCC_APPEND_FLAGS -I/usr/local/cuda/include/cccl,
# TORCH_CUDA_ARCH_LIST=9.0.
set -u -o pipefail
mps=${1:?usage: deepep_side_by_side.sh WITH_MPS OUT_DIR DEEPEP_SRC [STEP...]}
out=${2:?usage: deepep_side_by_side.sh WITH_MPS OUT_DIR DEEPEP_SRC [STEP...]}
src=${3:?usage: deepep_side_by_side.sh WITH_MPS OUT_DIR DEEPEP_SRC [STEP...]}
shift 3
steps=${*:-build normal ll report}
mkdir -p "$out"
out=$(cd "$out" && pwd)
src=$(cd "$src" && pwd) || exit 2
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
b=build-gpu
. tools/gpu_steps.sh
dbuild=$root/build-deepep
py=${PYTHON:-python3}
export EP_TIMEOUT_S=${EP_TIMEOUT_S:-20}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
normal_sets=${DS_NORMAL:-2:24 4:24 8:16}
tokens=${DS_TOKENS:-4096 512 128}
ll_ranks=${DS_LL:-2 4 8}
ll_tokens=${DS_LL_TOKENS:-128}

deepep() { # LOG TIMEOUT [VAR=VALUE...] -- deepep_time.py args
  local log=$1 t=$2
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  timeout -k 10 "$t" "$mps" env PYTHONPATH="$dbuild/src${PYTHONPATH:+:$PYTHONPATH}" ${envs[@]+"${envs[@]}"} \
    "$py" tools/deepep_time.py "$@" >"$log" 2>&1
}

epbench() { # LOG TIMEOUT R epcomm-bench-args...
  local log=$1 t=$2 R=$3
  shift 3
  timeout -k 10 "$t" "$mps" $b/bin/epcomm launch -n "$R" $b/bin/epcomm bench --backend cuda "$@" \
    >"$log" 2>&1
}

summary() { # LOG: the lines a reader wants from a log
  grep -E '^(\[0\] )?(deepep|dispatch|combine|check|note|graph|overlap)|DEEPEP|Error|error|Traceback|[Tt]imeout|FAILED' \
    "$1" | grep -v '^DEEPEP' | sed 's/^\[0\] //' | tail -"${2:-12}"
}

# sources_sum DIR FIND-ARGS...: a checksum of the files find selects in DIR (names and contents,
# in a fixed order), which names a tree whatever its git metadata says.
sources_sum() {
  (cd "$1" && shift && find "$@" | LC_ALL=C sort | xargs md5sum | md5sum | cut -c1-16)
}
for s in $steps; do
  t0=$SECONDS
  case $s in
    build)
      {
        # The device's copy of the tree may carry a stale git HEAD (uncommitted or newer work
        # copied over it): "-dirty" says so, and the sources' checksum names the tree itself
        # (the same command on a checkout tells whether it is the one that ran).
        echo "epcomm $(git -C "$root" describe --always --dirty 2>/dev/null):" \
          "$(git -C "$root" log -1 --format=%s 2>/dev/null | cut -c1-100)"
        echo "epcomm sources: checksum $(sources_sum "$root" src include tools tests python -type f \
          \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \))"
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
        "$py" -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
      } >"$out/meta.txt" 2>&1
      { cmake -S . -B $b -G Ninja -DEP_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
          ninja -C $b; } >"$out/build-epcomm.log" 2>&1 &
      epid=$!
      sum=$(sources_sum "$src" . -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o \
        -name '*.hpp' -o -name '*.py' -o -name '*.h' \) -not -path './build/*')
      echo "DeepEP source $src: checksum $sum" >>"$out/meta.txt"
      sum="$sum nvshmem=${DS_NVSHMEM:-1}" # a build of the other kind is not this one
      if [ -f "$dbuild/stamp" ] && [ "$(cat "$dbuild/stamp")" = "$sum" ] &&
        ls "$dbuild"/src/deep_ep_cpp*.so >/dev/null 2>&1; then
        echo "DeepEP: already built from these sources ($dbuild)"
      else
        rm -rf "$dbuild"
        mkdir -p "$dbuild/src"
        (cd "$src" && tar cf - --exclude=./build --exclude='*.so' .) | (cd "$dbuild/src" && tar xf -)
        (
          cd "$dbuild/src" || exit 1
          export CPATH=/usr/local/cuda/include/cccl${CPATH:+:$CPATH}
          export NVCC_APPEND_FLAGS="-I/usr/local/cuda/include/cccl ${NVCC_APPEND_FLAGS:-}"
          export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
          if [ "${DS_NVSHMEM:-1}" = 0 ]; then # setup.py's NVSHMEM lookup made to fail
            timeout 400 "$py" -c 'import importlib.util as u, runpy, sys
f = u.find_spec
u.find_spec = lambda n, *a: None if n.startswith("nvidia.nvshmem") else f(n, *a)
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")'
          else
            timeout 400 "$py" setup.py build_ext --inplace
          fi
        ) >"$out/build-deepep.log" 2>&1
        if ls "$dbuild"/src/deep_ep_cpp*.so >/dev/null 2>&1; then
          echo "$sum" >"$dbuild/stamp"
          echo "DeepEP: built ($(grep -m1 -o 'NVSHMEM path: .*' "$out/build-deepep.log"))"
        else
          echo "DeepEP: build FAILED"; tail -25 "$out/build-deepep.log"
        fi
      fi
      wait $epid || { echo "epcomm: build FAILED"; tail -30 "$out/build-epcomm.log"; exit 1; }
      echo "epcomm: built" ;;
    normal)
      for rs in $normal_sets; do
        R=${rs%%:*} S=${rs#*:}
        deepep "$out/deepep-normal-r$R.log" 240 -- normal --ranks "$R" --sms "$S" \
          --tokens "$(echo $tokens | tr ' ' ,)"
        echo "DeepEP normal R=$R, $S SMs: exit $?"
        summary "$out/deepep-normal-r$R.log" 5
        for N in $tokens; do
          for dt in bf16 fp8; do
            epbench "$out/epcomm-normal-r$R-t$N-$dt.log" 120 "$R" --sms "$S" --tokens "$N" \
              --dtype $dt --iters 30 --json "$out/epcomm-normal-r$R-t$N-$dt.json"
            echo "epcomm normal R=$R, $S SMs, $N tokens, $dt: exit $?"
          done
        done
      done ;;
    ll)
      pct=""
      for R in $ll_ranks; do
        for dt in bf16 fp8; do
          epbench "$out/epcomm-ll-r$R-t$ll_tokens-$dt.log" 90 "$R" --mode ll --tokens "$ll_tokens" \
            --dtype $dt --json "$out/epcomm-ll-r$R-t$ll_tokens-$dt.json"
          echo "epcomm low-latency R=$R, $ll_tokens tokens, $dt: exit $?"
        done
        [ "$pct" = none ] && continue
        envs=()
        [ -n "$pct" ] && envs=(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / R)))
        deepep "$out/deepep-ll-r$R.log" 90 ${envs[@]+"${envs[@]}"} -- ll --ranks "$R" --tokens "$ll_tokens"
        rc=$?
        echo "DeepEP low-latency R=$R (receive hook${pct:+, MPS thread percentage $((100 / R))}): exit $rc"
        summary "$out/deepep-ll-r$R.log" 4
        if [ $rc != 0 ] && [ "$R" = "$(echo $ll_ranks | cut -d' ' -f1)" ]; then
          if [ -z "$pct" ]; then
            pct=1
            mv "$out/deepep-ll-r$R.log" "$out/deepep-ll-r$R-nolimit.failed"
            deepep "$out/deepep-ll-r$R.log" 90 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / R)) -- \
              ll --ranks "$R" --tokens "$ll_tokens"
            rc=$?
            echo "DeepEP low-latency R=$R (receive hook, MPS thread percentage $((100 / R))): exit $rc"
            summary "$out/deepep-ll-r$R.log" 4
          fi
          [ $rc != 0 ] && pct=none && echo "DeepEP low-latency: does not run here; not tried at R > $R"
        fi
      done
      if [ "${DS_LL_ONE_KERNEL:-0}" = 1 ]; then
        deepep "$out/deepep-ll-onekernel-r2.log" 45 -- ll --ranks 2 --tokens "$ll_tokens" --hook 0
        echo "DeepEP low-latency R=2, one kernel per call: exit $?"
        summary "$out/deepep-ll-onekernel-r2.log" 3
      fi ;;
    python)
      # epcomm's Python package from PyTorch (bench/py_combine_input.py): the experts' write +
      # combine from a plain tensor, a Buffer.mem_pool tensor and the combine buffer, and the
      # worst-case dispatch into plain / pool tensors, per R:SMs and tokens as `normal`, combined
      # without weights as DeepEP's harness combines; the package is installed into $py first.
      install_pkg python "$py" "$out/pip.log"
      py_layer_steps "$mps" "$py" "$out" "$normal_sets" "$tokens" ;;
    report)
      "$py" tools/deepep_time.py report "$out" | tee "$out/table.txt" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
  echo "== step $s: $((SECONDS - t0)) s"
done
