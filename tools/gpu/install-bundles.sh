#!/usr/bin/env bash
# On the GPU machine, from the checkout root: unpack the bundles of tools/gpu/build-bundles.sh that
# travelled with this call (.gpu-wheels/*/BUNDLE), each into its own site, and check once that the
# modules each bundle needs import there.
#
#   bash tools/gpu/install-bundles.sh [--need NAME...]
#
# Idempotent, like shared/gpu/install-on-device.sh (the same stamps, so neither unpacks a part the
# other did): a bundle already unpacked (same sha256) is skipped. A bundle in chunks (vllm-1,
# vllm-2, ...: one call each, while the machine stays warm) is kept chunk by chunk in $STASH until
# all have come, then joined, checked against its sha256 and unpacked. --need NAME... exits 3
# unless those bundles are installed now (a chunk or part not sent, or the machine was released in
# between: start again from the first). Prints, per installed bundle, the PYTHONPATH its runs use.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)   # the checkout, wherever this is started from
STASH=${STASH:-/tmp/bundle-chunks}
REG=${REG:-/tmp/bundle-registry}   # the BUNDLE file of every bundle seen on this machine
T0=$(date +%s)
log() { echo "[install-bundles +$(( $(date +%s) - T0 ))s] $*"; }
need=()
if [ "${1:-}" = "--need" ]; then shift; need=("$@"); fi

installed() {  # installed SITE ARCHIVE SHA: the stamp shared/gpu/install-on-device.sh writes too
  [ -e "$1/.installed-${3:0:16}-$2" ]
}

unpack() {  # unpack FILE SITE ARCHIVE SHA
  local file=$1 site=$2 archive=$3 sha=$4 t
  t=$(date +%s)
  mkdir -p "$site"
  if command -v xz >/dev/null; then tar -xJf "$file" -C "$site" || return 1
  else python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$file" "$site" || return 1; fi
  touch "$site/.installed-${sha:0:16}-$archive"
  log "unpacked $archive into $site in $(( $(date +%s) - t )) s"
}

take() {  # take DIR: unpack the bundle (or keep the chunk) in DIR
  local dir=$1 name='' site='' archive='' sha256='' chunks='' got have c joined parts
  # shellcheck disable=SC1091
  source "$dir/BUNDLE"
  cp "$dir/BUNDLE" "$REG/$name"
  if installed "$site" "$archive" "$sha256"; then log "$name already in $site"; return 0; fi
  read -r -a parts <<< "$chunks"
  if [ "${#parts[@]}" = 1 ] && [ "${parts[0]}" = "$archive" ]; then
    got=$(sha256sum "$dir/$archive" | cut -d' ' -f1)
    if [ "$got" != "$sha256" ]; then log "$name: $archive has sha256 $got, BUNDLE says $sha256: not unpacked"; return 1; fi
    unpack "$dir/$archive" "$site" "$archive" "$sha256"
    return
  fi
  mkdir -p "$STASH/$name"
  for c in "$dir/$archive".[0-9][0-9]; do
    if [ -e "$c" ] && [ ! -e "$STASH/$name/$(basename "$c")" ]; then
      cp "$c" "$STASH/$name/" && log "$name: kept chunk $(basename "$c") in $STASH/$name"
    fi
  done
  have=0
  for c in "${parts[@]}"; do [ -e "$STASH/$name/$c" ] && have=$((have + 1)); done
  if [ "$have" -lt "${#parts[@]}" ]; then log "$name: $have of ${#parts[@]} chunks here so far"; return 0; fi
  joined="$STASH/$name/$archive"
  (cd "$STASH/$name" && cat "${parts[@]}") > "$joined"
  got=$(sha256sum "$joined" | cut -d' ' -f1)
  if [ "$got" != "$sha256" ]; then
    log "$name: joined chunks have sha256 $got, BUNDLE says $sha256 (chunks of two builds?): not unpacked"
    rm -rf "${STASH:?}/$name"; return 1
  fi
  unpack "$joined" "$site" "$archive" "$sha256" && rm -rf "${STASH:?}/$name"
}

check() {  # check REGFILE: the bundle's modules import under its PYTHONPATH (once; the result is kept)
  local name='' site='' archive='' sha256='' check='' pythonpath='' result
  # shellcheck disable=SC1090
  source "$1"
  installed "$site" "$archive" "$sha256" || return 0
  result="$site/.checked-${sha256:0:16}-$name"
  if [ ! -e "$result" ]; then
    # From / : the checkout's rollout_backends/ must not shadow an installed one (python3 -c).
    # shellcheck disable=SC2086
    (cd / && PYTHONPATH=$pythonpath python3 -c '
import importlib, sys
bad = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as exc:  # noqa: BLE001 - list every missing piece
        bad.append(f"{m}: {type(exc).__name__}: {exc}")
print("\n".join(bad) if bad else "ok")' $check) > "$result" 2>&1
  fi
  if [ "$(tail -1 "$result")" = ok ]; then log "$name: imports ok; runs use PYTHONPATH=$pythonpath"; return 0; fi
  # A failure is not kept: it may be a part that comes in a later call (part2 imports part1's
  # pydantic); kept, it failed every later call (H100, 2026-12-06: part2 sent before part1).
  log "$name: IMPORT FAILED with PYTHONPATH=$pythonpath:"; tail -5 "$result"; rm -f "$result"; return 1
}

mkdir -p "$REG"
rc=0
for bundle in "$ROOT"/.gpu-wheels/*/BUNDLE; do
  [ -e "$bundle" ] || continue
  take "$(dirname "$bundle")" || rc=1
done
for reg in "$REG"/*; do
  [ -e "$reg" ] || continue
  check "$reg" || rc=1
done
for n in "${need[@]}"; do
  site='' archive='' sha256=''
  # shellcheck disable=SC1090
  [ -e "$REG/$n" ] && source "$REG/$n"
  if [ -z "$site" ] || ! installed "$site" "$archive" "$sha256"; then
    log "needed bundle $n is not installed (a chunk or part not sent, or the machine was released in between)"
    exit 3
  fi
done
exit $rc
