#!/usr/bin/env bash
# The doctor end to end (docs/DOCTOR.md): a real epcomm program that skips its destroy is run
# under `epcomm doctor run`; the doctor must find the exit-phase warnings and name the missing
# ep_buffer_destroy / ep_group_destroy with their fix. The fixed program then passes
# `epcomm doctor verify` against the first run: clean, same exit status, time within noise.
# Usage: tests/test_doctor_e2e.sh BUILD_DIR
set -u
b=${1:?usage: test_doctor_e2e.sh BUILD_DIR}
e=$b/bin/epcomm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
say() { echo "test_doctor_e2e.sh: $*" >&2; fail=1; }

"$e" doctor run --json -- "$e" launch -n 2 "$b/tests/leaky" leak >"$tmp/before.json" 2>"$tmp/before.err"
python3 - "$tmp/before.json" 2>"$tmp/diag.err" <<'PY' ||
import json, sys
r = json.load(open(sys.argv[1]))
s = json.dumps(r)
for cause in ("epcomm-buffer-not-destroyed", "epcomm-group-not-destroyed"):
    assert cause in s, cause + " not named"
assert "ep_buffer_destroy" in s, "fix does not name ep_buffer_destroy"
phases = {g["cause_id"]: g["phase"] for g in r["groups"]}
for cause in ("epcomm-buffer-not-destroyed", "epcomm-group-not-destroyed"):
    assert phases.get(cause) == "exit", cause + " phased " + str(phases.get(cause))
assert r["warnings_exit"] == 4 and r["warnings_run"] == 0, "counts by phase: %d init, %d run, %d exit" % (
    r["warnings_init"], r["warnings_run"], r["warnings_exit"])
assert r["end_of_work"]["kind"] == "test result", "end of work not found"
PY
  say "doctor run on the leaky program: wrong diagnosis: $(tail -1 "$tmp/diag.err"); the run:
$(cat "$tmp/before.err")"
"$e" doctor verify --baseline "$tmp/before.json" -- "$e" launch -n 2 "$b/tests/leaky" \
  >"$tmp/verify.out" 2>&1 || say "verify of the fixed program did not say clean: $(cat "$tmp/verify.out")"
grep -q "clean" "$tmp/verify.out" || say "verify output lacks the verdict: $(cat "$tmp/verify.out")"
"$e" doctor verify --baseline "$tmp/before.json" -- "$e" launch -n 2 "$b/tests/leaky" leak \
  >"$tmp/verify2.out" 2>&1 && say "verify called the leaky program clean"
exit $fail
