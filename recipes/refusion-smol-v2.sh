#!/usr/bin/env bash
# Reproduces the embedded model refusion-smol v2 (src/refusion/assets/refusion-smol/adapter) on one CPU.
# Run from the repository root inside the README's venv; every stage resumes or is skipped when its output
# exists, so an interrupted run is continued by running the script again.
#   bash recipes/refusion-smol-v2.sh [OUTPUT_DIR]        (default runs/refusion-smol-v2)
# 1. the distilled sets: the base's greedy answers (recipes/refusion-smol-v2-distill.sh). The three sets are
#    committed (recipes/data/refusion-smol-v2-distill.jsonl.gz: prompts 1-560 of the mix;
#    refusion-smol-v2-distill-2.jsonl.gz: prompts 561-DISTILL2_LIMIT; refusion-smol-v2-distill-3.jsonl.gz: prompts
#    DISTILL2_LIMIT+1-DISTILL3_LIMIT), so this stage only runs when one is missing; DISTILL_LIMIT=N (default 560),
#    DISTILL2_LIMIT=N (default 1481) and DISTILL3_LIMIT=N (default 3100) are the prefixes they cover. The adapter
#    is trained on the first two; the draft table counts all three.
# 2. a mask-gated LoRA adapter trained on the first set (src/refusion/recipes/refusion-smol-v2.yaml)
#    ~70 min on 2 AVX2 cores in fp32, ~32 min on 2 AMX cores in bf16
# 3. that adapter trained on the second set (src/refusion/recipes/refusion-smol-v2-continue.yaml)
# 4. packaging: the adapter in bf16 where `refusion.load()` finds it, with its draft table (n-gram statistics of
#    the three distilled sets and the three open-ended ones: drafts for the exact mode, `refusion draft-table`).
set -euo pipefail
OUT=${1:-runs/refusion-smol-v2}
DATA=recipes/data/refusion-smol-v2-distill.jsonl.gz
DATA2=recipes/data/refusion-smol-v2-distill-2.jsonl.gz
DATA3=recipes/data/refusion-smol-v2-distill-3.jsonl.gz
DATA4=recipes/data/open-ended-distill.jsonl.gz
DATA5=recipes/data/open-ended-extra-distill.jsonl.gz
DATA6=recipes/data/open-ended-extra-2-distill.jsonl.gz
DISTILL_LIMIT=${DISTILL_LIMIT:-560} DISTILL2_LIMIT=${DISTILL2_LIMIT:-1481} DISTILL3_LIMIT=${DISTILL3_LIMIT:-3100}
mkdir -p "$OUT"

if [ ! -f "$DATA" ]; then
  LIMIT=$DISTILL_LIMIT bash recipes/refusion-smol-v2-distill.sh "$OUT/distill"
  cp "$OUT/distill/refusion-smol-v2-distill.jsonl.gz" "$DATA"
fi
if [ ! -f "$DATA2" ]; then
  # made in bf16, batch 64, with the sdpa attention of its day: a rerun gives slightly different answers
  FROM=$DISTILL_LIMIT LIMIT=$DISTILL2_LIMIT DTYPE=bfloat16 BATCH=64 PACKED="$DATA2" \
    bash recipes/refusion-smol-v2-distill.sh "$OUT/distill"
fi
if [ ! -f "$DATA3" ]; then
  FROM=$DISTILL2_LIMIT LIMIT=$DISTILL3_LIMIT PACKED="$DATA3" \
    bash recipes/refusion-smol-v2-distill.sh "$OUT/distill"
fi
if [ ! -f "$DATA4" ]; then  # the open-ended requests' train part (refusion/open_ended.py), for the draft table
  INPUT=open-ended bash recipes/refusion-smol-v2-distill.sh "$OUT/open-ended-distill"
fi
if [ ! -f "$DATA5" ]; then  # and its 920 extra requests (~22 min on 2 AMX cores), also for the draft table
  INPUT=open-ended-extra bash recipes/refusion-smol-v2-distill.sh "$OUT/open-ended-extra-distill"
fi
if [ ! -f "$DATA6" ]; then  # and the 1,841 of the second extra set (~45 min on 2 AMX cores), for the table too
  INPUT=open-ended-extra-2 bash recipes/refusion-smol-v2-distill.sh "$OUT/open-ended-extra-2-distill"
fi

train() {  # train STAGE_DIR ARGS...: resumes an interrupted run, skips a finished one
  local dir=$1; shift
  if [ -f "$dir/refusion_train.json" ]; then return; fi
  if [ -d "$dir/checkpoints" ]; then refusion train "$@" --output "$dir" --resume
  else refusion train "$@" --output "$dir"; fi
}
train "$OUT/train" --config refusion-smol-v2
train "$OUT/continue" --config refusion-smol-v2-continue --lora-init "$OUT/train/adapter"

ADAPTER=src/refusion/assets/refusion-smol/adapter
refusion export-adapter "$OUT/continue/adapter" "$ADAPTER" --overwrite
refusion draft-table "$DATA" "$DATA2" "$DATA3" "$DATA4" "$DATA5" "$DATA6" --model smollm2 --output "$ADAPTER"
