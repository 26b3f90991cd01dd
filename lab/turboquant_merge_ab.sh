#!/usr/bin/env bash
# A split-merge candidate (lab/turboquant_merge_candidates/*.diff) timed against the shipped merge on one GPU,
# in one device call:
#
#   ONESPARK_WHEEL=onespark.whl lab/turboquant_merge_ab.sh lab/turboquant_merge_candidates/NAME.diff
#
# The wheel (built at this commit) runs the checkout's lab/turboquant_cuda.py as shipped
# (OUT/turboquant_cuda_<gpu>_shipped.json). Then a copy of the files the diff touches is patched, the copy of the wheel
# gets the patched kernels/, and the patched bench runs on it (OUT/turboquant_cuda_<gpu>_<name>.json). Both check
# both kernels against float64 before timing; the CUDA kernel's sources are the same in both, so they share one
# build (ONESPARK_CUDA_BUILD, else WORK/build; TORCH_CUDA_ARCH_LIST, 9.0 unless set). Last, one table: each kernel's
# time over BF16 flash with the GQA heads folded, shipped and candidate, side by side.
set -euo pipefail
cd "$(dirname "$0")/.."

me=turboquant_merge_ab.sh
(($# == 1)) || { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
diff=$1
[[ -f $diff ]] || { echo "$me: no diff file '$diff' (a candidate under lab/turboquant_merge_candidates/)" >&2; exit 2; }
PKG_PATH=${ONESPARK_WHEEL:?$me: set ONESPARK_WHEEL to the onespark wheel built at this commit}
[[ -f $PKG_PATH ]] || { echo "$me: ONESPARK_WHEEL: no file '$PKG_PATH' (build it: python3 -m pip wheel --no-deps -w DIR .)" >&2; exit 2; }
name=$(basename "$diff" .diff)
[[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "$me: name the diff [A-Za-z0-9_-].diff, got '$name'" >&2; exit 2; }
diff=$(realpath "$diff")
out=${OUT:-bench/results} work=${WORK:-$(mktemp -d)}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export ONESPARK_CUDA_BUILD=${ONESPARK_CUDA_BUILD:-$work/build}
sha=${ONESPARK_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

# the candidate's files: every file the diff touches, copied from the checkout and patched there
tree=$work/tree_$name
mapfile -t touched < <(sed -n 's|^+++ b/||p' "$diff")
for rel in "${touched[@]}"; do
  mkdir -p "$tree/$(dirname "$rel")"
  cp "$rel" "$tree/$rel"
done
mkdir -p "$tree/lab" && cp -r lab/. "$tree/lab/"  # the lab's other modules (harness, turboquant) beside its patched script
mkdir -p "$tree/tests" && cp tests/_vllm_tree.py "$tree/tests/"  # lab/harness.py loads it from the tree's tests/
patch -s -p1 -d "$tree" <"$diff" || { echo "$me: $diff does not apply to this checkout" >&2; exit 2; }
for v in shipped "$name"; do
  rm -rf "$work/site_$v"
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$work/site_$v" "$PKG_PATH"
done
for rel in "${touched[@]}"; do  # the wheel's package holds kernels/ as onespark/kernels/
  [[ $rel != kernels/* ]] || cp "$tree/$rel" "$work/site_$name/onespark/$rel"
done

gpu=$(PYTHONPATH="$PWD/lab" python3 -c 'from harness import gpu_name; print(gpu_name())')
rc=0
echo "== shipped"
PYTHONPATH=$work/site_shipped python3 lab/turboquant_cuda.py --out "$out/turboquant_cuda_${gpu}_shipped.json" \
  --git-sha "$sha" | tail -2 || rc=1
echo "== $name"
PYTHONPATH=$work/site_$name python3 "$tree/lab/turboquant_cuda.py" --out "$out/turboquant_cuda_${gpu}_$name.json" \
  --git-sha "$sha+$name" | tail -2 || rc=1
python3 - "$out/turboquant_cuda_${gpu}_shipped.json" "$out/turboquant_cuda_${gpu}_$name.json" "$name" <<'EOF'
import json, sys
base, cand, name = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
print(f"depth   B T  folded_us  triton:shipped triton:{name}  cuda:shipped cuda:{name}   (x folded BF16, each run's own;"
      " then the same on a server's split grid, max_seq_len = max_model_len)")
for a, b in zip(base["rows"], cand["rows"]):
    fa, fb = a["fa_bf16_folded_ms"], b["fa_bf16_folded_ms"]
    line = (f"{a['depth']:>6} {a['batch']:>2} {a['q_len']} {fa * 1e3:9.1f}  {a['triton_ms'] / fa:14.3f} "
            f"{b['triton_ms'] / fb:{len(name) + 7}.3f}  {a['cuda_ms'] / fa:12.3f} {b['cuda_ms'] / fb:{len(name) + 5}.3f}")
    if "cuda_served_grid_ms" in a and "cuda_served_grid_ms" in b:
        line += (f"   grid: {a['triton_served_grid_ms'] / fa:.3f} {b['triton_served_grid_ms'] / fb:.3f}"
                 f"  {a['cuda_served_grid_ms'] / fa:.3f} {b['cuda_served_grid_ms'] / fb:.3f}")
    print(line)
EOF
exit "$rc"
