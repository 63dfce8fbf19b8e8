#!/usr/bin/env bash
# Issue 30 on a real GPU, from the wheel (make wheel on the development machine; carry build/):
# the wheel installed with pip --no-index into a fresh virtual environment (the machine's PyTorch
# reached through a .pth line, since it lives in a venv of its own), then
#   - `vmmshim doctor`;
#   - `vmmshim run -- python tests/gpu/torch_train.py` with `vmmctl list` (the venv's) showing its
#     tensors while it waits, and the same losses as natively;
#   - `vmmshim run -- torchrun --nproc_per_node=2` with both workers on one GPU, both published;
#   - the CUDA 11.8 program through `vmmshim run` (tests/gpu/cuda11.sh, with the venv on PATH).
# Prints PASS/FAIL lines and "wheel: N passed, N failed"; files in ${OUT:-/tmp}/vmmshim-wheel.
set -u
cd "$(dirname "$0")/../.." || exit 1
B=$PWD/${BUILD:-build}
W=${OUT:-/tmp}/vmmshim-wheel
V=/tmp/vmmshim-wheel-venv
rm -rf "$W" "$V"; mkdir -p "$W"
export VMMSHIM_REGISTRY=/vmmshim-wheel-$$ PYTHONUNBUFFERED=1
pass=0; fail=0
ok() { pass=$((pass + 1)); echo "PASS $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }
finish() { rm -f "/dev/shm$VMMSHIM_REGISTRY"; echo "wheel: $pass passed, $fail failed"; [ "$fail" = 0 ]; exit; }

whl=$(ls "$B"/dist/vmmshim-*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || { bad "no wheel in $B/dist: run make wheel on the development machine and carry build/"; finish; }
PY=$(command -v python3)
site=$("$PY" -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
if "$PY" -m venv "$V" > "$W/venv.log" 2>&1; then :; else
  rm -rf "$V"; "$PY" -m venv --without-pip "$V" >> "$W/venv.log" 2>&1 || { bad "venv: $(tail -2 "$W/venv.log")"; finish; }
fi
vsite=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" > "$vsite/machine-torch.pth"
if [ -x "$V/bin/pip" ]; then "$V/bin/pip" install -q --no-index --no-deps "$whl" > "$W/pip.log" 2>&1
else "$PY" -m pip --python "$V/bin/python" install -q --no-index --no-deps "$whl" > "$W/pip.log" 2>&1; fi
rc=$?
[ $rc = 0 ] && ok "pip install $(basename "$whl") into a fresh venv" || { bad "pip install: $(tail -3 "$W/pip.log")"; finish; }
export PATH=$V/bin:$PATH
case $(command -v vmmctl)/$(command -v vmmshim) in "$V"/bin/vmmctl/"$V"/bin/vmmshim) ok "vmmctl and vmmshim on PATH from the venv" ;;
  *) bad "vmmctl/vmmshim not the venv's: $(command -v vmmctl) $(command -v vmmshim)" ;; esac

echo "== vmmshim doctor"
vmmshim doctor > "$W/doctor" 2>&1; rc=$?
cat "$W/doctor"
[ $rc = 0 ] && ok "vmmshim doctor exits 0" || bad "vmmshim doctor exit $rc"

echo "== vmmshim run -- python tests/gpu/torch_train.py"
python tests/gpu/torch_train.py > "$W/train.native" 2>&1
mkfifo "$W/in"
PAUSE_FOR_COMPANION=1 vmmshim run -- python tests/gpu/torch_train.py < "$W/in" > "$W/train.shim" 2> "$W/train.err" &
tp=$!
exec 7> "$W/in"
line=""
for _ in $(seq 1 600); do line=$(grep '^param ' "$W/train.shim" || true); [ -n "$line" ] && break; kill -0 $tp 2>/dev/null || break; sleep 0.1; done
if [ -n "$line" ]; then
  read -r _ pid addr _ <<< "$line"
  vmmctl list --pid "$pid" > "$W/list" 2>&1
  head -8 "$W/list"
  n=$(vmmctl list --pid "$pid" --json | grep -c '"address"')
  if [ "$n" -gt 0 ] && vmmctl list --pid "$pid" --json | grep -q '"broker"'; then ok "vmmctl list (the wheel's) shows the trainer's $n allocations, exportable"
  else bad "vmmctl list shows nothing for pid $pid: $(cat "$W/list")"; fi
else bad "the trainer under vmmshim run printed no param line: $(tail -5 "$W/train.err")"; fi
echo >&7; exec 7>&-
wait $tp; rc=$?
if [ $rc = 0 ] && diff <(grep '^step' "$W/train.native") <(grep '^step' "$W/train.shim") > /dev/null; then
  ok "the trainer under vmmshim run: exit 0, the same 30 losses as natively ($(grep '^step 29' "$W/train.shim"))"
else bad "the trainer under vmmshim run: exit $rc, losses differ or missing: $(tail -3 "$W/train.err")"; fi

echo "== vmmshim run -- torchrun --nproc_per_node=2 (two workers on one GPU)"
vmmshim run -- torchrun --standalone --nproc_per_node=2 tests/gpu/torchrun_pair.py > "$W/torchrun" 2>&1; rc=$?
grep -E '^(worker|pair)' "$W/torchrun"
if [ $rc = 0 ] && grep -q '^pair ok' "$W/torchrun" && [ "$(grep -c '^worker pid' "$W/torchrun")" = 2 ]; then
  ok "torchrun: both workers' tensors published and exportable"
else bad "torchrun: exit $rc: $(tail -5 "$W/torchrun")"; fi

echo "== the CUDA 11.8 program, by LD_PRELOAD and by vmmshim run"
OUT=$W tests/gpu/cuda11.sh > "$W/cuda11" 2>&1; rc=$?
cat "$W/cuda11"
if [ $rc = 0 ] && grep -q '^PASS vmmshim-run: imported' "$W/cuda11"; then ok "CUDA 11.8 program backed, published and imported, through vmmshim run too"
else bad "CUDA 11.8 program (exit $rc)"; fi
finish
