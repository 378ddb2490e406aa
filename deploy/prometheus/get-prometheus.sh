#!/usr/bin/env bash
# Prometheus server, promtool and the Pushgateway for the monitoring tests (tests/test_monitoring.py), without
# root: Debian's `prometheus` and `prometheus-pushgateway` packages, downloaded with `apt-get download` and
# unpacked with `dpkg -x` into .venv/prometheus/ (or $1). Idempotent: does nothing when the binaries are there
# and run. Prints the folder that holds `prometheus`, `promtool` and `prometheus-pushgateway`.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${1:-$here/.venv/prometheus}"
bin="$dest/usr/bin"
if [ -x "$bin/prometheus" ] && [ -x "$bin/prometheus-pushgateway" ] && "$bin/promtool" --version >/dev/null 2>&1; then
    echo "$bin"
    exit 0
fi
command -v apt-get >/dev/null || { echo "get-prometheus: apt-get not found (needs a Debian/Ubuntu host)" >&2; exit 2; }
command -v dpkg >/dev/null || { echo "get-prometheus: dpkg not found (needs a Debian/Ubuntu host)" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# apt-get download writes into the working directory (as root it warns that _apt cannot write there: harmless)
# exact versions (Debian 12's), like every other dependency
PROMETHEUS_VERSION="2.42.0+ds-5+deb12u1"
PUSHGATEWAY_VERSION="1.5.1-2+b5"
if ! (cd "$tmp" && apt-get download -q "prometheus=$PROMETHEUS_VERSION" \
        "prometheus-pushgateway=$PUSHGATEWAY_VERSION" >"$tmp/apt.log" 2>&1); then
    cat "$tmp/apt.log" >&2
    echo "get-prometheus: apt-get download failed (run apt-get update, or check access to the Debian mirror)" >&2
    exit 1
fi
grep -v "unsandboxed as root" "$tmp/apt.log" >&2 || true
for deb in "$tmp"/prometheus_*.deb "$tmp"/prometheus-pushgateway_*.deb; do
    dpkg -x "$deb" "$tmp/x"
done
mkdir -p "$(dirname "$dest")"
rm -rf "$dest.tmp" && mv "$tmp/x" "$dest.tmp"
rm -rf "$dest" && mv "$dest.tmp" "$dest"  # whole or not at all: a half-unpacked folder never looks installed
"$bin/promtool" --version >&2
echo "$bin"
