#!/usr/bin/env bash
# The default test suite on a machine four times slower than the 2-core development machine:
# every process of the run is capped at half a CPU (a cgroup-v1 CPU quota of 50 ms per 100 ms;
# needs root and /sys/fs/cgroup/cpu), with every test's time limit stretched by
# FCL_TEST_TIME_SCALE (default 4).  Prints the load average every minute, the suite's summary
# line and its wall time; README "Tests on a slow machine" quotes it.
#   sudo bash benchmarks/suite_slowed.sh [PYTEST ARGS ...]      (default: -q, the README's suite)
set -euo pipefail
cd "$(dirname "$0")/.."
scale=${FCL_TEST_TIME_SCALE:-4}
quota_us=${QUOTA_US:-50000}   # of each 100,000 us: half a CPU, a quarter of this 2-core machine
group=/sys/fs/cgroup/cpu/fcl-suite-slowed
[ -d /sys/fs/cgroup/cpu ] || { echo "needs a cgroup-v1 cpu controller at /sys/fs/cgroup/cpu" >&2; exit 2; }
mkdir -p "$group"
echo 100000 >"$group/cpu.cfs_period_us"
echo "$quota_us" >"$group/cpu.cfs_quota_us"
echo $$ >"$group/cgroup.procs"   # this shell and everything it starts
(while true; do echo "load $(uptime | sed 's/.*average: //')"; sleep 60; done) &
ticker=$!
trap 'kill $ticker 2>/dev/null || true' EXIT
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(-q)
start=$(date +%s)
rc=0
FCL_TEST_TIME_SCALE=$scale python -m pytest -p no:cacheprovider "${args[@]}" || rc=$?
echo "rc=$rc wall=$(( $(date +%s) - start )) s, quota ${quota_us}/100000 us, FCL_TEST_TIME_SCALE=$scale"
exit $rc
