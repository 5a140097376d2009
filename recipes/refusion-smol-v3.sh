#!/usr/bin/env bash
# Reproduces refusion-smol v3's adapter: v2's (src/refusion/assets/refusion-smol/adapter, made by
# recipes/refusion-smol-v2.sh) trained on the base's answers to the rest of the distill mix, for both uses of
# its masks (src/refusion/recipes/refusion-smol-v3.yaml). Run from the repository root inside the README's venv;
# each stage resumes or is skipped when its output exists.
#   bash recipes/refusion-smol-v3.sh [OUTPUT_DIR]             (default runs/refusion-smol-v3)
# 1. the fourth distilled set: the base's greedy answers to prompts 3101.. of the mix (AR, fp32, at most 384
#    tokens, kept when they end with EOS), packed into recipes/data/refusion-smol-v3-distill.jsonl.gz. It is
#    committed, so this stage only runs when it is missing. On a GPU, BATCH=512 and SECONDS_LIMIT=S stop after S
#    seconds with what is done (the committed set is what one such run made: docs/MODEL_CARD.md); on a CPU the
#    whole rest of the mix is ~15 h of 2 cores.
# 2. training (MAX_STEPS=N to override the recipe's steps: the committed adapter's run is in the model card)
# 3. packaging: the adapter in bf16 where `refusion.load()` finds it (the draft table stays v2's).
set -euo pipefail
OUT=${1:-runs/refusion-smol-v3}
DATA=recipes/data/refusion-smol-v3-distill.jsonl.gz
mkdir -p "$OUT"
if [ ! -f "$DATA" ]; then
  SKIP=3100 PACKED="$DATA" BATCH=${BATCH:-32} bash recipes/refusion-smol-v2-distill.sh "$OUT/distill"
fi
if [ ! -f "$OUT/train/refusion_train.json" ]; then
  if [ -d "$OUT/train/checkpoints" ]; then resume=--resume; else resume=; fi
  refusion train --config refusion-smol-v3 --lora-init src/refusion/assets/refusion-smol/adapter \
    ${MAX_STEPS:+--max-steps "$MAX_STEPS"} --output "$OUT/train" $resume
fi
refusion export-adapter "$OUT/train/adapter" src/refusion/assets/refusion-smol/adapter --overwrite
