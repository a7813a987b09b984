#!/usr/bin/env bash
# Wall and CPU time of each method package's small preset (configs/scenarios/small/*.yaml)
# through `fcl simulate` and its embedded broker, with the load average at start and end and
# the line each run prints for its metric; docs/tutorial.md's preset table quotes it.
#   bash benchmarks/time_presets.sh [PACKAGE ...]    (default: every preset; work in /tmp/presets)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${WORK:-/tmp/presets}
mkdir -p "$work"
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=($(ls configs/scenarios/small | sed 's/\.yaml$//'))
for p in "${presets[@]}"; do
  echo "== $p start $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')"
  rc=0
  /usr/bin/time -v python -m fcl_edge.cli simulate "configs/scenarios/small/$p.yaml" --out "$work/$p" --force \
    >"$work/$p.log" 2>"$work/$p.time" || rc=$?
  echo "rc=$rc end $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/')"
  grep -E "Elapsed|User time|System time|Maximum resident" "$work/$p.time"
  grep -E "^[a-z0-9-]+: (avg|accuracy|mean)" "$work/$p.log" | cut -c1-100
done
