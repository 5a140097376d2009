#!/usr/bin/env bash
# Makes the distilled set of refusion-smol v2: the greedy answers of the base model, SmolLM2-135M-Instruct, to
# the prompts of every train/validation split of the shared data folder (`--input distill-mix`: GSM8K train,
# MATH train, MBPP 601-974, ARC-Challenge train and dev, MMLU-Pro validation, one of each in turn; never a
# test split), in `refusion eval`'s prompt formats. Only answers that end with EOS are kept. Run from the
# repository root inside the README's venv; the generation resumes where it stopped, so an interrupted run is
# continued by running the script again, and a finished one only repacks the set.
#   bash recipes/refusion-smol-v2-distill.sh [OUTPUT_DIR]      (default runs/refusion-smol-v2-distill)
#   LIMIT=N bash recipes/refusion-smol-v2-distill.sh ...       only the first N prompts of the mix (a trial run:
#                                                              the set is then packed into OUTPUT_DIR, not recipes/)
#   FROM=M LIMIT=N PACKED=FILE bash ...                        pack the answers to prompts M+1..N into FILE (how the
#                                                              second and third sets were packed)
#   SKIP=M PACKED=FILE bash ...                                answers to prompts M+1.. only (M+1..LIMIT with LIMIT):
#                                                              OUTPUT_DIR/answers.jsonl then starts at prompt M+1
#                                                              and FROM counts from there (on a GPU,
#                                                              recipes/distill_gpu.py is the faster path)
#   INPUT=open-ended bash recipes/refusion-smol-v2-distill.sh  the same for another prompt set: the train part of the
#                                                              open-ended requests (refusion/open_ended.py), into
#                                                              runs/open-ended-distill and
#                                                              recipes/data/open-ended-distill.jsonl.gz
# Answers are decoded in fp32 (DTYPE=bfloat16 to change; the first and third committed sets are fp32, the second
# bf16): bf16 greedy answers differ from fp32's in most long answers, and on AMX CPUs, where bf16 is
# `refusion.load()`'s default, batches of 32 decode 2x slower in its row-exact bf16 than in fp32.
# Prompts decode 32 at a time, new ones joining as others finish (BATCH=N to change): ~4-5 s per prompt on a
# 2-core AVX2 CPU in fp32, so the whole mix (16835 prompts) is ~20 h there (docs/TRAINING.md, "Distilling from
# the base"). Where there is a CUDA GPU the same command uses it; LIMIT=N makes a prefix, which is still a mix.
set -euo pipefail
INPUT=${INPUT:-distill-mix}
NAME=$([ "$INPUT" = distill-mix ] && echo refusion-smol-v2 || echo "$INPUT")
OUT=${1:-runs/$NAME-distill}
LIMIT=${LIMIT:-}
FROM=${FROM:-0}
SKIP=${SKIP:-0}
if [ -n "${PACKED:-}" ]; then :
elif [ -n "$LIMIT" ] || [ "$SKIP" != 0 ]; then PACKED="$OUT/$NAME-distill.jsonl.gz"
else PACKED=recipes/data/$NAME-distill.jsonl.gz; fi
mkdir -p "$OUT" "$(dirname "$PACKED")"

# 1. the base model's greedy answers, one JSON line per prompt, in the mix's order (resumable)
refusion generate --model smollm2 --strategy autoregressive --input "$INPUT" ${LIMIT:+--limit "$LIMIT"} \
  --skip "$SKIP" --max-new-tokens 384 --batch-size ${BATCH:-32} --dtype ${DTYPE:-float32} \
  --output "$OUT/answers.jsonl"

# 2. keep the answers that ended with EOS (those cut at the length limit teach no ending), as training records
#    {"query", "response", "origin"}, gzip-compressed with a fixed timestamp (same answers, same bytes)
python recipes/pack_answers.py "$OUT/answers.jsonl" "$PACKED" "$FROM" ${LIMIT:+"$((LIMIT - SKIP))"}
