#!/usr/bin/env bash
# Issue #2's GPU measurements, in one device call: baseline decode at the Llama-3.1-8B shape (random weights, bf16)
# and, when a converted SmolLM2 checkpoint is given, at SmolLM2-135M with real weights.
#   OUT=results/issue2 bash benchmarks/issue2_gpu.sh [path/to/smollm2/model.pth [gutenberg_dir]]
set -u
OUT=${OUT:-results/issue2}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {  # name, then benchmark flags
  local name=$1; shift
  echo "== $name: python tests/baseline_benchmark.py $*" | tee -a "$OUT/commands.txt"
  timeout 400 python3 tests/baseline_benchmark.py --no_progress --compile --output "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1 || { echo "FAILED rc=$?"; grep -E "Error|error" "$OUT/$name.log" | tail -3; }
  grep -E "^(decode|achieved|copy GB|fraction|prefill)" "$OUT/$name.log"
}
if [ -z "${1:-}" ]; then
  L31="--random_weights --model_name meta-llama/Meta-Llama-3.1-8B --gen_len 64"
  run llama31_8b_B1_4k $L31 --B 1 --prefix_len 4096
  run llama31_8b_B8_32k $L31 --B 8 --prefix_len 32768
  BMAX=$(python3 -c "import torch; from magicdec.config import ModelArgs; from magicdec.benchmark import largest_batch
print(largest_batch(ModelArgs.from_name('meta-llama/Meta-Llama-3.1-8B'), 65536, 64, torch.bfloat16, torch.device('cuda')))")
  run llama31_8b_B${BMAX}_64k $L31 --B "$BMAX" --prefix_len 65536
else
  run smollm2_B64_4k --model "$1" --dataset "${2:-auto}" --B 64 --prefix_len 4096 --gen_len 64
fi
