#!/usr/bin/env bash
# Every C file of a build compiled again under another compiler configuration, with the build's
# own warnings (-Werror):
#   clang  clang, -fsyntax-only (seconds). The suite's builds use gcc (plus clang for the fuzz
#          target, without the CUDA backend), and the two compilers warn about different things
#          (e.g. clang rejects a uint64_t * where an unsigned long long * is wanted, which gcc
#          accepts).
#   O3     gcc at -O3, objects thrown away. gcc's flow warnings (maybe-uninitialized) depend on
#          the optimiser: a CMAKE_BUILD_TYPE=Release build failed on one that the suite's -O2
#          builds never saw.
# Usage: tests/test_recompile.sh BUILD_DIR [clang|O3]   (exit 0 pass, 1 fail, 77 skipped without
# the compiler)
set -u -o pipefail
b=${1:?usage: test_recompile.sh BUILD_DIR [clang|O3]}
mode=${2:-clang}
case $mode in
  clang) cc=clang ;;
  O3) cc=gcc ;;
  *) echo "test_recompile.sh: mode clang or O3, not '$mode'" >&2; exit 1 ;;
esac
command -v $cc >/dev/null || { echo "skipped: $cc is not installed"; exit 77; }
[ -f "$b/compile_commands.json" ] || { echo "test_recompile.sh: no $b/compile_commands.json" >&2; exit 1; }
list=$(mktemp)
trap 'rm -f "$list"' EXIT
python3 - "$b/compile_commands.json" "$mode" >"$list" <<'PY' || exit 1
import json, os, re, shlex, sys
mode = sys.argv[2]
if mode == "clang":
    head, tail = ["clang", "-Wno-unknown-warning-option", "-fsyntax-only"], []
else:  # the last -O wins; nothing written
    head, tail = ["gcc"], ["-O3", "-c", "-o", "/dev/null"]
n = 0
for e in json.load(open(sys.argv[1])):
    argv = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    while argv and os.path.basename(argv[0]) in ("ccache", "sccache", "distcc"):
        argv = argv[1:]  # a compiler launcher
    if not argv or not e["file"].endswith(".c") or \
            not re.fullmatch(r"(.*-)?(cc|gcc|clang)(-[\d.]+)?", os.path.basename(argv[0])):
        continue  # nvcc's kernels are not C
    out, skip = list(head), 0
    for a in argv[1:]:
        if skip:
            skip -= 1
        elif a in ("-o", "-MF", "-MT", "-MQ"):  # an object or a depfile, and its name
            skip = 1
        elif a not in ("-c", "-MD", "-MMD", e["file"]):
            out.append(a)
    out += tail + [e["file"]]
    cmd = "cd " + shlex.quote(e["directory"]) + " && " + " ".join(map(shlex.quote, out))
    sys.stdout.write(cmd + " || { echo 'test_recompile.sh: " + mode + " rejects " + e["file"] +
                     "' >&2; exit 1; }\0")
    n += 1
if not n:
    sys.exit("test_recompile.sh: no C compile command in " + sys.argv[1])
PY
n=$(tr -cd '\0' <"$list" | wc -c)
# Every file is tried (a failure exits 1: xargs goes on and exits 123 at the end).
xargs -0 -n 1 -P "$(getconf _NPROCESSORS_ONLN)" bash -c 'eval "$0"' <"$list" || exit 1
echo "$mode: all $n C files of the build compile with the build's warnings"
