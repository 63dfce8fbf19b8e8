#!/usr/bin/env bash
# The shim includes nothing from tools/: the public header tools/include/vmmshim.h is built on the
# shim's own shim/api/vmm_api.h, never the other way round, so the shim builds without tools/ and
# a change to the companions' side cannot reach into it.  Checked two ways: every #include line of
# shim/ (a header named by a path into tools/, or by a name that tools/include holds), and, when
# the build is there, every header the compiler actually read for an object of shim/ (its .d file).
# Then the header as installed ($BUILD/include/vmmshim.h, one file) must compile on its own.
# Usage: includes.sh [BUILD]   (from anywhere; the build is optional for the first check)
# Closes with "includes: N passed, N failed" (a file or a check each) and exits 1 on a failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${1:-${BUILD:-build}}
p=0; f=0
for src in $(find shim -name '*.[ch]' | sort); do
  bad=$(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"][^>"]+[>"]' "$src" | while IFS= read -r line; do
    name=$(printf '%s\n' "$line" | sed -E 's/.*include[[:space:]]*[<"]([^>"]+)[>"].*/\1/')
    case "$name" in *tools/*) echo "$line"; continue ;; esac
    [ -e "tools/include/$name" ] && echo "$line"
  done)
  if [ -n "$bad" ]; then
    echo "includes: $src includes a header of tools/:"; printf '%s\n' "$bad" | sed 's/^/    /'; f=$((f + 1))
  else
    p=$((p + 1))
  fi
done
if [ -d "$BUILD/obj/shim" ]; then
  bad=$(find "$BUILD/obj/shim" -name '*.d' -print0 | xargs -0 grep -lE '(^|[[:space:]/])tools/' 2>/dev/null)
  if [ -n "$bad" ]; then echo "includes: objects of shim/ read headers of tools/: $bad"; f=$((f + 1)); else p=$((p + 1)); fi
fi
if [ -f "$BUILD/include/vmmshim.h" ]; then
  if out=$(printf '#include <vmmshim.h>\nint main(void) { return vmm_import_ptr(NULL) != 0; }\n' |
           ${CC:-cc} -std=c11 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I"$BUILD/include" -x c - 2>&1); then
    p=$((p + 1))
  else
    echo "includes: $BUILD/include/vmmshim.h does not compile on its own:"; printf '%s\n' "$out" | head -5; f=$((f + 1))
  fi
else
  echo "includes: no $BUILD/include/vmmshim.h: build first"; f=$((f + 1))
fi
echo "includes: $p passed, $f failed"
[ "$f" = 0 ]
