#!/usr/bin/env bash
# The headless browser of the console's browser test (tests/acceptance/test_console_browser.py,
# `make test-browser`): Debian's chromium package, installed once with apt-get (Playwright's own
# browser download is not used: the test launches /usr/bin/chromium through Playwright's driver).
#
# Usage: scripts/browser.sh [path]
#   Installs chromium when it is missing and prints the path of its executable on stdout
#   (progress goes to stderr). Exits non-zero with one line when it cannot be installed.
#
# Environment:
#   LEDGERBOX_CHROMIUM  a chromium executable to use instead (nothing is installed then)
set -euo pipefail

log() { printf '[browser] %s\n' "$*" >&2; }
die() { printf '[browser] ERROR: %s\n' "$*" >&2; exit 1; }

if [ -n "${LEDGERBOX_CHROMIUM:-}" ]; then
  [ -x "$LEDGERBOX_CHROMIUM" ] || die "LEDGERBOX_CHROMIUM=$LEDGERBOX_CHROMIUM is not executable"
  printf '%s\n' "$LEDGERBOX_CHROMIUM"
  exit 0
fi

BIN=/usr/bin/chromium
if [ ! -x "$BIN" ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to apt-get install chromium"
    sudo="sudo"
  fi
  log "apt-get update"
  $sudo apt-get update -q >&2 || die "apt-get update failed"
  log "apt-get install -y chromium"
  # Fonts: without one the screenshots show empty boxes instead of text.
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    chromium fonts-dejavu-core >&2 || die "apt-get install chromium failed"
fi
[ -x "$BIN" ] || die "chromium is not at $BIN after the install"
printf '%s\n' "$BIN"
