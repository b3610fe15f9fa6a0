#!/usr/bin/env bash
# make test: runs `make PART` for each part in turn, stopping at the first that fails, and prints a table of
# each part's wall time at the end, after a failure too; exits with the failing part's status.
#   tests/run_parts.sh TIMES_FILE PART...
# A part may add notes to its row: a line "PART:NOTE<TAB>SECONDS" appended to $KIT_TEST_TIMES (the compat
# stacks note their install time this way).
set -uo pipefail
cd "$(dirname "$0")/.."
times=$1
shift
mkdir -p "$(dirname "$times")"
: > "$times"
rc=0
for part in "$@"; do
    t0=$SECONDS
    KIT_TEST_TIMES="$PWD/$times" "${MAKE:-make}" --no-print-directory "$part" || rc=$?
    printf '%s\t%s\t%s\n' "$part" "$((SECONDS - t0))" "$rc" >> "$times"
    [ "$rc" -eq 0 ] || break
done

echo
echo "make test: wall time per part, m:ss ($times)"
awk -F'\t' -v parts="$*" '
    function mmss(s) { return sprintf("%d:%02d", s / 60, s % 60) }
    $1 ~ /:/ { split($1, pn, ":"); note[pn[1]] = note[pn[1]] sprintf("  (%s %s)", pn[2], mmss($2)); next }
    { secs[$1] = $2; code[$1] = $3; total += $2 }
    END {
        n = split(parts, want, " ")
        for (i = 1; i <= n; i++) {
            p = want[i]
            if (!(p in secs)) { printf "  %-22s %6s  not run\n", p, "-"; continue }
            printf "  %-22s %6s  %s%s\n", p, mmss(secs[p]), code[p] == 0 ? "ok" : "FAILED (exit " code[p] ")", note[p]
        }
        printf "  %-22s %6s\n", "total", mmss(total)
    }' "$times"
exit "$rc"
