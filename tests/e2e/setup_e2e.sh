#!/usr/bin/env bash
# Install what the browser tests need: Debian's chromium (+ fonts) and the Python `playwright` package (driver only:
# Playwright's own browser download is not used; the tests launch /usr/bin/chromium via executable_path).
# Idempotent and fast when both are present. Usage: tests/e2e/setup_e2e.sh [path/to/venv/bin/python]
set -euo pipefail
PY="${1:-.venv/bin/python}"
PLAYWRIGHT_VERSION="${PLAYWRIGHT_VERSION:-1.64.1}"

# chromium (unless KIT_E2E_CHROMIUM names another build) and fonts, so that the screenshots show the Chinese text of
# the notebooks and seed documents instead of empty boxes
PACKAGES="fonts-dejavu-core fonts-wqy-zenhei"
if [ -n "${KIT_E2E_CHROMIUM:-}" ]; then
    [ -x "$KIT_E2E_CHROMIUM" ] || { echo "setup_e2e: KIT_E2E_CHROMIUM=$KIT_E2E_CHROMIUM is not executable" >&2; exit 1; }
elif ! command -v chromium >/dev/null 2>&1; then
    PACKAGES="chromium $PACKAGES"
fi
MISSING=""
for pkg in $PACKAGES; do
    if [ "$pkg" = chromium ] || ! dpkg -s "$pkg" >/dev/null 2>&1; then MISSING="$MISSING $pkg"; fi
done
if [ -n "$MISSING" ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        case "$MISSING" in
            *chromium*) echo "setup_e2e: no chromium and no apt-get here; install Chromium, set KIT_E2E_CHROMIUM" >&2
                        exit 1 ;;
            *) echo "setup_e2e: fonts$MISSING not installed (no apt-get); screenshots may show boxes for CJK" ;;
        esac
    else
        SUDO=""
        if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
        echo "setup_e2e: installing$MISSING (apt-get)"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $MISSING >/dev/null
    fi
fi
echo "setup_e2e: $("${KIT_E2E_CHROMIUM:-chromium}" --version 2>/dev/null || echo 'chromium missing')"

if ! "$PY" -c "import playwright.sync_api" >/dev/null 2>&1; then
    echo "setup_e2e: installing playwright==${PLAYWRIGHT_VERSION} into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet "playwright==${PLAYWRIGHT_VERSION}"
fi
echo "setup_e2e: playwright $("$PY" -c 'from importlib.metadata import version; print(version("playwright"))')"
