#!/usr/bin/env bash
# The GPU measurements of issues 12 and 13, in parts that each fit one 10-minute call of a lent GPU machine with no
# network (the checkout is imported through a symlink: `pip install -e .` cannot fetch there), most needed first:
#   bash scripts/gpu_session.sh check   # make gpu-check: correctness, the 2048 px headline, allocator trace (~8-9 min)
#   bash scripts/gpu_session.sh bench   # the host-memory bench on the GPU (~2 min), then make gpu-bench (~3 min)
#   bash scripts/gpu_session.sh default # make gpu-bench under the default CUDA allocator (~3 min)
# Each part writes straight into $OUT/<part>/ (default ./gpu-session/<part>/), and every command there saves its
# results as it goes, so a part stopped by its own limits or killed by the device tool keeps what it measured; a part
# leaves at most 6 files (the device tool brings back 8, two folders deep). Without CUDA every command says so in
# one line and exits 0.
set -u
part=${1:?usage: gpu_session.sh check|bench|default}
case $part in check|bench|default) ;;
    *) echo "gpu_session.sh: unknown part '$part': give check, bench or default" >&2; exit 2 ;;
esac
dest=${OUT:-$PWD/gpu-session}
repo=$(cd "$(dirname "$0")/.." && pwd)
pp=$(mktemp -d)
out=$dest/$part
ln -sfn "$repo" "$pp/tightrope"
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PY:-python3}
# The machine's image has a peft of a version not recorded; one older than Tightrope's floor (versions.py) stops the
# import. A peft wheel carried in .whl/ (the run tool's `carry`) is put first on the path, offline (python3 there is
# the one with torch; $PY may be a stand-in).
wheel=$(ls "$repo"/.whl/peft-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$pp/site" "$wheel" >/dev/null 2>&1; then
    export PYTHONPATH="$pp:$pp/site${PYTHONPATH#$pp}"
    echo "== peft from $(basename "$wheel") (carried in .whl/), not the machine's"
fi
mkdir -p "$out"
status=0
step() {  # step LIMIT_S ARGS...: one command of the part, stopped at its limit
    local limit=$1; shift
    echo "== $* (limit ${limit} s)"
    timeout --signal=TERM --kill-after=20 "$limit" "$py" -m tightrope bench "$@" || status=$?
}
case $part in
    check)   step 540 gpu-check --out "$out" ;;
    bench)   step 200 --host-memory --device cuda --out "$out"
             step 330 gpu-bench --out "$out" ;;
    default) export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
             step 540 gpu-bench --out "$out" ;;
esac
rm -rf "$pp"
echo "== $part: exit $status; everything in $out"
exit $status
