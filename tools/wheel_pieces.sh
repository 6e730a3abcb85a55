#!/usr/bin/env bash
# Carry a wheel that a machine lacks in pieces of at most 60 MB (e.g. onnxruntime-gpu, ~256 MB), and put it
# back together there.
#
#   bash tools/wheel_pieces.sh split WHEEL [DIR]   # DIR/WHEEL.part-aa, -ab, ... and DIR/WHEEL.sha256
#   bash tools/wheel_pieces.sh join DIR [OUTDIR]   # OUTDIR/WHEEL (checked against its sha256), path printed
#
# then: pip install --no-deps OUTDIR/WHEEL   (--no-deps: install nothing else from the wheel's requirements)
# PIECE_BYTES=N changes the piece size (default 60000000).
set -euo pipefail
die() { echo "wheel_pieces: error: $*" >&2; exit 2; }
case "${1:-}" in
  split)
    wheel="${2:-}"; [ -f "$wheel" ] || die "no wheel file '$wheel'; usage: split WHEEL [DIR]"
    dir="${3:-$(dirname "$wheel")}"; mkdir -p "$dir"
    name="$(basename "$wheel")"
    (cd "$(dirname "$wheel")" && sha256sum "$name") > "$dir/$name.sha256"
    split -b "${PIECE_BYTES:-60000000}" -a 2 "$wheel" "$dir/$name.part-"  # 60 MB (< 60 MiB): under either limit
    ls -l "$dir/$name".part-* "$dir/$name.sha256"
    ;;
  join)
    dir="${2:-}"; [ -d "$dir" ] || die "no folder '$dir'; usage: join DIR [OUTDIR]"
    out="${3:-$dir}"; mkdir -p "$out"
    dir="$(cd "$dir" && pwd)"
    sums=("$dir"/*.sha256); [ -f "${sums[0]}" ] || die "no WHEEL.sha256 in $dir (made by: split)"
    for sum in "${sums[@]}"; do
      name="$(basename "$sum" .sha256)"
      parts=("$dir/$name".part-*); [ -f "${parts[0]}" ] || die "no pieces $dir/$name.part-*"
      cat "${parts[@]}" > "$out/$name.tmp"   # the glob sorts -aa, -ab, ... in order
      if ! echo "$(cut -d' ' -f1 "$sum")  $out/$name.tmp" | sha256sum -c --quiet --status; then
        rm -f "$out/$name.tmp"
        die "the pieces of $name do not match $sum: a piece is missing or damaged"
      fi
      mv "$out/$name.tmp" "$out/$name"
      echo "$out/$name"
    done
    ;;
  *) die "usage: wheel_pieces.sh split WHEEL [DIR] | join DIR [OUTDIR]" ;;
esac
