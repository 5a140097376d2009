#!/usr/bin/env bash
# Reproduces the embedded model refusion-smol (src/refusion/assets/refusion-smol/adapter) on one CPU:
# ~100 min on 2 cores. Run from the repository root inside the README's venv; every stage resumes or is
# skipped when its output exists, so an interrupted run is continued by running the script again.
#   bash recipes/refusion-smol.sh [OUTPUT_DIR]        (default runs/refusion-smol)
set -euo pipefail
OUT=${1:-runs/refusion-smol}
DISTILL_PROMPTS=2000
mkdir -p "$OUT"

train() {  # train OUTPUT ARGS...: fresh run, or resume an interrupted one, or nothing when finished
  local output=$1; shift
  if [ -f "$output/refusion_train.json" ]; then return; fi
  if [ -d "$output/checkpoints" ]; then refusion train "$@" --output "$output" --resume
  else refusion train "$@" --output "$output"; fi
}

# 1. teacher: LoRA on the GSM8K train split (gold answers)                               ~27 min
train "$OUT/teacher" --config refusion-smol-teacher

# 2. the teacher's greedy answers to the first GSM8K train questions (resumable)       ~20 min
refusion generate --model "$OUT/teacher" --input gsm8k --limit "$DISTILL_PROMPTS" --output "$OUT/distill.jsonl" \
  --batch-size 32 --strategy autoregressive --max-new-tokens 256
python - "$OUT/distill.jsonl" "$OUT/distill-finished.jsonl" <<'PY'
import json, sys  # keep answers that ended with EOS (those cut at the length limit teach no ending)
records = [json.loads(line) for line in open(sys.argv[1])]
kept = [r for r in records if r["stats"]["finish_reason"] == "eos"]
with open(sys.argv[2], "w") as f:
    f.writelines(json.dumps({"query": r["query"], "response": r["response"]}) + "\n" for r in kept)
print(f"distilled: kept {len(kept)} of {len(records)} answers (the others hit the length limit)")
PY

# 3. student: the teacher's adapter trained further on those answers                   ~40 min
train "$OUT/student" --config refusion-smol --lora-init "$OUT/teacher/adapter" --data "$OUT/distill-finished.jsonl"

# 4. package: the adapter in bf16 (~20 MB) where `refusion.load()` finds it
refusion export-adapter "$OUT/student/adapter" src/refusion/assets/refusion-smol/adapter --overwrite
