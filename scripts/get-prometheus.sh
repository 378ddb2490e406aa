#!/usr/bin/env bash
# Prometheus server and promtool for the monitoring tests (tests/test_monitoring.py), without root:
# Debian's `prometheus` package, downloaded with `apt-get download` and unpacked with `dpkg -x` into
# .venv/prometheus/ (or $1). Idempotent: does nothing when promtool is already there and runs.
# Prints the folder that holds the `prometheus` and `promtool` binaries.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$here/.venv/prometheus}"
bin="$dest/usr/bin"
if [ -x "$bin/promtool" ] && [ -x "$bin/prometheus" ] && "$bin/promtool" --version >/dev/null 2>&1; then
    echo "$bin"
    exit 0
fi
command -v apt-get >/dev/null || { echo "get-prometheus: apt-get not found (needs a Debian/Ubuntu host)" >&2; exit 2; }
command -v dpkg >/dev/null || { echo "get-prometheus: dpkg not found (needs a Debian/Ubuntu host)" >&2; exit 2; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# apt-get download writes into the working directory; as root it warns that _apt cannot write there (harmless)
(cd "$tmp" && apt-get download -q prometheus >&2 2> >(grep -v "unsandboxed as root" >&2))
mkdir -p "$dest"
dpkg -x "$tmp"/prometheus_*.deb "$tmp/x"
rm -rf "$dest.tmp" && mv "$tmp/x" "$dest.tmp"
rm -rf "$dest" && mv "$dest.tmp" "$dest"  # whole or not at all: a half-unpacked folder never looks installed
"$bin/promtool" --version >&2
echo "$bin"
