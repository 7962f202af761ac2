#!/usr/bin/env bash
# The Debian packages the tests use for real components: PostgreSQL 15 (a throw-away server per test session),
# chromium-headless-shell (the report's browser test) and b3sum (digests checked against the reference tool).
# Idempotent and quick when they are present; needs root (CI runs as root) to install what is missing.
set -euo pipefail
packages=(postgresql chromium-headless-shell b3sum)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-system-packages: missing ${missing[*]}; run as root (or: sudo apt-get install ${missing[*]})." >&2
  echo "install-system-packages: the tests that need them skip (and fail when CI=true)." >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-system-packages: installed ${missing[*]}"
