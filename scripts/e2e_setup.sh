#!/usr/bin/env bash
# Prerequisites of the browser tests (tests/e2e): Debian's Chromium and the Playwright Python package.
# Playwright only drives /usr/bin/chromium here: never run `playwright install`, which downloads browsers.
set -euo pipefail

if ! command -v chromium >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium
fi
python -m pip install -q playwright
chromium --version 2>/dev/null
python -c "import playwright.sync_api" && echo "playwright ok (drives $(command -v chromium))"
