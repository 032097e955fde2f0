#!/usr/bin/env bash
# On the GPU machine, last in a call: a device call brings back at most 8 files from $OUT (and none more than two
# folders down), and silently keeps the rest (/work/.library/device/README.md, "Limits"). When the folder holds more
# than MAX files (default 7: room for the tee'd call log), this packs every file under it into one out.tar.gz (paths
# relative to the folder) and removes the packed files, so nothing is lost. Unpack here with
#   tar -xzf FILES_AT/out.tar.gz -C DEST
#   scripts/gpu_bundle_out.sh [FOLDER] [MAX]        (FOLDER defaults to $OUT)
set -uo pipefail
folder=${1:-${OUT:-}}
max=${2:-7}
[ -n "$folder" ] && [ -d "$folder" ] || { echo "gpu_bundle_out: no folder (give one or set OUT)" >&2; exit 2; }
cd "$folder" || exit 2
mapfile -t files < <(find . -type f ! -name out.tar.gz | sort)
if [ "${#files[@]}" -le "$max" ]; then
  echo "gpu_bundle_out: ${#files[@]} files, left as they are"
  exit 0
fi
if tar -czf out.tar.gz.part "${files[@]}" && mv out.tar.gz.part out.tar.gz; then
  rm -f "${files[@]}"
  find . -mindepth 1 -type d -empty -delete
  echo "gpu_bundle_out: ${#files[@]} files packed into out.tar.gz ($(du -h out.tar.gz | cut -f1))"
else
  rm -f out.tar.gz.part
  echo "gpu_bundle_out: packing failed; the files are left as they are" >&2
  exit 1
fi
