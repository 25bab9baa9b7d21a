# Shell functions shared by the GPU scripts (sourced by tools/gpu_check.sh and
# tools/deepep_side_by_side.sh; run from the repository root, with build-gpu built).

# install_pkg LABEL PYTHON LOG: this tree's package into PYTHON (the machine's, with PyTorch; no
# build isolation: nothing can be fetched there); on failure says so under LABEL, shows the log's
# end and returns 1.
install_pkg() {
  "$2" -m pip install --no-build-isolation --no-deps -q . >"$3" 2>&1 && return 0
  echo "$1: pip install FAILED"
  tail -20 "$3"
  return 1
}

# py_layer_steps WITH_MPS PYTHON OUT_DIR "R:SMS..." "TOKENS..."
# bench/py_combine_input.py (the Python layer step and the experts' write + combine) once per
# R:SMs and token count, combined without weights as DeepEP's harness combines; writes
# OUT_DIR/py-rR-tN.{log,json} (which tools/deepep_time.py report reads) and prints one line per
# run with its exit status.
py_layer_steps() {
  local mps=$1 py=$2 out=$3 sets=$4 toks=$5 rs R S N
  for rs in $sets; do
    R=${rs%%:*} S=${rs#*:}
    for N in $toks; do
      timeout -k 10 150 "$mps" build-gpu/bin/epcomm launch -n "$R" "$py" \
        bench/py_combine_input.py --sms "$S" --tokens "$N" --weights 0 \
        --json "$out/py-r$R-t$N.json" >"$out/py-r$R-t$N.log" 2>&1
      echo "py_combine_input R=$R, $S SMs, $N tokens: exit $?"
    done
  done
}
