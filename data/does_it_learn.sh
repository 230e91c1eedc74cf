#!/usr/bin/env bash
# The "Does it learn?" experiment of data/README.md, on 2 CPU cores: GRPO on
# exact-computation problems (data/exact_train.jsonl), then the same evaluation of the start
# and the trained policy on the 100 held-out problems of the same families
# (data/exact_test.jsonl, k = 4) and on the first 100 GSM8K test problems (k = 1), then the
# comparison and the training curves. The two data files are what data/make_exact.py writes
# (see its docstring; tests/test_data.py checks it). Every evaluation resumes where a killed
# one stopped.
# Usage, from the project root: bash data/does_it_learn.sh [STEPS] [GSM8K_JSONL]
set -euo pipefail
steps=${1:-4}
gsm8k=${2:-../shared/data/gsm8k_test.jsonl}
# a rerun continues the run from runs/learn/latest (or only reports, when it is at STEPS);
# AdamW then starts fresh, as the checkpoints hold no optimizer state (--no-save-optimizer)
resume=""
if [ -e runs/learn/latest ]; then resume="--resume runs/learn/latest"; fi
torchrun --standalone --nproc_per_node=1 grpo.py --data data/exact_train.jsonl --out runs/learn \
    --steps "$steps" --prompts-per-step 8 --group-size 4 --max-num-seqs 32 --lr 1e-5 --temperature 0.8 \
    --max-context 768 --max-new-tokens 192 --max-tool-calls 2 --micro-batch 2 --chunk-size 256 \
    --save-every 2 --no-save-optimizer --seed 0 $resume
for m in runs/learn/latest qwen2.5-coder-0.5b; do
    python evaluate.py --model "$m" --data data/exact_test.jsonl --k 4 --max-num-seqs 100 \
        --max-context 768 --max-new-tokens 192 --max-tool-calls 2 --seed 0 --out "runs/learn_eval_$(basename "$m")"
    python evaluate.py --model "$m" --data "$gsm8k" --limit 100 --k 1 --max-num-seqs 50 \
        --max-context 1024 --max-new-tokens 256 --max-tool-calls 2 --seed 0 --out "runs/learn_gsm8k_$(basename "$m")"
done
python data/compare.py --families runs/learn_eval_qwen2.5-coder-0.5b/samples.jsonl runs/learn_eval_latest/samples.jsonl
python data/compare.py runs/learn_gsm8k_qwen2.5-coder-0.5b/samples.jsonl runs/learn_gsm8k_latest/samples.jsonl
