#!/usr/bin/env bash
# Make a private CA, a broker (server) certificate and one client certificate per device,
# for Mosquitto's TLS listener (deploy/mosquitto/mosquitto.conf) and mqtts:// broker urls.
#
#   scripts/make-dev-certs.sh [-d DAYS] OUT_DIR SERVER_NAMES [CLIENT_ID ...]
#
#   SERVER_NAMES  comma-separated host names and IP addresses clients use to reach the
#                 broker, e.g. broker.local,192.168.1.10; all go into subjectAltName (the
#                 name the client dials must be one of them), the first is also the CN.
#   CLIENT_ID     a device id (or "aggregator"); its certificate's CN is the id, so
#                 Mosquitto's use_identity_as_username maps it onto the ACL's %u.
#
# Writes OUT_DIR/ca.crt ca.key server.crt server.key <id>.crt <id>.key.  An existing
# ca.crt/ca.key in OUT_DIR is reused, so running it again with new ids adds devices to the
# same CA (the server certificate is issued again each time; the old one stays valid).
# Keys are EC P-256, unencrypted (a daemon cannot type a passphrase), mode 0600.
# This is a development/small-fleet CA: keep ca.key off the broker and off the devices.
set -euo pipefail

days=825
while getopts "d:h" opt; do
  case $opt in
    d) days=$OPTARG ;;
    h) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "usage: $0 [-d DAYS] OUT_DIR SERVER_NAMES [CLIENT_ID ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ $# -lt 2 ]; then
  echo "usage: $0 [-d DAYS] OUT_DIR SERVER_NAMES [CLIENT_ID ...]" >&2
  exit 2
fi
command -v openssl >/dev/null || { echo "$0: openssl is not installed (apt-get install openssl)" >&2; exit 1; }
out=$1 names=$2
shift 2
case $days in ''|*[!0-9]*) echo "$0: -d: expected a number of days, got '$days'" >&2; exit 2 ;; esac
for id in "$@"; do
  if ! [[ $id =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || [ "$id" = ca ] || [ "$id" = server ]; then
    echo "$0: client id '$id': expected 1-64 characters from [A-Za-z0-9_.-], not 'ca' or 'server'" >&2
    exit 2
  fi
done

san="" san_names=()
IFS=',' read -r -a server_names <<< "$names"
for n in "${server_names[@]}"; do
  [ -n "$n" ] || continue
  san_names+=("$n")
  if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then san+="${san:+,}IP:$n"; else san+="${san:+,}DNS:$n"; fi
done
[ -n "$san" ] || { echo "$0: SERVER_NAMES: expected at least one host name or IP" >&2; exit 2; }

mkdir -p "$out"
umask 077
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# sign NAME CN EXTENSIONS: OUT_DIR/NAME.key + a CSR, signed by the CA into OUT_DIR/NAME.crt
sign() {
  local name=$1 cn=$2 ext=$3
  new_key "$out/$name.key"
  openssl req -new -key "$out/$name.key" -subj "/CN=$cn" -out "$tmp/$name.csr"
  printf '%s\n' "basicConstraints=critical,CA:FALSE" "subjectKeyIdentifier=hash" \
    "authorityKeyIdentifier=keyid,issuer" "$ext" > "$tmp/$name.ext"
  openssl x509 -req -in "$tmp/$name.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -CAserial "$out/ca.srl" -days "$days" -sha256 \
    -extfile "$tmp/$name.ext" -out "$out/$name.crt" 2>/dev/null
  chmod 644 "$out/$name.crt"
}

if [ -f "$out/ca.crt" ] && [ -f "$out/ca.key" ]; then
  echo "reusing the CA in $out"
else
  new_key "$out/ca.key"
  openssl req -x509 -new -key "$out/ca.key" -subj "/CN=fcl-edge dev CA" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -addext "subjectKeyIdentifier=hash" -out "$out/ca.crt"
  chmod 644 "$out/ca.crt"
fi

sign server "${san_names[0]}" "$(printf '%s\n' "keyUsage=critical,digitalSignature" \
  "extendedKeyUsage=serverAuth" "subjectAltName=$san")"

for id in "$@"; do
  sign "$id" "$id" "$(printf '%s\n' "keyUsage=critical,digitalSignature" "extendedKeyUsage=clientAuth")"
done

echo "wrote $out: ca.crt, server.crt/.key ($san)${*:+, clients: $*}"
