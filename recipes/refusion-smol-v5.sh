#!/usr/bin/env bash
# Reproduces refusion-smol v5's adapter (src/refusion/assets/refusion-smol/adapter): v4's adapter trained further by
# v4's recipe (src/refusion/recipes/refusion-smol-v4.yaml: every distilled set of recipes/data, rank 16, the same
# objective) for a second run of 1200 steps in a new order (seed 5); docs/MODEL_CARD.md. Run from the repository
# root inside the README's venv, after v4's recipe (its training output) or with V4=DIR naming v4's adapter; each
# stage resumes or is skipped when its output exists.
#   bash recipes/refusion-smol-v5.sh [OUTPUT_DIR]   (default runs/refusion-smol-v5)
#   V4=DIR: v4's adapter to start from (default: runs/refusion-smol-v4/train/adapter, v4's recipe's training output;
#   v4's shipped adapter itself: `git archive 4f268f6 src/refusion/assets/refusion-smol/adapter`)
# 1. training: 1200 steps of 16 samples, bf16 (the shipped run: one H100, ~9.5 min with the model's first load;
#    ~12 h on 2 CPU cores)
# 2. packaging: the adapter in bf16, where `refusion.load()` finds it (the draft table beside it is left as it is:
#    recipes/refusion-smol-table.sh makes it).
set -euo pipefail
OUT=${1:-runs/refusion-smol-v5}
mkdir -p "$OUT"
V4=${V4:-runs/refusion-smol-v4/train/adapter}
if [ ! -f "$V4/adapter_config.json" ]; then
  echo "refusion-smol-v5: no v4 adapter at $V4: run bash recipes/refusion-smol-v4.sh first (or set V4=DIR)" >&2; exit 1
fi
if [ ! -f "$OUT/train/refusion_train.json" ]; then
  if [ -d "$OUT/train/checkpoints" ]; then
    refusion train --config refusion-smol-v4 --lora-init "$V4" --seed 5 --max-steps 1200 --output "$OUT/train" --resume
  else
    refusion train --config refusion-smol-v4 --lora-init "$V4" --seed 5 --max-steps 1200 --output "$OUT/train"
  fi
fi
refusion export-adapter "$OUT/train/adapter" src/refusion/assets/refusion-smol/adapter --overwrite
