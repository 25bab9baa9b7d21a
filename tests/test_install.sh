#!/usr/bin/env bash
# Install and consume: installs BUILD_DIR into a temporary prefix, checks the tree (SONAME links,
# no build-tree path in the package files, the installed CLI using the installed rulebook), builds
# every examples/*.c out of tree with a CMake project (find_package(epcomm) -> epcomm::epcomm, and
# epcomm::epcomm_static), moves the prefix, builds them again with a plain cc line from
# `pkg-config --cflags --libs epcomm` (and --static), and runs minimal under the installed
# `epcomm launch -n 2` each time.
# Usage: tests/test_install.sh BUILD_DIR SRC_DIR    (exit 0 pass; 1 fail, the reason on stderr)
set -u
b=$(cd "${1:?usage: test_install.sh BUILD_DIR SRC_DIR}" && pwd) || exit 1
src=$(cd "${2:?usage: test_install.sh BUILD_DIR SRC_DIR}" && pwd) || exit 1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc=${CC:-cc}
# A sanitized library needs its runtime in every program that loads it.
san=""
grep -q '^EP_SANITIZE:BOOL=ON' "$b/CMakeCache.txt" && san="-fsanitize=address,undefined"

die() { echo "test_install.sh: $*" >&2; exit 1; }
step() { # WHAT COMMAND...: runs the command, its output in a log shown only when it fails
  local what=$1
  shift
  "$@" >"$tmp/log" 2>&1 && return 0
  echo "test_install.sh: $what failed:" >&2
  tail -n 25 "$tmp/log" | sed 's/^/    /' >&2
  exit 1
}
launch() { # PREFIX PROGRAM: 2 ranks under the installed launcher; must succeed silently
  "$1/bin/epcomm" launch -n 2 "$2" >"$tmp/out" 2>"$tmp/err" || die "$2: exit status $?: $(head -3 "$tmp/err")"
  [ -s "$tmp/err" ] && die "$2 wrote on stderr: $(head -3 "$tmp/err")"
  return 0
}

check_tree() { # PREFIX LIBDIR
  local p=$1 lib=$2 f
  for f in include/epcomm.h bin/epcomm share/epcomm/doctor-rules.txt; do
    [ -f "$p/$f" ] || die "not installed: $f"
  done
  for f in libepcomm.a libepcomm.so libepcomm.so.0 pkgconfig/epcomm.pc cmake/epcomm/epcommConfig.cmake \
    cmake/epcomm/epcommConfigVersion.cmake; do
    [ -e "$lib/$f" ] || die "not installed: $lib/$f"
  done
  readelf -d "$lib/libepcomm.so" | grep -q 'SONAME.*\[libepcomm\.so\.0\]' || die "SONAME is not libepcomm.so.0"
  grep -rlF -e "$b" -e "$src" "$lib/cmake" "$lib/pkgconfig" && die "build-tree paths in the files above"
  "$p/bin/epcomm" doctor rules >"$tmp/rules" 2>&1 || die "installed epcomm doctor rules failed: $(head -3 "$tmp/rules")"
  grep -qF "$p/" "$tmp/rules" || die "the installed CLI does not use the installed rulebook: $(head -1 "$tmp/rules")"
}

# The version the package must report: the header's, the one place it is written.
header_version() { # HEADER
  awk '/^#define EP_VERSION_(MAJOR|MINOR|PATCH) / { v[$2] = $3 }
       END { print v["EP_VERSION_MAJOR"] "." v["EP_VERSION_MINOR"] "." v["EP_VERSION_PATCH"] }' "$1"
}
# An older version that find_package must refuse all the same, as the API changed since: the
# previous minor while the major is 0 (none for 0.0.x), else the previous major.
incompatible() { # MAJOR.MINOR.PATCH
  local major=${1%%.*} minor
  minor=${1#*.}
  minor=${minor%.*}
  if [ "$major" != 0 ]; then echo "$((major - 1)).0"; elif [ "$minor" != 0 ]; then echo "0.$((minor - 1))"; fi
}

cmake_consumer() { # PREFIX MAJOR.MINOR INCOMPATIBLE_VERSION
  mkdir -p "$tmp/cmake-src"
  cat >"$tmp/cmake-src/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.20)
project(epcomm_consumer LANGUAGES C)
if(NOT "$3" STREQUAL "")
  find_package(epcomm $3 QUIET)
  if(epcomm_FOUND)
    message(FATAL_ERROR "find_package(epcomm $3) accepted version \${epcomm_VERSION}")
  endif()
endif()
find_package(epcomm $2 REQUIRED COMPONENTS static)
file(GLOB examples \${EXAMPLES}/*.c)
foreach(src \${examples})
  get_filename_component(name \${src} NAME_WE)
  add_executable(\${name} \${src})
  target_link_libraries(\${name} PRIVATE epcomm::epcomm)
  add_executable(\${name}_static \${src})
  target_link_libraries(\${name}_static PRIVATE epcomm::epcomm_static)
endforeach()
CMAKE
  step "configuring a find_package(epcomm $2) project" cmake -S "$tmp/cmake-src" -B "$tmp/cmake-build" \
    -DCMAKE_PREFIX_PATH="$1" -DEXAMPLES="$src/examples" -DCMAKE_C_FLAGS="$san"
  step "building examples/ with epcomm::epcomm and epcomm::epcomm_static" cmake --build "$tmp/cmake-build"
  launch "$1" "$tmp/cmake-build/minimal"
  launch "$1" "$tmp/cmake-build/minimal_static"
}

pkgconfig_consumer() { # PREFIX LIBDIR VERSION
  local v flags static ex name
  export PKG_CONFIG_PATH=$2/pkgconfig
  v=$(pkg-config --modversion epcomm) || die "pkg-config does not find epcomm.pc in $PKG_CONFIG_PATH"
  [ "$v" = "$3" ] || die "epcomm.pc says version $v, the header $3"
  flags=$(pkg-config --cflags --libs epcomm)
  static=$(pkg-config --cflags --static --libs epcomm)
  static=${static/-lepcomm/$2/libepcomm.a} # the archive, with what Libs.private says it needs
  mkdir -p "$tmp/pc"
  for ex in "$src"/examples/*.c; do
    name=$(basename "$ex" .c)
    # shellcheck disable=SC2086 # the flags are a command line
    step "cc $name.c with pkg-config" $cc $san -o "$tmp/pc/$name" "$ex" $flags -Wl,-rpath,"$2"
    # shellcheck disable=SC2086
    step "cc $name.c with pkg-config --static" $cc $san -o "$tmp/pc/${name}_static" "$ex" $static
  done
  readelf -d "$tmp/pc/minimal_static" | grep -q 'NEEDED.*libepcomm' && die "minimal_static loads libepcomm.so"
  launch "$1" "$tmp/pc/minimal"
  launch "$1" "$tmp/pc/minimal_static"
}

p=$tmp/prefix
step "cmake --install $b --prefix $p" cmake --install "$b" --prefix "$p"
lib=$(find "$p" -name libepcomm.so.0)
[ -n "$lib" ] || die "no libepcomm.so.0 under $p"
lib=$(dirname "$lib")
version=$(header_version "$p/include/epcomm.h")
check_tree "$p" "$lib"
cmake_consumer "$p" "${version%.*}" "$(incompatible "$version")"
# Moved elsewhere, the tree must still work: every file finds the others relative to itself.
mv "$p" "$tmp/moved"
lib=$tmp/moved${lib#"$p"}
p=$tmp/moved
check_tree "$p" "$lib"
pkgconfig_consumer "$p" "$lib" "$version"
