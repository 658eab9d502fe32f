#!/usr/bin/env bash
# benchmarks/draft_policies.py on the device for SmolLM2 (after `bash benchmarks/issue5_gpu.sh part_a` in the call
# before, carrying .carry/a; this call carries .carry/b): one JSON per prefix, the longest first, in SECONDS in all.
#   bash benchmarks/draft_policies_gpu.sh SECONDS [PREFIX...]
set -u
bash benchmarks/issue5_gpu.sh setup > /tmp/setup.log 2>&1 || { tail -5 /tmp/setup.log; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
end=$(( $(date +%s) + $1 )); shift
mkdir -p results/draft_policies
prefixes=("$@"); (( ${#prefixes[@]} )) || prefixes=(8000 4096 2048)
for P in "${prefixes[@]}"; do
  left=$(( end - $(date +%s) ))
  (( left > 20 )) || break
  timeout "$left" python3 benchmarks/draft_policies.py --model /tmp/smol/model.pth --dataset /tmp/books --no_progress \
    --prefix_lens $P --output "results/draft_policies/smollm2_P$P.json" 2>&1 | tail -16
  cp "results/draft_policies/smollm2_P$P.json" "$OUT/" 2>/dev/null
done
