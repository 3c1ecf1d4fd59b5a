#!/usr/bin/env bash
# Headless Chromium + chromedriver from Debian's packages, for the Airflow UI browser test
# (tests/test_pipeline_integration.py, `make test-all`). Idempotent; needs root (or sudo) only the first time.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  echo "setup: chromium $(chromium --version 2>/dev/null | awk '{print $2}') and chromedriver present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! command -v apt-get >/dev/null; then
  echo "setup: no apt-get here; install chromium + chromedriver yourself for the browser test" >&2
  exit 1
fi
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null \
  || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null; }
echo "setup: installed $(chromium --version)"
