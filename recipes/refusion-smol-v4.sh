#!/usr/bin/env bash
# Reproduces refusion-smol v4's adapter (packaged into src/refusion/assets/refusion-smol/adapter; the shipped one is
# v5's, which recipes/refusion-smol-v5.sh trains from this script's output): v3's adapter, cut to rank 16 as
# v3 shipped, trained further at rank 16 on every distilled set of recipes/data, the 9,292 open-ended answers included
# (src/refusion/recipes/refusion-smol-v4.yaml; docs/MODEL_CARD.md). Run from the repository root inside the README's
# venv, after v3's recipe (its training output) or with V3=DIR naming a rank-16 v3 adapter; each stage resumes or
# is skipped when its output exists.
#   bash recipes/refusion-smol-v4.sh [OUTPUT_DIR]   (default runs/refusion-smol-v4)
#   V3=DIR: v3's rank-16 adapter to start from (default: v3's training output cut to rank 16, as the v3 recipe ships
#   it; v3's shipped adapter itself: `git archive ce6fb51 src/refusion/assets/refusion-smol/adapter`)
# 1. training: 700 steps of 16 samples, bf16 (the shipped run: one H100, ~5.5 min; ~7 h on 2 CPU cores)
# 2. packaging: the adapter in bf16, where `refusion.load()` finds it (the draft table beside it is left as it is:
#    recipes/refusion-smol-table.sh makes it).
set -euo pipefail
OUT=${1:-runs/refusion-smol-v4}
mkdir -p "$OUT"
V3=${V3:-$OUT/v3-rank16}
if [ ! -f "$V3/adapter_config.json" ]; then
  if [ ! -f runs/refusion-smol-v3/continue/adapter/adapter_config.json ]; then
    echo "refusion-smol-v4: no v3 adapter: run bash recipes/refusion-smol-v3.sh first (or set V3=DIR)" >&2; exit 1
  fi
  refusion export-adapter runs/refusion-smol-v3/continue/adapter "$V3" --rank 16
fi
if [ ! -f "$OUT/train/refusion_train.json" ]; then
  if [ -d "$OUT/train/checkpoints" ]; then
    refusion train --config refusion-smol-v4 --lora-init "$V3" --output "$OUT/train" --resume
  else
    refusion train --config refusion-smol-v4 --lora-init "$V3" --output "$OUT/train"
  fi
fi
refusion export-adapter "$OUT/train/adapter" src/refusion/assets/refusion-smol/adapter --overwrite
