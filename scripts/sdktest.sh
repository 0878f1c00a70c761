#!/usr/bin/env bash
# Installs the official SDKs that server/sdk_test.go drives the proxy with (sdktest/,
# pinned by package-lock.json). Needs node ≥ 20 and npm.
set -euo pipefail
cd "$(dirname "$0")/../sdktest"
command -v node >/dev/null || { echo "sdktest: node is missing (want node ≥ 20)" >&2; exit 1; }
command -v npm >/dev/null || { echo "sdktest: npm is missing" >&2; exit 1; }
npm ci --no-audit --no-fund
