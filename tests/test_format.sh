#!/usr/bin/env bash
# Every C, CUDA and header file of the tree follows .clang-format (clang-format's own output).
set -u
src=$(cd "$(dirname "$0")/.." && pwd)
cd "$src" || exit 1
command -v clang-format >/dev/null || { echo "skipped: clang-format is not installed"; exit 77; }
bad=()
while IFS= read -r f; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh' 2>/dev/null)
if [ ${#bad[@]} -gt 0 ]; then
  echo "not formatted (run: clang-format -i FILE): ${bad[*]}" >&2
  exit 1
fi
echo "clang-format: every C/CUDA file of the tree is formatted"
