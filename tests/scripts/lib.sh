# Shared helpers for the project's scripts. Source it; do not run it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS="${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/modelcache-csi/tools}"
CSI_SANITY_VERSION="v5.5.0"
CSI_SANITY="$TOOLS/csi-sanity-$CSI_SANITY_VERSION/csi-sanity"

log() { printf '==> %s\n' "$*" >&2; }

# lowest CMD...: runs CMD at the lowest priority there is: SCHED_IDLE
# (it gets a core only when nothing else wants one, and any other task
# that wakes takes the core at once) where chrt can set it, else nice 19.
lowest() {
  if chrt --idle 0 true 2>/dev/null; then
    chrt --idle 0 nice -n 19 "$@"
  else
    nice -n 19 "$@"
  fi
}

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "$0 needs root: it mounts filesystems and attaches loop devices" >&2
    exit 1
  fi
}

apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# go install into a directory named by version, so a warm cache skips it.
# No symbol table or DWARF: test tools are never debugged here, and the
# linker's share of a cold build shrinks.
go_install() {
  local module="$1" dest="$2"
  [ -x "$dest" ] && return 0
  log "go install $module"
  mkdir -p "$(dirname "$dest")"
  GOBIN="$(dirname "$dest")" GOFLAGS=-mod=mod go install -trimpath -ldflags="-s -w" "$module"
}

# pip_venv PACKAGE VERSION MODULE [EXTRA==VERSION...]: PACKAGE==VERSION
# (and the pinned extras) from PyPI in a venv under $TOOLS named by version
# (MODULE must import); prints its python.
pip_venv() {
  local package="$1" version="$2" module="$3" venv="$TOOLS/$1-$2"
  shift 3
  if [ ! -f "$venv.complete" ]; then
    log "pip install $package==$version $* into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$package==$version" "$@" >&2
    "$venv/bin/python" -c "import $module" >&2
    touch "$venv.complete"
  fi
  echo "$venv/bin/python"
}
