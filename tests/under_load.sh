#!/usr/bin/env bash
# make unit-loaded: `make unit` while one CPU-burning process per core runs beside it, as on a shared notebook host.
# The burners are bounded (they exit after KIT_LOAD_S seconds, 3 hours by default, even if this script is killed
# with SIGKILL) and are stopped as soon as the tests end.
#   tests/under_load.sh [make arguments...]
set -uo pipefail
cd "$(dirname "$0")/.."
burners=()
stop() { [ ${#burners[@]} -eq 0 ] || kill "${burners[@]}" 2>/dev/null; wait 2>/dev/null; }
trap stop EXIT INT TERM
for _ in $(seq "$(nproc)"); do
    timeout "${KIT_LOAD_S:-10800}" python3 -c "while True: pass" &
    burners+=("$!")
done
echo "under_load: ${#burners[@]} CPU burner(s) running (PIDs ${burners[*]})"
"${MAKE:-make}" --no-print-directory unit "$@"
