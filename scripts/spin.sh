#!/usr/bin/env bash
# Makes sure SPIN (the model checker of docs/model/escrow.pml) and a C compiler are installed,
# installing them with apt-get when absent, like scripts/services.sh does for the services.
# Fails loudly: `make test` must never skip the model check for want of a tool.
set -euo pipefail

LOG_NAME=spin
# shellcheck source=apt.sh
. "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

if ! command -v spin >/dev/null; then apt_install spin; fi
if ! command -v gcc >/dev/null; then apt_install gcc; fi
command -v spin >/dev/null || die "spin is still missing"
log "$(spin -V | head -1)"
