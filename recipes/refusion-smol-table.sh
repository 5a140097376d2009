#!/usr/bin/env bash
# Reproduces refusion-smol's draft table (src/refusion/assets/refusion-smol/adapter/draft_table.safetensors): the
# n-gram statistics of the base's own answers that the exact mode drafts from (docs/DECODING.md), counted on every
# distilled set of recipes/data. Run from the repository root inside the README's venv, after v2's recipe (which
# makes its six sets); each set is committed, so each stage below runs only when its set is missing:
#   bash recipes/refusion-smol-table.sh [OUTPUT_DIR]   (default runs/refusion-smol-table)
# 1. the third extra open-ended set (on the CPU, as v2's sets: ~33 min on 2 AMX cores);
# 2. the fourth (the 9,864 requests of `--input open-ended-extra-4`: recipes/distill_gpu.py in batches of 1024,
#    ~3.5 min on one H100; DEVICE=cpu elsewhere, many hours);
# 3. the next 5,120 prompts of the mix by length after v3's set (batches of 512, ~2.5 min on one H100; the longer
#    ones ran out of the H100's memory at that batch size);
# 4. the table of all ten sets (docs/BENCHMARKS.md, Current results: *Draft table of every distilled set*).
set -euo pipefail
OUT=${1:-runs/refusion-smol-table}
ADAPTER=src/refusion/assets/refusion-smol/adapter
OE3=recipes/data/open-ended-extra-3-distill.jsonl.gz
OE4=recipes/data/open-ended-extra-4-distill.jsonl.gz
MIX2=recipes/data/refusion-smol-v3-distill-2.jsonl.gz
mkdir -p "$OUT"
if [ ! -f "$OE3" ]; then
  INPUT=open-ended-extra-3 bash recipes/refusion-smol-v2-distill.sh "$OUT/open-ended-extra-3-distill"
fi
if [ ! -f "$OE4" ]; then
  python recipes/distill_gpu.py --input open-ended-extra-4 --device "${DEVICE:-cuda}" --batch-size "${BATCH:-1024}" \
    --output "$OUT/open-ended-extra-4-distill/answers.jsonl"
  python recipes/pack_answers.py "$OUT/open-ended-extra-4-distill/answers.jsonl" "$OE4"
fi
if [ ! -f "$MIX2" ]; then
  python recipes/distill_gpu.py --input distill-mix --skip 3100 --skip-shortest 8192 --shortest 13312 \
    --device "${DEVICE:-cuda}" --batch-size "${BATCH2:-512}" --output "$OUT/distill-2/answers.jsonl"
  python recipes/pack_answers.py "$OUT/distill-2/answers.jsonl" "$MIX2"
fi
refusion draft-table recipes/data/refusion-smol-v2-distill*.jsonl.gz recipes/data/open-ended*-distill.jsonl.gz \
  recipes/data/refusion-smol-v3-distill.jsonl.gz "$MIX2" --model smollm2 --output "$ADAPTER"
