#!/usr/bin/env bash
# Install what the browser tests need: Debian's chromium and the Python `playwright` package (driver only:
# Playwright's own browser download is not used; the tests launch /usr/bin/chromium via executable_path).
# Idempotent and fast when both are present. Usage: tests/e2e/setup_e2e.sh [path/to/venv/bin/python]
set -euo pipefail
PY="${1:-.venv/bin/python}"
PLAYWRIGHT_VERSION="${PLAYWRIGHT_VERSION:-1.64.1}"

if [ -n "${KIT_E2E_CHROMIUM:-}" ]; then
    [ -x "$KIT_E2E_CHROMIUM" ] || { echo "setup_e2e: KIT_E2E_CHROMIUM=$KIT_E2E_CHROMIUM is not executable" >&2; exit 1; }
elif ! command -v chromium >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "setup_e2e: no chromium and no apt-get here; install Chromium yourself and set KIT_E2E_CHROMIUM" >&2
        exit 1
    fi
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    echo "setup_e2e: installing Debian chromium (apt-get)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
echo "setup_e2e: $("${KIT_E2E_CHROMIUM:-chromium}" --version 2>/dev/null || echo 'chromium missing')"

if ! "$PY" -c "import playwright.sync_api" >/dev/null 2>&1; then
    echo "setup_e2e: installing playwright==${PLAYWRIGHT_VERSION} into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet "playwright==${PLAYWRIGHT_VERSION}"
fi
echo "setup_e2e: playwright $("$PY" -c 'from importlib.metadata import version; print(version("playwright"))')"
