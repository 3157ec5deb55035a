#!/usr/bin/env bash
# What the tests need from the system, beside setup.sh's .venv: the viewer's browser tests
# (tests/test_view.py, tests/test_loop.py) open it in headless Chromium. Debian's package is
# installed where apt-get runs as root on Debian (a fresh CI machine); elsewhere this says what to
# install. Part of the test command (README, .ci/run), not of setup: a user's run needs no browser.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then
  echo "tests/system.sh: installing Debian's chromium (headless, for the viewer's browser tests)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
    >/dev/null 2>&1 || { echo "tests/system.sh: apt-get install chromium failed" >&2; exit 1; }
else
  echo "tests/system.sh: no chromium on PATH; the viewer's browser tests need it: install Chromium" >&2
fi
