#!/usr/bin/env bash
# Issues #23 (cheaper drafts) and #24 (TriForce): the GPU runs, each step one device call of at most 10 minutes
# (every script writes its JSON after each row, so a call cut short keeps what it finished). Results land under
# results/ in the device's copy of the repo and come back as one tar in $OUT. `real` needs SmolLM2 and the books on
# the device first: its GGUF travels in two calls, `bash benchmarks/issue5_gpu.sh part_a`, then
# `bash benchmarks/issue5_gpu.sh setup` (which converts it to /tmp/smol and unpacks the books to /tmp/books).
# (The int8/fp8 draft runs of issue #23 were here; --draft_weights is removed: results/quant/README.md.)
#   bash benchmarks/issue23_24_gpu.sh real        # H100, after setup: the hierarchy on SmolLM2, prompt lookup beside
#                                                 #   transformers', SnapKV / retrieval selection time at 8B 32K x 13
#   bash benchmarks/issue23_24_gpu.sh offload     # H100: TriForce with the target's cache on the host, 128K
#   bash benchmarks/issue23_24_gpu.sh h200        # H200: TriForce's on-chip headline command
#   bash benchmarks/issue23_24_gpu.sh profile     # H100: the 8B draft step's kernels and graphed time, 32K x 11, and
#                                                 #   the split-KV kernel alone over block sizes and split counts
#   COMMITS="a b" bash benchmarks/issue23_24_gpu.sh before  # H100: the same profile at earlier commits, each
#                                                 #   unpacked under .carry/old/COMMIT (git archive + this profiler)
#   bash benchmarks/issue23_24_gpu.sh e2e         # H100: self-speculation at 8B 32K x 13, budget 512, alpha 0.8
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
name=$1
end=$(( $(date +%s) + ${BUDGET:-570} ))  # BUDGET: a few seconds under the device call's timeout
left() { echo $(( end - $(date +%s) )); }
# the log goes to $OUT as it is written: a call cut short still brings back what ran
step() { echo "== $* ($(left) s left)" | tee -a "$OUT/$name.log"; timeout "$(left)" "$@" 2>&1 | grep --line-buffered -v "^USDT\|^\s*$" | tee -a "$OUT/$name.log" | tail -40; }
pack() { tar czf "$OUT/$1.tgz" "${@:2}"; }
case "$1" in
  real)
    step python3 benchmarks/hierarchy_real.py --model /tmp/smol/model.pth --dataset /tmp/books \
      --output results/triforce/hierarchy_smollm2.json
    step python3 benchmarks/draft_policy_speed.py --parts selection --output results/draft_policies/speed_selection.json
    step python3 benchmarks/transformers_side_by_side.py --model /tmp/smol/model.pth --dataset /tmp/books \
      --prefix_lens 4096 --batch_sizes 1 --gen_len 128 --budgets 512 --gammas 2 3 4 --no_progress \
      --output_dir results/lookup/side_by_side_smollm2
    pack real results/triforce results/draft_policies/speed_selection.json results/lookup/side_by_side_smollm2 ;;
  offload)
    # 96 tokens: at 32 (offload.json) each sequence's last 13-token verification is cut short (4.21x, not 5.90x)
    step python3 benchmarks/triforce_speed.py --parts offload --gen_len 96 --repeats 1 \
      --output results/triforce/offload_gen96.json
    pack offload results/triforce ;;
  profile)
    step python3 benchmarks/draft_step_profile.py --attention_sweep --output results/quant/draft_step_profile.json
    pack profile results/quant/draft_step_profile.json ;;
  before)
    for c in $COMMITS; do
      (cd ".carry/old/$c" && step python3 benchmarks/draft_step_profile.py --output "$OUT/draft_step_profile_$c.json")
    done ;;
  e2e)
    step python3 tests/selfspec_benchmark.py --model_name meta-llama/Meta-Llama-3.1-8B --random_weights --skip_prefill \
      --cuda_graphs --no_progress --B 13 --prefix_len 32768 --gen_len 64 --repeats 3 --draft_budget 512 --sinks 16 \
      --gamma 2 3 4 5 --synthetic_acceptance 0.8 --baseline --output results/quant/selfspec_32k_b13.json
    pack e2e results/quant/selfspec_32k_b13.json ;;
  h200)
    step python3 benchmarks/triforce_speed.py --parts on_chip --output results/triforce/on_chip.json
    pack h200 results/triforce ;;
esac
