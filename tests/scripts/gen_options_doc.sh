#!/bin/sh
# Regenerates the documents that describe the options, from the table in shim/core/options.c,
# so they cannot drift from the code (test_options fails when they have):
#   config/docs-options.md  the README "Options" section, table between the options markers
#   config/vmmshim.conf     the sample config file, every option commented out at its default
# --readme also replaces the table between the markers in README.md in place.
# It compiles its own copy of test_options from the core sources alone, so a broken file
# elsewhere in the tree does not stop it; CC and CFLAGS are honoured.
set -eu
cd "$(dirname "$0")/../.."
readme=no
for arg in "$@"; do
  case $arg in
    --readme) readme=yes ;;
    *) echo "usage: $0 [--readme]" >&2; exit 2 ;;
  esac
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bin=$tmp/test_options
if ! ${CC:-cc} ${CFLAGS:-} -std=c11 -D_GNU_SOURCE -pthread -Ishim -o "$bin" \
     tests/unit/test_options.c shim/core/*.c; then
  echo "gen_options_doc: cannot build $bin" >&2
  exit 1
fi
"$bin" --markdown > "$tmp/table.md"
"$bin" --conf > "$tmp/vmmshim.conf"

{
  cat <<'TEXT'
## Options

Every setting is an environment variable `VMMSHIM_<NAME>`.  The same settings can come from a
config file named by `VMMSHIM_CONFIG`: `key = value` lines and `#` comments, keys being the
names with or without the `VMMSHIM_` prefix, in any case (`log_level = info`).
[config/vmmshim.conf](config/vmmshim.conf) lists every option at its default.  The environment
wins over the file.  Booleans take 1/0, true/false, yes/no, on/off; sizes take bytes or a
K/M/G/T suffix (powers of 1024; KiB/MiB/GiB/TiB too).

A bad value prints one line naming the variable, the value and what is allowed, and the default
is used:

    vmmshim: warning: VMMSHIM_CACHE_SIZE='12Q' is not a size (use bytes or K/M/G/T suffix, 0..1T); using default 0

With `VMMSHIM_STRICT=1` the same line is an error and start-up is refused.  `vmmctl config`
prints the effective value of every option and where it came from; `VMMSHIM_VERBOSE=1` prints
the same at start.  Log lines look like `vmmshim: <level>: <text>`, one per message, at most 50
per second per level.

TEXT
  echo '<!-- options:begin -->'
  cat "$tmp/table.md"
  echo '<!-- options:end -->'
} > "$tmp/docs-options.md"

mv "$tmp/docs-options.md" config/docs-options.md
mv "$tmp/vmmshim.conf" config/vmmshim.conf
echo "gen_options_doc: wrote config/docs-options.md and config/vmmshim.conf" >&2

if [ "$readme" = yes ]; then
  if ! grep -q '^<!-- options:begin -->$' README.md 2>/dev/null || ! grep -q '^<!-- options:end -->$' README.md; then
    echo "gen_options_doc: README.md lacks the lines <!-- options:begin --> and <!-- options:end -->" >&2
    exit 1
  fi
  awk -v table="$tmp/table.md" '
    $0 == "<!-- options:begin -->" { print; while ((getline l < table) > 0) print l; skip = 1; next }
    $0 == "<!-- options:end -->"   { skip = 0 }
    !skip { print }
  ' README.md > "$tmp/README.md"
  cat "$tmp/README.md" > README.md
  echo "gen_options_doc: updated the options table in README.md" >&2
fi
