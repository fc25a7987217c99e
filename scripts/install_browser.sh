#!/usr/bin/env bash
# Install a headless-capable Chromium for tests/test_service_browser.py (issue 7).
#
# Debian/Ubuntu: the distribution's `chromium` package (no snap, no network at test time).
# Idempotent: does nothing when a Chromium binary is already on PATH. Needs root (or sudo) for apt.
# Other systems: install Chromium/Chrome yourself and/or point FLAMIA_CHROMIUM at the binary; the
# browser test skips with a message when no binary exists.
set -euo pipefail

for b in chromium chromium-browser google-chrome google-chrome-stable; do
  if command -v "$b" >/dev/null 2>&1; then
    echo "browser present: $(command -v "$b") ($("$b" --version 2>/dev/null | head -n1))"
    exit 0
  fi
done

if ! command -v apt-get >/dev/null 2>&1; then
  echo "no apt-get here: install Chromium yourself or set FLAMIA_CHROMIUM; the browser test will skip" >&2
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "not root and no sudo: cannot apt-get install chromium; the browser test will skip" >&2
    exit 0
  fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
echo "installed: $(command -v chromium) ($(chromium --version 2>/dev/null | head -n1))"
