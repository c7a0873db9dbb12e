#!/usr/bin/env bash
# The engine benchmark on this tree and on a baseline tree, one after the other on one GPU (an A/B in one run).
#
#   git archive REV | tar -x -C exp/base         # on the development machine: the baseline's files (no .git needed)
#   bash bench/engine_ab.sh exp/base OUT [bench/engine.py arguments ...]
#
# Runs `bench/engine.py ARGS --out OUT/new` here, then the baseline's own `bench/engine.py ARGS --out OUT/base` inside
# the baseline tree (its `fp8lab` first on the path), and prints each run's tok/s lines; the full tables are in
# OUT/new/engine_results.md and OUT/base/engine_results.md. Compare rows of the same run only (same GPU, same
# copy bandwidth). Each run is given `TIMEOUT` seconds (default 300), so one that hangs leaves the other's results.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash bench/engine_ab.sh BASELINE_TREE OUT [bench/engine.py arguments]" >&2
  exit 2
fi
base=$(cd "$1" && pwd) || { echo "engine_ab: no baseline tree at $1" >&2; exit 2; }
out=$2
shift 2
[ -f "$base/bench/engine.py" ] || { echo "engine_ab: $base/bench/engine.py is missing" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
limit=${TIMEOUT:-300}

timeout "$limit" python3 bench/engine.py "$@" --out "$out/new" > "$out/new.log" 2>&1
echo "new (this tree), exit $?:"; grep -i "tok/s\|error\|traceback" "$out/new.log" | head -8
(cd "$base" && PYTHONPATH="$base${PYTHONPATH:+:$PYTHONPATH}" timeout "$limit" python3 bench/engine.py "$@" \
  --out "$out/base" > "$out/base.log" 2>&1)
echo "base ($base), exit $?:"; grep -i "tok/s\|error\|traceback" "$out/base.log" | head -8
