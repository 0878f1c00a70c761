# Sourced by the scripts that make sure a tool is installed (services.sh, spin.sh): log and die
# under the script's name ($LOG_NAME), and apt_install, which installs packages with apt-get and
# dies when it cannot.

log() { printf '%s: %s\n' "$LOG_NAME" "$*" >&2; }
die() { log "FATAL: $*"; exit 1; }

apt_install() {
  log "installing $* with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null 2>&1 || true
  apt-get install -y -qq "$@" >/dev/null || die "apt-get install $* failed"
}
