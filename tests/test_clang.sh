#!/usr/bin/env bash
# The build's C files also compile with clang under the same warnings (-Werror): the suite's
# builds use gcc (plus clang for the fuzz target, without the CUDA backend), and the two
# compilers warn about different things (e.g. clang rejects a uint64_t * where an
# unsigned long long * is wanted, which gcc accepts). Every C command of BUILD's
# compile_commands.json runs again with clang, -fsyntax-only (no objects, no depfiles: seconds).
# Usage: tests/test_clang.sh BUILD_DIR   (exit 0 pass, 1 fail, 77 skipped without clang)
set -u -o pipefail
b=${1:?usage: test_clang.sh BUILD_DIR}
command -v clang >/dev/null || { echo "skipped: clang is not installed"; exit 77; }
[ -f "$b/compile_commands.json" ] || { echo "test_clang.sh: no $b/compile_commands.json" >&2; exit 1; }
list=$(mktemp)
trap 'rm -f "$list"' EXIT
python3 - "$b/compile_commands.json" >"$list" <<'PY' || exit 1
import json, os, re, shlex, sys
n = 0
for e in json.load(open(sys.argv[1])):
    argv = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    while argv and os.path.basename(argv[0]) in ("ccache", "sccache", "distcc"):
        argv = argv[1:]  # a compiler launcher
    if not argv or not e["file"].endswith(".c") or \
            not re.fullmatch(r"(.*-)?(cc|gcc|clang)(-[\d.]+)?", os.path.basename(argv[0])):
        continue  # nvcc's kernels are not C
    out, skip = ["clang", "-Wno-unknown-warning-option", "-fsyntax-only"], 0
    for a in argv[1:]:
        if skip:
            skip -= 1
        elif a in ("-o", "-MF", "-MT", "-MQ"):  # an object or a depfile, and its name
            skip = 1
        elif a not in ("-c", "-MD", "-MMD", e["file"]):
            out.append(a)
    out.append(e["file"])
    cmd = "cd " + shlex.quote(e["directory"]) + " && " + " ".join(map(shlex.quote, out))
    sys.stdout.write(cmd + " || { echo 'test_clang.sh: clang rejects " + e["file"] + "' >&2; exit 1; }\0")
    n += 1
if not n:
    sys.exit("test_clang.sh: no C compile command in " + sys.argv[1])
PY
n=$(tr -cd '\0' <"$list" | wc -c)
# Every file is tried (a failure exits 1: xargs goes on and exits 123 at the end).
xargs -0 -n 1 -P "$(getconf _NPROCESSORS_ONLN)" bash -c 'eval "$0"' <"$list" || exit 1
echo "clang: all $n C files of the build compile with the build's warnings"
