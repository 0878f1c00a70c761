#!/usr/bin/env bash
# Makes sure wrk (the HTTP load generator `make bench` drives) is installed, from the Debian
# package when absent. Fails loudly: the bench never falls back to printing a table without it.
set -euo pipefail
if command -v wrk >/dev/null; then exit 0; fi
echo "wrk: installing the Debian package with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq >/dev/null 2>&1 || true
$SUDO apt-get install -y -qq wrk >/dev/null || { echo "wrk: FATAL: apt-get install wrk failed" >&2; exit 1; }
command -v wrk >/dev/null || { echo "wrk: FATAL: wrk still not on PATH" >&2; exit 1; }
