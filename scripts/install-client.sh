#!/usr/bin/env bash
# Install (or remove) the fcl-edge client daemon as a systemd service on a device.
#
#   sudo scripts/install-client.sh [options]                 # install and start
#   sudo scripts/install-client.sh --uninstall [--purge]     # remove
#
# Install: a virtualenv (default /opt/fcl-edge/venv) with fcl-edge and its device extras,
# the `fcl` system user, /etc/fcl-edge/client.yaml from configs/services/client.yaml (only if
# absent: an existing config is never overwritten), /etc/fcl-edge/client.env for secrets
# (mode 0600), and the unit /etc/systemd/system/fcl-client.service, enabled and started.
# Uninstall: stops and removes the unit, the virtualenv and the user; keeps the config and
# the state in /var/lib/fcl-edge/client unless --purge is given.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)

ROOT=/
PREFIX=
SOURCE=$REPO
EXTRAS=train,infer,export
TORCH_SPEC=
SYSTEM_SITE=0
SERVICE_USER=fcl
USE_SYSTEMD=1
DRY_RUN=0
ACTION=install
PURGE=0
PY=${PYTHON:-python3}
STAGE=
UNIT=fcl-client.service
TEMPLATE=$REPO/configs/services/client.yaml
UNIT_SOURCE=$REPO/deploy/systemd/$UNIT

usage() {
  # the header comment, from line 2 to the first line that is not a comment
  sed -n '2,/^[^#]/{/^#/!q;s/^# \{0,1\}//;p}' "$0"
  cat <<'EOF'

Options:
  --prefix DIR             virtualenv to create and use (default /opt/fcl-edge/venv, under --root)
  --source PATH            a checkout of fcl-edge or a wheel file (default: this checkout)
  --extras LIST            extras to install (default train,infer,export: export writes the served ONNX model)
  --torch SPEC             install this torch requirement first, e.g. 'torch==2.9.1' on a Raspberry Pi
                           (PyPI's aarch64 torch >= 2.11 is a CUDA build of several GB; on a Jetson install
                           NVIDIA's JetPack wheel system-wide and use --system-site-packages instead)
  --system-site-packages   let the virtualenv see system packages (a torch that is already installed)
  --python PATH            interpreter for the virtualenv (default python3, >= 3.10)
  --user NAME              service user (default fcl)
  --root DIR               install /etc and /var files under DIR (a fake root for tests and images);
                           the virtualenv goes to --prefix as given (virtualenvs cannot be moved)
  --no-systemd             write the unit but do not call systemctl
  --dry-run                print the steps, change nothing
  --uninstall              remove the unit, the virtualenv and the user
  --purge                  with --uninstall: also remove /etc/fcl-edge/client.* and the state directory
  -h, --help               this text
EOF
}

die() { echo "install-client: error: $*" >&2; exit 2; }
say() { echo "install-client: $*"; }

# run CMD...: print it; execute it unless --dry-run.
run() {
  echo "+ $*"
  [ "$DRY_RUN" = 1 ] || "$@"
}

parse_args() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
      --source) SOURCE=${2:?--source needs a path}; shift 2 ;;
      --extras) EXTRAS=${2:?--extras needs a list}; shift 2 ;;
      --torch) TORCH_SPEC=${2:?--torch needs a requirement}; shift 2 ;;
      --system-site-packages) SYSTEM_SITE=1; shift ;;
      --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
      --user) SERVICE_USER=${2:?--user needs a name}; shift 2 ;;
      --root) ROOT=${2:?--root needs a directory}; shift 2 ;;
      --no-systemd) USE_SYSTEMD=0; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      --uninstall) ACTION=uninstall; shift ;;
      --purge) PURGE=1; shift ;;
      -h|--help) usage; exit 0 ;;
      *) usage >&2; die "unknown option $1" ;;
    esac
  done
  [ "$PURGE" = 0 ] || [ "$ACTION" = uninstall ] || die "--purge only goes with --uninstall"
  if [ "$DRY_RUN" = 0 ]; then
    mkdir -p "$ROOT" || die "--root $ROOT: cannot create it"
  fi
  ROOT=$(cd "$ROOT" 2>/dev/null && pwd || echo "$ROOT")
  R=${ROOT%/}  # prefix for /etc, /var paths; empty for the real root
  PREFIX=${PREFIX:-$R/opt/fcl-edge/venv}
  case "$PREFIX" in
    /*) ;;
    *) PREFIX=$(pwd)/$PREFIX ;;
  esac
  case "$PREFIX" in
    *[[:space:]\"\'\\\$\;\&\|]*) die "--prefix $PREFIX: no spaces or shell/systemd special characters" ;;
  esac
  ETC=$R/etc/fcl-edge
  UNIT_PATH=$R/etc/systemd/system/$UNIT
  STATE=$R/var/lib/fcl-edge/client
}

real_root() { [ -z "$R" ]; }
systemd_running() { [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; }

# -- install -----------------------------------------------------------------------------------
check_python() {
  "$PY" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null \
    || die "$PY: need Python >= 3.10 with the venv module (apt-get install python3-venv)"
  [ -e "$SOURCE" ] || die "--source $SOURCE: no such file or directory"
  [ -f "$UNIT_SOURCE" ] || die "$UNIT_SOURCE is missing: run the script from an fcl-edge checkout"
}

make_venv() {
  if [ -x "$PREFIX/bin/python" ]; then
    say "reusing the virtualenv $PREFIX"
    return
  fi
  local opts=()
  [ "$SYSTEM_SITE" = 1 ] && opts+=(--system-site-packages)
  run "$PY" -m venv "${opts[@]}" "$PREFIX"
}

install_package() {
  local pip=("$PREFIX/bin/python" -m pip install --disable-pip-version-check)
  [ -z "$TORCH_SPEC" ] || run "${pip[@]}" "$TORCH_SPEC"
  if [ -d "$SOURCE" ]; then
    # From a clean copy: a stale build/ in the checkout would leak old modules into the install;
    # virtualenvs (.venv, venv, any folder holding a pyvenv.cfg) are left out, and a dry run stages nothing.
    if [ "$DRY_RUN" = 1 ]; then
      say "would stage a clean copy of $SOURCE (without build, dist, .git, runs, virtualenvs)"
      STAGE="<staged copy of $SOURCE>"
    else
      STAGE=$(mktemp -d)
      tar -C "$SOURCE" --exclude=./build --exclude=./dist --exclude=./.git --exclude=./runs \
        --exclude=./.venv --exclude=./venv --exclude-tag-all=pyvenv.cfg \
        --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$STAGE" -xf -
    fi
    run "${pip[@]}" "${STAGE}[$EXTRAS]"
  else
    run "${pip[@]}" "${SOURCE}[$EXTRAS]"
  fi
  [ "$DRY_RUN" = 1 ] || "$PREFIX/bin/fcl" --help >/dev/null || die "$PREFIX/bin/fcl does not run"
}

ensure_user() {
  if ! real_root; then
    say "not creating user $SERVICE_USER under --root $ROOT (the unit refers to it by name)"
    return
  fi
  if getent passwd "$SERVICE_USER" >/dev/null; then
    say "user $SERVICE_USER exists"
    return
  fi
  run useradd --system --user-group --home-dir /var/lib/fcl-edge --no-create-home \
    --shell /usr/sbin/nologin --comment "fcl-edge services" "$SERVICE_USER"
}

write_config() {
  run install -d -m 0755 "$ETC"
  if [ -e "$ETC/client.yaml" ]; then
    say "keeping the existing $ETC/client.yaml"
  else
    run install -m 0640 "$TEMPLATE" "$ETC/client.yaml"
    say "wrote $ETC/client.yaml from the example: set client_id, federation, broker and data"
  fi
  real_root && run chgrp "$SERVICE_USER" "$ETC/client.yaml"
  if [ ! -e "$ETC/client.env" ]; then
    echo "+ write $ETC/client.env (mode 0600)"
    if [ "$DRY_RUN" = 0 ]; then
      (umask 077 && printf '# Read by systemd (EnvironmentFile=) before it drops privileges.\n# FCL_MQTT_PASSWORD=\n' \
        > "$ETC/client.env")
    fi
  fi
}

write_unit() {
  run install -d -m 0755 "$(dirname "$UNIT_PATH")"
  echo "+ write $UNIT_PATH (@VENV@ -> $PREFIX)"
  [ "$DRY_RUN" = 1 ] && return
  local tmp=$UNIT_PATH.tmp
  sed "s|@VENV@|$PREFIX|g" "$UNIT_SOURCE" > "$tmp"
  if grep -q '@VENV@' "$tmp"; then rm -f "$tmp"; die "placeholder left in $UNIT_PATH"; fi
  chmod 0644 "$tmp"
  mv "$tmp" "$UNIT_PATH"
}

enable_unit() {
  if [ "$USE_SYSTEMD" = 0 ]; then
    say "--no-systemd: not enabling; later: systemctl daemon-reload && systemctl enable --now $UNIT"
  elif ! real_root; then
    run systemctl --root="$ROOT" enable "$UNIT"
  elif systemd_running; then
    run systemctl daemon-reload
    run systemctl enable --now "$UNIT"
    say "started; follow it with: journalctl -u $UNIT -f"
  else
    command -v systemctl >/dev/null 2>&1 || die "systemctl not found; use --no-systemd"
    run systemctl enable "$UNIT"
    say "systemd is not running here: enabled for the next boot only"
  fi
}

do_install() {
  check_python
  make_venv
  install_package
  ensure_user
  write_config
  write_unit
  enable_unit
  say "installed: $PREFIX, $UNIT_PATH, $ETC/client.yaml"
}

# -- uninstall ---------------------------------------------------------------------------------
remove_unit() {
  if [ "$USE_SYSTEMD" = 1 ] && real_root && systemd_running; then
    run systemctl disable --now "$UNIT" || true
  elif [ "$USE_SYSTEMD" = 1 ] && ! real_root && [ -e "$UNIT_PATH" ]; then
    run systemctl --root="$ROOT" disable "$UNIT" || true
  fi
  [ ! -e "$UNIT_PATH" ] || run rm -f "$UNIT_PATH"
  if [ "$USE_SYSTEMD" = 1 ] && real_root && systemd_running; then
    run systemctl daemon-reload
  fi
}

remove_venv() {
  if [ ! -e "$PREFIX" ]; then
    return
  fi
  [ -f "$PREFIX/pyvenv.cfg" ] || die "$PREFIX does not look like a virtualenv (no pyvenv.cfg); not removing it"
  run rm -rf "$PREFIX"
}

remove_user() {
  real_root || return 0
  getent passwd "$SERVICE_USER" >/dev/null || return 0
  if [ -e /etc/systemd/system/fcl-aggregator.service ]; then
    say "keeping user $SERVICE_USER: fcl-aggregator.service still runs as it"
    return
  fi
  run userdel "$SERVICE_USER"
}

purge_files() {
  if [ "$PURGE" = 0 ]; then
    say "kept $ETC/client.yaml, $ETC/client.env and $STATE (--purge removes them)"
    return
  fi
  run rm -f "$ETC/client.yaml" "$ETC/client.env"
  run rm -rf "$STATE"
  [ ! -d "$ETC" ] || run rmdir --ignore-fail-on-non-empty "$ETC"
  [ ! -d "$R/var/lib/fcl-edge" ] || run rmdir --ignore-fail-on-non-empty "$R/var/lib/fcl-edge"
}

do_uninstall() {
  remove_unit
  remove_venv
  remove_user
  purge_files
  say "uninstalled"
}

trap '[ -z "$STAGE" ] || rm -rf "$STAGE"' EXIT
parse_args "$@"
if [ "$ACTION" = install ]; then do_install; else do_uninstall; fi
