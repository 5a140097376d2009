#!/usr/bin/env bash
# Reproduces the embedded model refusion-smol v2 (src/refusion/assets/refusion-smol/adapter) on one CPU.
# Run from the repository root inside the README's venv; every stage resumes or is skipped when its output
# exists, so an interrupted run is continued by running the script again.
#   bash recipes/refusion-smol-v2.sh [OUTPUT_DIR]        (default runs/refusion-smol-v2)
# 1. the distilled set: the base's greedy answers (recipes/refusion-smol-v2-distill.sh). The set the shipped
#    adapter was trained on is committed (recipes/data/refusion-smol-v2-distill.jsonl.gz), so this stage only
#    runs when it is missing; DISTILL_LIMIT=N (default 560, what this session distilled) is the prefix of the prompt mix it covers.
# 2. a mask-gated LoRA adapter trained on it (src/refusion/recipes/refusion-smol-v2.yaml)     ~70 min, 2 cores
# 3. packaging: the adapter in bf16 where `refusion.load()` finds it.
set -euo pipefail
OUT=${1:-runs/refusion-smol-v2}
DATA=recipes/data/refusion-smol-v2-distill.jsonl.gz
mkdir -p "$OUT"

if [ ! -f "$DATA" ]; then
  LIMIT=${DISTILL_LIMIT:-560} bash recipes/refusion-smol-v2-distill.sh "$OUT/distill"
  cp "$OUT/distill/refusion-smol-v2-distill.jsonl.gz" "$DATA"
fi

if [ ! -f "$OUT/train/refusion_train.json" ]; then
  if [ -d "$OUT/train/checkpoints" ]; then refusion train --config refusion-smol-v2 --output "$OUT/train" --resume
  else refusion train --config refusion-smol-v2 --output "$OUT/train"; fi
fi

refusion export-adapter "$OUT/train/adapter" src/refusion/assets/refusion-smol/adapter --overwrite
