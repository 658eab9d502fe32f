#!/usr/bin/env bash
# Issue #4's GPU measurements in one call on a multi-GPU machine (NCCL; NVLink multicast stays off):
#   OUT=results/issue4 bash benchmarks/issue4_gpu.sh
# Llama-3.1-8B shape, random weights, bf16, CUDA graphs, prefill skipped (random KV): baseline decode at prefix 32K for TP = 1, 2, 4, then
# baseline vs self-speculation (budget 512, synthetic acceptance 0.8) at prefix 100K, B=32, TP=4.
set -u
OUT=${OUT:-results/issue4}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
L31="--random_weights --model_name meta-llama/Meta-Llama-3.1-8B --gen_len 64 --cuda_graphs --no_progress --skip_prefill"
run() {  # name, nproc, script, flags
  local name=$1 n=$2 script=$3; shift 3
  local ranks; ranks=$(seq -s ' ' 0 $((n - 1)))
  echo "== $name: torchrun --standalone --nproc_per_node=$n tests/$script --rank_group $ranks $*" | tee -a "$OUT/commands.txt"
  timeout "${LIMIT:-150}" torchrun --standalone --nproc_per_node="$n" "tests/$script" --rank_group $ranks "$@" \
    --output "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || { echo "FAILED rc=$?"; grep -E "Error|error" "$OUT/$name.log" | tail -3; }
  grep -E "^(ms / step|decode tokens|measured_speedup|predicted_speedup |alpha|T_D|T_V)" "$OUT/$name.log"
}
LIMIT=200 run tp4_selfspec_B32_100k 4 selfspec_benchmark.py $L31 --B 32 --prefix_len 100000 --gamma 3 \
  --streamingllm_budget 512 --synthetic_acceptance 0.8 --baseline
for n in 4 2 1; do LIMIT=90 run tp${n}_baseline_B8_32k "$n" baseline_benchmark.py $L31 --B 8 --prefix_len 32768; done
