#!/usr/bin/env bash
# Every EP_* variable the library's sources read by name (ep_env_int / ep_env_real / ep_env_long
# / ep_env_str / ep_env_text) has a row in the environment registry, as `epcomm info` lists it:
# a read of a name without a row finds no default_value and no check (a typo inside epcomm
# would silently read 0 or NULL).
# Usage: tests/test_env_names.sh BUILD_DIR SRC_DIR   (exit 0 pass, 1 fail)
set -u
use="usage: test_env_names.sh BUILD_DIR SRC_DIR"
b=${1:?$use} src=${2:?$use}
rows=$("$b/bin/epcomm" info 2>/dev/null | awk '$1 ~ /^EP_/ { print $1 }' | sort -u)
[ -n "$rows" ] || { echo "test_env_names.sh: epcomm info listed no EP_* rows" >&2; exit 1; }
read=$(grep -rhoE 'ep_env_(int|real|long|str|text)\("EP_[A-Z0-9_]+"' "$src/src" |
  sed 's/.*("//; s/"$//' | sort -u)
[ -n "$read" ] || { echo "test_env_names.sh: found no reads in $src/src" >&2; exit 1; }
missing=$(comm -23 <(echo "$read") <(echo "$rows"))
if [ -n "$missing" ]; then
  echo "test_env_names.sh: read by name but not in the registry: $missing" >&2
  exit 1
fi
echo "$(echo "$read" | wc -l) names read, all in the registry"
