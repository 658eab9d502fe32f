#!/usr/bin/env bash
# Issues #23 (cheaper drafts) and #24 (TriForce): the GPU runs, each step one device call of at most 10 minutes
# (every script writes its JSON after each row, so a call cut short keeps what it finished). Results land under
# results/ in the device's copy of the repo and come back as one tar in $OUT. SmolLM2's GGUF first travels in two
# calls (benchmarks/issue5_gpu.sh part_a, then `smol` here runs its setup).
#   bash benchmarks/issue23_24_gpu.sh quant       # H100: the int8/fp8 kernel per linear, a draft step's kernels, 8B e2e
#   bash benchmarks/issue23_24_gpu.sh smol        # H100, after part_a: SmolLM2 acceptance with int8/fp8 drafts (bf16)
#   bash benchmarks/issue23_24_gpu.sh real        # H100, after smol: the hierarchy on SmolLM2, prompt lookup beside
#                                                 #   transformers', SnapKV / retrieval selection time at 8B 32K x 13
#   bash benchmarks/issue23_24_gpu.sh offload     # H100: TriForce with the target's cache on the host, 128K
#   bash benchmarks/issue23_24_gpu.sh h200        # H200: TriForce's on-chip headline command; int8/fp8 drafts at 100K
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
name=$1
end=$(( $(date +%s) + ${BUDGET:-570} ))  # BUDGET: a few seconds under the device call's timeout
left() { echo $(( end - $(date +%s) )); }
# the log goes to $OUT as it is written: a call cut short still brings back what ran
step() { echo "== $* ($(left) s left)" | tee -a "$OUT/$name.log"; timeout "$(left)" "$@" 2>&1 | grep --line-buffered -v "^USDT\|^\s*$" | tee -a "$OUT/$name.log" | tail -40; }
pack() { tar czf "$OUT/$1.tgz" "${@:2}"; }
case "$1" in
  quant)
    bash benchmarks/issue5_gpu.sh part_a
    q=results/quant/speed_llama31_8b_splitk.json
    step python3 benchmarks/quant_speed.py --parts linears profile e2e --M 13 26 --alphas 0.8 --output $q
    step python3 benchmarks/quant_speed.py --parts e2e --alphas 0.77 --weights fp8 --output $q
    pack quant results/quant ;;
  smol)
    bash benchmarks/issue5_gpu.sh setup >/dev/null
    for P in 8000 4096; do
      step python3 benchmarks/draft_policies.py --model /tmp/smol/model.pth --dataset /tmp/books --no_progress \
        --prefix_lens $P --budgets 256 512 --policies streaming --draft_weights bf16 int8 fp8 \
        --skip_tokens 8000 15000 22000 --output results/quant/smollm2_gpu_P$P.json
    done
    pack smol results/quant/smollm2_gpu_* ;;
  real)
    step python3 benchmarks/hierarchy_real.py --model /tmp/smol/model.pth --dataset /tmp/books \
      --output results/triforce/hierarchy_smollm2.json
    step python3 benchmarks/draft_policy_speed.py --parts selection --output results/draft_policies/speed_selection.json
    step python3 benchmarks/transformers_side_by_side.py --model /tmp/smol/model.pth --dataset /tmp/books \
      --prefix_lens 4096 --batch_sizes 1 --gen_len 128 --budgets 512 --gammas 2 3 4 --no_progress \
      --output_dir results/lookup/side_by_side_smollm2
    pack real results/triforce results/draft_policies/speed_selection.json results/lookup/side_by_side_smollm2 ;;
  offload)
    step python3 benchmarks/triforce_speed.py --parts offload --gen_len 32 --repeats 1 \
      --output results/triforce/offload.json
    pack offload results/triforce ;;
  h200)
    step python3 benchmarks/triforce_speed.py --parts on_chip --output results/triforce/on_chip.json
    h=results/quant/speed_llama31_8b_100k.json
    for B in 9 8; do  # the largest batch an H200 holds at 100K beside an int8 copy, if the memory check agrees
      step python3 benchmarks/quant_speed.py --parts e2e --prefix_len 100000 --B $B --alphas 0.8 --output $h
      grep -q '"int8 alpha=0.8"' $h 2>/dev/null && break
      rm -f $h  # refused (or cut short) at this batch: the next one starts clean
    done
    step python3 benchmarks/quant_speed.py --parts e2e --prefix_len 100000 --B $B --alphas 0.77 --weights fp8 --output $h
    pack h200 results/triforce $h ;;
esac
