#!/usr/bin/env bash
# Variants of the CUDA decode kernel (kernels/turboquant_decode.cuh) timed side by side on one GPU, one run:
#
#   ONESPARK_WHEEL=onespark.whl lab/turboquant_cuda_variants.sh base PATCH.diff ...
#
# Each argument is `base` (the header as built), a unified diff against kernels/turboquant_decode.cuh (`patch
# -p1`), or diffs joined by + (applied in order: lean.diff+occ1.diff is the variant lean_occ1). Every variant gets its
# own copy of the wheel (WORK/site_<name>) and its own build (WORK/build_<name>; all built at once,
# TORCH_CUDA_ARCH_LIST, 9.0 unless set), then lab/turboquant_cuda.py checks it against float64 and times it
# (OUT/<name>.json); a diff named diag_*.diff leaves a stage out on purpose (wrong output), so it is timed unchecked
# (lab/turboquant_cuda_diagnostics/). Last, one table: each variant's time over BF16 flash with the GQA heads
# folded, at 3 and at 2 pipeline stages. Variants of 2026-12-04: bench/results/turboquant_cuda_variants_h200/.
set -euo pipefail
cd "$(dirname "$0")/.."

(($#)) || { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
PKG_PATH=${ONESPARK_WHEEL:?lab/turboquant_cuda_variants.sh: set ONESPARK_WHEEL to a built onespark wheel}
out=${OUT:-bench/results} work=${WORK:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
names=()
for arg in "$@"; do
  IFS=+ read -ra parts <<<"$arg"  # A.diff+B.diff: A, then B on top (variant A_B)
  name=base patches=()
  if [[ $arg != base ]]; then
    name=
    for part in "${parts[@]}"; do
      [[ -f $part ]] || { echo "turboquant_cuda_variants.sh: no patch file '$part' (or say base)" >&2; exit 2; }
      name+=${name:+_}$(basename "$part" .diff)
      patches+=("$(realpath "$part")")
    done
  fi
  [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "turboquant_cuda_variants.sh: name variants [A-Za-z0-9_-], got '$name'" >&2; exit 2; }
  site=$work/site_$name
  rm -rf "$site"
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" "$PKG_PATH"
  for patch_file in "${patches[@]}"; do
    patch -s -p1 -d "$site/onespark" <"$patch_file" \
      || { echo "turboquant_cuda_variants.sh: $patch_file does not apply to kernels/turboquant_decode.cuh" >&2; exit 2; }
  done
  names+=("$name")
done
# the wheel's package dir holds the header as onespark/kernels/turboquant_decode.cuh: the diffs' paths say kernels/
for name in "${names[@]}"; do
  PYTHONPATH=$work/site_$name ONESPARK_CUDA_BUILD=$work/build_$name \
    python3 -P -c "from onespark.kernels import turboquant_cuda as t; t.build()" >"$out/build_$name.log" 2>&1 &
done
wait
rc=0
for name in "${names[@]}"; do
  echo "== $name"
  unchecked=()
  [[ $name != diag_* ]] || unchecked=(--unchecked)
  PYTHONPATH=$work/site_$name ONESPARK_CUDA_BUILD=$work/build_$name python3 lab/turboquant_cuda.py \
    --out "$out/$name.json" --git-sha "${ONESPARK_GIT_SHA:-unknown}+$name" "${unchecked[@]}" | tail -2 || rc=1
done
python3 - "$out" "${names[@]}" <<'EOF'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {n: json.load(open(f"{out}/{n}.json")) for n in names}
print("depth   B T  folded_us  triton  " + "  ".join(f"{n}:3st {n}:2st" for n in names))
for i, row in enumerate(runs[names[0]]["rows"]):
    cells = [runs[n]["rows"][i]["cuda"][f"stages={s},waves=1"] / runs[n]["rows"][i]["fa_bf16_folded_ms"]
             for n in names for s in (3, 2)]
    print(f"{row['depth']:>6} {row['batch']:>2} {row['q_len']} {row['fa_bf16_folded_ms'] * 1e3:9.1f}  "
          f"{row['triton_over_folded']:.3f}  " + "  ".join(f"{c:.3f}" for c in cells))
EOF
exit "$rc"
