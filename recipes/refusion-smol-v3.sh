#!/usr/bin/env bash
# Reproduces refusion-smol v3's adapter (into src/refusion/assets/refusion-smol/adapter, where v4's recipe,
# recipes/refusion-smol-v4.sh, trains it further into the shipped one): v2's adapter (made by
# recipes/refusion-smol-v2.sh) trained further on the base's answers to more of the distill mix, for both uses of
# its masks: plan and infill's slots and the exact mode's draft chains (src/refusion/recipes/refusion-smol-v3.yaml;
# docs/MODEL_CARD.md). Run from the repository root inside the README's venv; each stage resumes or is skipped
# when its output exists.
#   bash recipes/refusion-smol-v2.sh && bash recipes/refusion-smol-v3.sh [OUTPUT_DIR]   (default runs/refusion-smol-v3)
#   V2=DIR: v2's adapter to start from (default runs/refusion-smol-v2/continue/adapter, what the v2 recipe leaves;
#   the shipped run started from v2's bf16 export, the same weights up to bf16 rounding)
# 1. the fourth distilled set: the base's greedy answers (fp32, at most 384 tokens, kept when they end with EOS) to
#    the 8192 shortest prompts of prompts 3101-16835 of the mix (recipes/distill_gpu.py: transformers' generate in
#    batches of 1024 on a CUDA GPU, ~2.5 min on one H200; DEVICE=cpu BATCH=32 on a CPU, many hours), packed into
#    recipes/data/refusion-smol-v3-distill.jsonl.gz. It is committed, so this stage only runs when it is missing.
# 2. training, two runs (the shipped adapter's: 375 + 290 steps of 16 samples, bf16 on one H200, ~7 min in all;
#    ~1 h per 100 steps on 2 CPU cores)
# 3. packaging: the adapter in bf16, each update cut to rank 16 (truncated SVD: a cheaper forward with masks, the same
#    drafts; docs/BENCHMARKS.md, Current results: *Rank of the shipped adapter*), where `refusion.load()` finds it.
# 4. the draft table counted on every distilled set (recipes/refusion-smol-table.sh).
set -euo pipefail
OUT=${1:-runs/refusion-smol-v3}
V2=${V2:-runs/refusion-smol-v2/continue/adapter}
if [ ! -f "$V2/adapter_config.json" ]; then
  echo "refusion-smol-v3: no v2 adapter in $V2: run bash recipes/refusion-smol-v2.sh first (or set V2=DIR)" >&2; exit 1
fi
DATA=recipes/data/refusion-smol-v3-distill.jsonl.gz
mkdir -p "$OUT"
if [ ! -f "$DATA" ]; then
  python recipes/distill_gpu.py --input distill-mix --skip 3100 --shortest 8192 --device "${DEVICE:-cuda}" \
    --batch-size "${BATCH:-1024}" --output "$OUT/distill/answers.jsonl"
  python recipes/pack_answers.py "$OUT/distill/answers.jsonl" "$DATA"
fi

train() {  # train STAGE_DIR ARGS...: resumes an interrupted run, skips a finished one
  local dir=$1; shift
  if [ -f "$dir/refusion_train.json" ]; then return; fi
  if [ -d "$dir/checkpoints" ]; then refusion train "$@" --output "$dir" --resume
  else refusion train "$@" --output "$dir"; fi
}
train "$OUT/train" --config refusion-smol-v3 --lora-init "$V2"
train "$OUT/continue" --config refusion-smol-v3 --lora-init "$OUT/train/adapter" --max-steps 290 --warmup-steps 10

refusion export-adapter "$OUT/continue/adapter" src/refusion/assets/refusion-smol/adapter --overwrite --rank 16

bash recipes/refusion-smol-table.sh "$OUT"
