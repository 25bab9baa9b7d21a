#!/usr/bin/env bash
# The build's C files also compile with clang under the same warnings (-Werror): the suite's
# builds use gcc (plus clang for the fuzz target, without the CUDA backend), and the two
# compilers warn about different things (e.g. clang rejects a uint64_t * where an
# unsigned long long * is wanted, which gcc accepts). Every C command of BUILD's
# compile_commands.json runs again with clang, -fsyntax-only (no objects: seconds, not minutes).
# Usage: tests/test_clang.sh BUILD_DIR   (exit 0 pass, 1 fail, 77 skipped without clang)
set -u
b=${1:?usage: test_clang.sh BUILD_DIR}
command -v clang >/dev/null || { echo "skipped: clang is not installed"; exit 77; }
[ -f "$b/compile_commands.json" ] || { echo "test_clang.sh: no $b/compile_commands.json" >&2; exit 1; }
python3 - "$b/compile_commands.json" <<'PY' | xargs -0 -n 1 -P "$(nproc)" bash -c 'eval "$0"'
import json, shlex, sys
for e in json.load(open(sys.argv[1])):
    argv = shlex.split(e["command"])
    if not argv[0].endswith(("/cc", "/gcc", "/clang", "cc", "gcc")) or not e["file"].endswith(".c"):
        continue  # nvcc's kernels are not C
    out, skip = ["clang", "-Wno-unknown-warning-option", "-fsyntax-only"], False
    for a in argv[1:]:
        if skip:
            skip = False
        elif a == "-o":
            skip = True
        elif a != "-c" and a != e["file"]:
            out.append(a)
    out.append(e["file"])
    cmd = "cd " + shlex.quote(e["directory"]) + " && " + " ".join(map(shlex.quote, out))
    sys.stdout.write(cmd + " || { echo 'test_clang.sh: clang rejects " + e["file"] + "' >&2; exit 255; }\0")
PY
rc=$?
[ $rc = 0 ] || exit 1
echo "clang: every C file of the build compiles with the build's warnings"
