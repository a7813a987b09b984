#!/usr/bin/env bash
# Cross-architecture check (issue 7): an arm64 Debian userland built with debootstrap and
# run through qemu-user-static, the package installed there with aarch64 wheels from PyPI,
# then `fcl infer` on a model exported on the host and one client round against a
# Mosquitto on the host.  Not part of the test suite: it downloads ~250 MB and takes
# tens of minutes under emulation.  Results go to firmware_notes/arm64-check.md by hand.
#
#   sudo scripts/arm64-check.sh [--rootfs DIR] [--work DIR] [--keep] [--torch SPEC]
#
# Needs (as root): debootstrap qemu-user-static binfmt-support mosquitto, and network
# access to a Debian mirror and PyPI.  Each step prints its wall-clock time; the summary is
# also written to WORK/timings.txt.
set -euo pipefail

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'

Options:
  --rootfs DIR   where the arm64 userland lives (default /var/tmp/fcl-arm64/rootfs; reused if present)
  --work DIR     host-side scratch: wheel, model, broker, logs (default /var/tmp/fcl-arm64/work)
  --suite NAME   Debian suite (default bookworm: Python 3.11)
  --mirror URL   Debian mirror (default http://deb.debian.org/debian)
  --torch SPEC   torch requirement for aarch64 (default torch==2.9.1: PyPI's aarch64 wheels
                 from 2.11 on are CUDA builds of ~420 MB plus the CUDA toolkit)
  --keep         leave the mounts in place on exit (for poking around)
EOF
}

REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOTFS=/var/tmp/fcl-arm64/rootfs
WORK=/var/tmp/fcl-arm64/work
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
TORCH_SPEC=torch==2.9.1
KEEP=0
PY=${PYTHON:-python3}

while [ $# -gt 0 ]; do
  case "$1" in
    --rootfs) ROOTFS=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --suite) SUITE=$2; shift 2 ;;
    --mirror) MIRROR=$2; shift 2 ;;
    --torch) TORCH_SPEC=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "arm64-check: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

TIMINGS=$WORK/timings.txt
BROKER_PID=
AGG_PID=

say() { printf '[arm64-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { say "FAILED: $*" >&2; exit 1; }

# step NAME CMD...: run one step and record its wall-clock seconds.
step() {
  local name=$1; shift
  local t0=$SECONDS
  say "step $name"
  "$@"
  local dt=$((SECONDS - t0))
  printf '%-22s %6d s\n' "$name" "$dt" | tee -a "$TIMINGS"
}

in_root() { chroot "$ROOTFS" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin \
  PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 "$@"; }

cleanup() {
  set +e
  [ -n "$AGG_PID" ] && kill "$AGG_PID" 2>/dev/null
  [ -n "$BROKER_PID" ] && kill "$BROKER_PID" 2>/dev/null
  if [ "$KEEP" = 0 ]; then
    for m in proc/cpuinfo dev/pts dev sys proc; do
      mountpoint -q "$ROOTFS/$m" && umount -l "$ROOTFS/$m"
    done
  fi
}
trap cleanup EXIT

preflight() {
  [ "$(id -u)" = 0 ] || die "run as root (debootstrap, chroot and mounts need it)"
  local cmd
  for cmd in debootstrap qemu-aarch64-static chroot mosquitto "$PY"; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || \
      die "$cmd not found (apt-get install debootstrap qemu-user-static binfmt-support mosquitto)"
  done
  local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
  if [ ! -e "$entry" ]; then
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
      || die "cannot mount binfmt_misc (the kernel or the sandbox does not allow it)"
    update-binfmts --enable qemu-aarch64 || die "update-binfmts --enable qemu-aarch64 failed"
  fi
  grep -qx enabled "$entry" || die "$entry is not enabled: $(cat "$entry")"
  mkdir -p "$WORK"
  : > "$TIMINGS"
  say "binfmt: $(tr '\n' ' ' < "$entry")"
}

bootstrap() {
  if [ -f "$ROOTFS/.fcl-bootstrapped" ]; then
    say "reusing $ROOTFS"
    return
  fi
  mkdir -p "$ROOTFS"
  # Two stages, so it also works where binfmt lacks the F (fix-binary) flag: the second
  # stage runs inside the chroot through the qemu binary copied in.
  debootstrap --arch=arm64 --foreign --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates,libgomp1 "$SUITE" "$ROOTFS" "$MIRROR"
  cp /usr/bin/qemu-aarch64-static "$ROOTFS/usr/bin/"
  chroot "$ROOTFS" /debootstrap/debootstrap --second-stage
  touch "$ROOTFS/.fcl-bootstrapped"
}

# qemu-user (7.2) passes the host's x86 /proc/cpuinfo through; onnxruntime's cpuinfo library
# then segfaults on import.  Give the userland what a Raspberry Pi 4 (Cortex-A72) shows.
fake_cpuinfo() {
  local i n
  n=$(getconf _NPROCESSORS_CONF)
  for ((i = 0; i < n; i++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n' "$i"
    printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n'
  done > "$WORK/cpuinfo.arm64"
  mountpoint -q "$ROOTFS/proc/cpuinfo" || mount --bind "$WORK/cpuinfo.arm64" "$ROOTFS/proc/cpuinfo"
}

mount_root() {
  local m
  for m in proc sys dev dev/pts; do
    mkdir -p "$ROOTFS/$m"
    mountpoint -q "$ROOTFS/$m" || mount --bind "/$m" "$ROOTFS/$m"
  done
  fake_cpuinfo
  cp -L /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
  cp -L /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/host-ca.crt"
  say "userland: $(in_root uname -m) / $(in_root python3 --version)"
}

build_wheel() {
  # From a clean copy, so a stale build/ in the checkout cannot leak into the wheel.
  rm -rf "$WORK/src" "$WORK/dist"
  mkdir -p "$WORK/src"
  tar -C "$REPO" --exclude=./build --exclude=./dist --exclude=./.git --exclude=./runs \
    --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$WORK/src" -xf -
  "$PY" -m pip wheel -q --no-deps --no-build-isolation "$WORK/src" -w "$WORK/dist"
  rm -rf "$ROOTFS/tmp/fcl"
  mkdir -p "$ROOTFS/tmp/fcl"
  cp "$WORK"/dist/fcl_edge-*.whl "$ROOTFS/tmp/fcl/"
}

install_torch() {
  in_root python3 -m venv /opt/fcl-edge/venv
  in_root /opt/fcl-edge/venv/bin/pip install --only-binary=:all: "$TORCH_SPEC"
}

install_package() {
  local wheel
  wheel=$(basename "$(ls "$ROOTFS"/tmp/fcl/fcl_edge-*.whl)")
  in_root /opt/fcl-edge/venv/bin/pip install --only-binary=:all: "/tmp/fcl/${wheel}[train,infer,export]"
  in_root /opt/fcl-edge/venv/bin/python -c \
    "import platform, torch, onnxruntime, numpy; print(platform.machine(), 'torch', torch.__version__, 'onnxruntime', onnxruntime.__version__, 'numpy', numpy.__version__)" \
    | tee "$WORK/versions.txt"
}

start_broker() {
  local port
  port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  mkdir -p "$WORK/broker"
  printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 0\n' "$port" \
    > "$WORK/broker/mosquitto.conf"
  mosquitto -c "$WORK/broker/mosquitto.conf" > "$WORK/broker/mosquitto.log" 2>&1 &
  BROKER_PID=$!
  BROKER_URL=mqtt://127.0.0.1:$port
  sleep 1
  kill -0 "$BROKER_PID" || die "mosquitto did not start: $(cat "$WORK/broker/mosquitto.log")"
  say "broker $BROKER_URL (pid $BROKER_PID)"
}

host_model() {
  # A model exported on x86_64 by the host's own install; served on arm64 below.
  rm -rf "$WORK/qs"
  (cd "$REPO" && "$PY" -m fcl_edge.cli simulate configs/scenarios/quickstart.yaml --out "$WORK/qs" \
    --broker "$BROKER_URL" --set compare=[] --set federation.rounds_per_task=2 > "$WORK/simulate.log" 2>&1) \
    || die "host simulate failed; see $WORK/simulate.log"
  cp "$WORK/qs/clients/client-0/model.onnx" "$ROOTFS/tmp/fcl/model.onnx"
  "$PY" -c "
import numpy as np
rng = np.random.default_rng(0)
np.save('$ROOTFS/tmp/fcl/rows.npy', (rng.random((16, 64)) > 0.5).astype(np.float32))"
}

infer_parity() {
  (cd "$REPO" && "$PY" -m fcl_edge.cli infer "$ROOTFS/tmp/fcl/model.onnx" --op loglik \
    --input "$ROOTFS/tmp/fcl/rows.npy") > "$WORK/loglik.x86_64.out"
  in_root /opt/fcl-edge/venv/bin/fcl infer /tmp/fcl/model.onnx --op loglik --input /tmp/fcl/rows.npy \
    > "$WORK/loglik.arm64.out"
  "$PY" - "$WORK/loglik.x86_64.out" "$WORK/loglik.arm64.out" <<'EOF' | tee "$WORK/parity.txt"
import json, sys
a, b = (json.load(open(path))["log_likelihood"] for path in sys.argv[1:3])
if not a or len(a) != len(b):
    sys.exit(f"parity: {len(a)} values on x86_64, {len(b)} on arm64")
worst = max(abs(x - y) for x, y in zip(a, b))
print(json.dumps({"rows": len(a), "max_abs_diff": worst, "x86_64_mean": sum(a) / len(a)}))
sys.exit(0 if worst < 1e-3 else f"parity: max abs diff {worst}")
EOF
}

client_round() {
  # A fresh federation every time: both daemons resume from their state directories otherwise.
  rm -rf "$WORK/agg" "$ROOTFS/tmp/fcl/client"
  mkdir -p "$WORK/agg"
  cat > "$WORK/agg/aggregator.yaml" <<EOF
broker: {url: "$BROKER_URL"}
out_dir: $WORK/agg/run
input_dim: 64
expected_clients: [arm64-0]
federation:
  name: arm64check
  method: fedavg
  num_tasks: 1
  rounds_per_task: 1
  model: {hidden_sizes: [128], num_orders: 4, mask_seed: 1}
  rounds: {deadline_s: 1800, start_timeout_s: 1800}
EOF
  cat > "$ROOTFS/tmp/fcl/client.yaml" <<EOF
client_id: arm64-0
federation: arm64check
broker: {url: "$BROKER_URL"}
out_dir: /tmp/fcl/client
threads: 1
data:
  dataset: digits
  client_tasks: [[[0, 1, 2, 3, 4]]]
  client_index: 0
EOF
  (cd "$REPO" && exec "$PY" -m fcl_edge.cli aggregator --config "$WORK/agg/aggregator.yaml" \
    > "$WORK/agg/aggregator.log" 2>&1) &
  AGG_PID=$!
  local t0=$SECONDS
  in_root /opt/fcl-edge/venv/bin/fcl client --config /tmp/fcl/client.yaml > "$WORK/client.arm64.log" 2>&1 \
    || die "arm64 client exited $?; see $WORK/client.arm64.log"
  printf '%-22s %6d s\n' "  client process" "$((SECONDS - t0))" | tee -a "$TIMINGS"
  wait "$AGG_PID" || die "aggregator exited $?; see $WORK/agg/aggregator.log"
  AGG_PID=
  grep '"round_client"' "$WORK/agg/run/metrics.jsonl" | tee "$WORK/round_client.jsonl" | grep -q '"accepted"' \
    || die "no accepted update in $WORK/agg/run/metrics.jsonl"
}

main() {
  local t0=$SECONDS
  preflight
  step debootstrap bootstrap
  step mount mount_root
  step wheel build_wheel
  step pip-torch install_torch
  step pip-fcl-edge install_package
  step broker start_broker
  step host-model host_model
  step infer-parity infer_parity
  step client-round client_round
  printf '%-22s %6d s\n' total "$((SECONDS - t0))" | tee -a "$TIMINGS"
  say "OK: arm64 userland ran fcl infer (parity with x86_64) and one client round; timings in $TIMINGS"
}

main
