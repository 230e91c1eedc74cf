#!/usr/bin/env bash
# THINC's recipe in miniature on the packaged models, every part measured at a budget the start
# model finishes in (this supersedes data/does_it_learn.sh, which evaluated at 192 tokens):
#   1 budget    the start model's finish rate on the first BUDGET_PROBLEMS training problems at
#               the largest of BUDGETS; B (model tokens, for every later part) is the smallest
#               budget whose double raises that rate by fewer than MAX_GAIN points. Its committed
#               samples (data/recipe/budget.samples.jsonl.gz, 6 tool calls) give B = 1,024.
#   2 heldout_start  the start model on data/exact_test.jsonl (100 problems, k = K) at B, as
#               every row after it
#   3 distill   the 1.5B teacher, 3-shot, on the first DISTILL_N training problems; the paper's
#               four rules (+ 'unfinished'), rule 3 relaxed to >= 1 block (one-block problems)
#   4 sft       the 0.5B on the kept trajectories, then its held-out evaluation
#   5 grpo      GRPO from the start model; 6 sft_grpo: the same from the SFT model; each evaluated
#   7 control   5 again with each step's rewards permuted among its samples
#               (data/permuted_reward.py; needs grpo.py's --reward), evaluated
#   8 public    the PUBLIC policies on the first PUBLIC_N problems of math500_int and GSM8K test at B
#               (the start model's right after part 2: it needs no training)
#   9 export    samples (gzip), training metrics, the distillation summary and wall times into
#               data/recipe/, then data/recipe/tables.md, computed from those files alone
# A part whose name is in runs/recipe/done.txt is skipped, and so is one whose samples (or kept
# trajectories, or training metrics) data/recipe/ holds with an end line in data/recipe/times.tsv:
# a new machine resumes from the committed files (a training part is retrained there when a part
# still to run needs its model). A killed part is rerun, and every stage resumes its own partial output (evaluate.py
# and distill.py skip what they wrote, grpo.py and sft.py continue from their newest checkpoint).
# runs/recipe/times.tsv gets a line as each part starts and ends, with the commit it ran on.
# Settings below; each can be overridden from the environment (K=2 bash ...); BUDGET=768 skips
# part 1. PARTS="math500_start gsm8k_start" runs only the parts named (the others are left as they
# are): two such processes with disjoint lists over the same R run parts side by side (RANKS=1
# each), e.g. the training parts in one (PARTS="distill sft grpo sft_grpo control") and the
# evaluations in the other; a part whose input another process makes waits until that part is
# in done.txt. A trained model lives only in R: a part and the parts that read its model must
# run on one machine (the committed files restore evaluations and the distillation, not models).
# Usage, from the project root after set-up command 1 and the teacher's install (README):
#   bash data/recipe.sh
set -euo pipefail
R=${R:-runs/recipe}                  # run folders
OUT=${OUT_DIR:-data/recipe}          # what is committed
BUDGETS=${BUDGETS:-768,1024,1536,2048}
BUDGET_PROBLEMS=${BUDGET_PROBLEMS:-48}
MAX_GAIN=${MAX_GAIN:-3}               # points (part 1's rule)
K=${K:-1}                            # samples per held-out problem (k = 1: exact McNemar)
RANKS=${RANKS:-2}                    # processes each stage but distill runs as (torchrun), one a core (on GPUs:
                                     # at most one a GPU); 1 for each of two recipe processes side by side. An
                                     # evaluation draws the same samples at any RANKS; GRPO rows share one RANKS
TOOLS=${TOOLS:-6}                    # executed blocks per sample, everywhere
EVAL_BATCH=${EVAL_BATCH:-64}         # sequences decoding at once (fp32: changes no sample); 64 decodes fastest here
BATCH_FLAG=${BATCH_FLAG:---max-num-seqs}         # evaluate.py: sequences decoding at once
DISTILL_BATCH_FLAG=${DISTILL_BATCH_FLAG:---batch-size}
TEACHER=${TEACHER:-qwen2.5-coder-1.5b}
DISTILL_N=${DISTILL_N:-96}
DISTILL_BATCH=${DISTILL_BATCH:-8}
SFT_BATCH=${SFT_BATCH:-8}
SFT_EPOCHS=${SFT_EPOCHS:-3}
STEPS=${STEPS:-6}
PROMPTS=${PROMPTS:-8}
G=${G:-4}
LR=${LR:-1e-5}
ROLLOUT_FLAG=${ROLLOUT_FLAG:---max-num-seqs}  # grpo.py: sequences decoding at once
ROLLOUT=${ROLLOUT:-32}
PUBLIC=${PUBLIC:-"start sft_grpo"}
PUBLIC_N=${PUBLIC_N:-100}
MATH500=${MATH500:-../shared/data/math500_int.jsonl}
GSM8K=${GSM8K:-../shared/data/gsm8k_test.jsonl}
START=qwen2.5-coder-0.5b
PARTS=${PARTS:-}                     # empty: every part
POLL=${POLL:-60}                     # seconds between looks at done.txt while a part waits
ALL_PARTS="budget heldout_start math500_start gsm8k_start distill sft heldout_sft grpo heldout_grpo sft_grpo
heldout_sft_grpo control heldout_control math500_sft_grpo gsm8k_sft_grpo"
for p in $PARTS; do  # a typo would run nothing and end with status 0
    if [[ " $(echo $ALL_PARTS) " != *" $p "* ]]; then
        echo "PARTS: no part '$p' (parts: $(echo $ALL_PARTS))" >&2
        exit 2
    fi
done
mkdir -p "$R" "$OUT"
touch "$R/done.txt"
if [ -n "$PARTS" ]; then  # what this process will run, readable by the other while this one lives
    exec 8> "$R/parts.$$"
    echo "$PARTS" >&8
    flock 8  # released when this process ends, however it ends
    trap 'rm -f "$R/parts.$$"' EXIT
fi
if [ ! -s "$R/times.tsv" ] && [ -f "$OUT/times.tsv" ]; then cp "$OUT/times.tsv" "$R/times.tsv"; fi
touch "$R/times.tsv"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain -- '*.py' 2>/dev/null)" ]; then COMMIT="$COMMIT+changes"; fi

restored() {  # restored NAME: the part's product is committed in data/recipe/; copies it into runs/
    grep -q "^$1"$'\t'"end" "$OUT/times.tsv" 2>/dev/null || return 1
    case $1 in
        distill)
            [ -f "$OUT/distill.kept.jsonl.gz" ] || return 1
            mkdir -p "$R/distill"
            gunzip -c "$OUT/distill.kept.jsonl.gz" > "$R/distill/traj.jsonl"
            gunzip -c "$OUT/distill.rejected.jsonl.gz" > "$R/distill/traj.rejected.jsonl"
            cp "$OUT/distill.summary.json" "$R/distill/traj.summary.json" ;;
        budget|heldout_*|math500_*|gsm8k_*)
            [ -f "$OUT/$1.samples.jsonl.gz" ] || return 1
            mkdir -p "$R/$1"
            gunzip -c "$OUT/$1.samples.jsonl.gz" > "$R/$1/samples.jsonl" ;;
        sft|grpo|sft_grpo|control)  # the model is not committed: done only while no part still to run reads it
            [ -f "$OUT/$1.metrics.jsonl" ] || [ "$1" = sft ] || return 1
            local reader
            for reader in $(readers "$1"); do
                restored "$reader" || return 1
            done ;;
        *) return 1 ;;
    esac
}

readers() {  # the parts that read part NAME's model
    case $1 in
        sft) echo heldout_sft sft_grpo ;;
        *) echo "heldout_$1"
           if [[ " $PUBLIC " == *" $1 "* ]]; then echo "math500_$1 gsm8k_$1"; fi ;;
    esac
}

part() {  # part NAME COMMAND...: skipped when NAME is done, else run and timed
    local name=$1
    shift
    if is_done "$name" || restored "$name"; then
        is_done "$name" || echo "$name" >> "$R/done.txt"
        echo "== $name: done before"
        return
    fi
    if [ -n "$PARTS" ] && [[ " $PARTS " != *" $name "* ]]; then
        echo "== $name: not in PARTS"
        return
    fi
    local need
    need=$(needs "$name")
    if [ -n "$PARTS" ] && [ -n "$need" ] && ! is_done "$need"; then
        echo "== $name: waiting for $need (another process's part)"
        until is_done "$need"; do
            if ! made_by_a_live_process "$need"; then
                echo "$name needs $need, which is not done and no running recipe process has in PARTS" >&2
                exit 1
            fi
            sleep "$POLL"
        done
    fi
    exec 9> "$R/lock.$name"
    if ! flock -n 9; then  # the same part named in two processes
        echo "$name is running in another recipe process" >&2
        exit 1
    fi
    printf '%s\tstart\t%s\t%s\n' "$name" "$(date -u +%FT%TZ)" "$COMMIT" >> "$R/times.tsv"
    echo "== $name: $(date -u +%FT%TZ) on $COMMIT"
    local t0=$SECONDS
    "$@"
    printf '%s\tend\t%s\t%s s\t%s\n' "$name" "$(date -u +%FT%TZ)" "$((SECONDS - t0))" "$COMMIT" >> "$R/times.tsv"
    echo "$name" >> "$R/done.txt"
    exec 9>&-  # the part's lock
    export_files  # what is done so far is in data/recipe/, should a later part fail
}

is_done() {  # is_done NAME: the part is in done.txt
    grep -qx "$1" "$R/done.txt"
}

made_by_a_live_process() {  # made_by_a_live_process NAME: a process that is alive (its PARTS file locked) runs NAME
    local f
    for f in "$R"/parts.*; do
        [ -f "$f" ] || continue
        if ! flock -n "$f" true && [[ " $(cat "$f") " == *" $1 "* ]]; then return 0; fi
    done
    return 1
}

launch() {  # launch SCRIPT ARGS...: the stage as RANKS processes on this machine
    torchrun --standalone --nproc_per_node="$RANKS" "$@"
}

needs() {  # the part whose product part NAME reads (none for the start model's)
    case $1 in
        budget|distill|grpo|control|*_start) ;;
        sft) echo distill ;;
        sft_grpo) echo sft ;;
        heldout_*|math500_*|gsm8k_*) echo "${1#*_}" ;;
    esac
}

policy() {  # the model directory (or packaged name) of a row
    case $1 in
        start) echo "$START" ;;
        sft) echo "$R/sft/final" ;;
        *) echo "$R/$1/latest" ;;
    esac
}

pick_budget() {  # samples at the largest budget, unless data/recipe/ holds them (part 1's evidence)
    local largest=${BUDGETS##*,}
    if [ ! -f "$R/budget/samples.jsonl" ]; then
        launch evaluate.py --model "$START" --data data/exact_train.jsonl --limit "$BUDGET_PROBLEMS" --k 1 \
            "$BATCH_FLAG" "$EVAL_BATCH" --max-context $((largest + 1536)) --max-new-tokens "$largest" \
            --max-tool-calls "$TOOLS" --seed 0 --out "$R/budget"
    fi
    python data/compare.py --budgets "$BUDGETS" --max-gain "$MAX_GAIN" "$R/budget/samples.jsonl" | tee "$R/budget.log"
    tail -n 1 "$R/budget.log" > "$R/budget.txt"
}

distill() {
    python distill.py --teacher "$TEACHER" --data data/exact_train.jsonl --limit "$DISTILL_N" \
        "$DISTILL_BATCH_FLAG" "$DISTILL_BATCH" --max-context $((B + 4096)) --max-new-tokens "$B" \
        --max-tool-calls "$TOOLS" --min-blocks 1 --seed 0 --out "$R/distill/traj.jsonl"
    python -m json.tool "$R/distill/traj.summary.json"
}

sft_run() {
    if [ -d "$R/sft/final" ]; then return; fi
    local resume=()
    local ckpt
    ckpt=$(ls -td "$R"/sft/step_*/ 2>/dev/null | grep -v '\.tmp' | head -n 1 || true)
    if [ -n "$ckpt" ]; then
        resume=(--resume "$ckpt")
    else
        rm -rf "$R/sft"  # a run that saved no checkpoint: nothing to continue
    fi
    launch sft.py --model "$START" --data "$R/distill/traj.jsonl" --out "$R/sft" --global-batch "$SFT_BATCH" \
        --epochs "$SFT_EPOCHS" --save-every 8 --grad-checkpointing --chunk-size 256 --seed 0 "${resume[@]}"
    rm -rf "$R"/sft/step_*  # 6 GB each (weights and AdamW state); final/ has the same and more
}

grpo_run() {  # grpo_run NAME MODEL [EXTRA FLAGS]
    local out=$R/$1
    local model=$2
    shift 2
    local resume=()
    if [ -e "$out/latest" ] || [ -e "$out/latest.old" ]; then
        resume=(--resume "$out/latest")  # grpo.py takes latest.old when a crash left only that
    else
        rm -rf "$out"  # killed before its first checkpoint: nothing to continue
    fi
    # AdamW restarts on a resume (weights-only checkpoints, --no-save-optimizer): 2 GB a step, not 6
    launch grpo.py --model "$model" --data data/exact_train.jsonl --out "$out" \
        --steps "$STEPS" --prompts-per-step "$PROMPTS" --group-size "$G" "$ROLLOUT_FLAG" "$ROLLOUT" --lr "$LR" \
        --temperature 0.8 --max-context $((B + 1536)) --max-new-tokens "$B" --max-tool-calls "$TOOLS" \
        --micro-batch 2 --chunk-size 256 --grad-checkpointing --save-every 1 --no-save-optimizer --seed 0 \
        "$@" "${resume[@]}"
}

control() {
    if ! python grpo.py --help | grep -q -- "--reward"; then
        echo "grpo.py has no --reward flag yet: the control needs it" >&2
        return 2
    fi
    grpo_run control "$START" --reward data/permuted_reward.py:permuted_reward
}

evaluate_on() {  # evaluate_on ROW NAME JSONL LIMIT K: runs/recipe/NAME_ROW
    launch evaluate.py --model "$(policy "$1")" --data "$3" --limit "$4" --k "$5" "$BATCH_FLAG" "$EVAL_BATCH" \
        --max-context $((B + 1536)) --max-new-tokens "$B" --max-tool-calls "$TOOLS" --seed 0 --out "$R/$2_$1"
}

export_files() {  # gzip -n: the same samples give the same bytes; only finished parts (another
    local d       # process's part in flight, or a killed one, holds a partial samples file)
    for d in "$R"/budget "$R"/heldout_* "$R"/math500_* "$R"/gsm8k_*; do
        if [ -f "$d/samples.jsonl" ] && is_done "$(basename "$d")"; then
            gzip -9 -n -c "$d/samples.jsonl" > "$OUT/$(basename "$d").samples.jsonl.gz"
        fi
    done
    for d in grpo sft_grpo control; do
        if [ -f "$R/$d/metrics.jsonl" ] && is_done "$d"; then
            cp "$R/$d/metrics.jsonl" "$OUT/$d.metrics.jsonl"
        fi
    done
    if [ -f "$R/sft/log.jsonl" ] && is_done sft; then  # one file a training run (a new machine trains SFT again)
        local ended
        ended=$( (grep $'^sft\tend\t' "$R/times.tsv" || true) | tail -n 1 | cut -f 3 | tr : -)
        cp "$R/sft/log.jsonl" "$OUT/sft.${ended:-unknown}.log.jsonl"
    fi
    if [ -f "$R/distill/traj.summary.json" ] && is_done distill; then
        cp "$R/distill/traj.summary.json" "$OUT/distill.summary.json"
        gzip -9 -n -c "$R/distill/traj.jsonl" > "$OUT/distill.kept.jsonl.gz"
        gzip -9 -n -c "$R/distill/traj.rejected.jsonl" > "$OUT/distill.rejected.jsonl.gz"
    fi
    cp "$R/times.tsv" "$OUT/times.tsv"
}

tables() {  # only from the committed files: anyone can recompute them without a model
    local rows=()
    local row
    for row in start sft grpo sft_grpo control; do
        if [ -f "$OUT/heldout_$row.samples.jsonl.gz" ]; then rows+=("$OUT/heldout_$row.samples.jsonl.gz"); fi
    done
    {
        echo "# data/recipe.sh at B = $B model tokens"
        if [ -f "$OUT/budget.samples.jsonl.gz" ]; then
            echo
            echo "## The start model's finish rate (first $BUDGET_PROBLEMS training problems, k = 1)"
            echo
            python data/compare.py --budgets "$BUDGETS" --max-gain "$MAX_GAIN" "$OUT/budget.samples.jsonl.gz"
        fi
        if [ ${#rows[@]} -gt 0 ]; then
            echo
            echo "## Held out (data/exact_test.jsonl, k = $K); gains over the start model"
            echo
            python data/compare.py --families "${rows[@]}"
        fi
        local pair
        for pair in "grpo control" "grpo sft_grpo"; do
            set -- $pair
            if [ -f "$OUT/heldout_$1.samples.jsonl.gz" ] && [ -f "$OUT/heldout_$2.samples.jsonl.gz" ]; then
                echo
                echo "## Held out: $2 against $1"
                echo
                python data/compare.py "$OUT/heldout_$1.samples.jsonl.gz" "$OUT/heldout_$2.samples.jsonl.gz"
            fi
        done
        for bench in math500 gsm8k; do
            local pub=()
            for row in $PUBLIC; do
                if [ -f "$OUT/${bench}_$row.samples.jsonl.gz" ]; then pub+=("$OUT/${bench}_$row.samples.jsonl.gz"); fi
            done
            if [ ${#pub[@]} -gt 0 ]; then
                echo
                echo "## $bench (first $PUBLIC_N problems, k = 1)"
                echo
                python data/compare.py "${pub[@]}"
            fi
        done
    } > "$OUT/tables.md"
    cat "$OUT/tables.md"
}

# --- 1) the budget -------------------------------------------------------------------
if [ -n "${BUDGET:-}" ]; then
    B=$BUDGET  # given: no measurement
else
    part budget pick_budget
    [ -f "$R/budget.txt" ] || python data/compare.py --budgets "$BUDGETS" --max-gain "$MAX_GAIN" \
        "$R/budget/samples.jsonl" | tail -n 1 > "$R/budget.txt"
    B=$(cat "$R/budget.txt")
fi
if ! [[ "$B" =~ ^[1-9][0-9]*$ ]]; then
    echo "no budget B ('$B' in $R/budget.txt): part 1 did not finish; remove the file and rerun" >&2
    exit 1
fi
echo "== B = $B model tokens"

# --- 2-7) each policy, then its held-out evaluation (a session may stop after any row) -
heldout() {
    part "heldout_$1" evaluate_on "$1" heldout data/exact_test.jsonl 0 "$K"
}
public() {  # the public slice of a PUBLIC row; the start model's comes first (it needs no training)
    if [[ " $PUBLIC " == *" $1 "* ]]; then
        part "math500_$1" evaluate_on "$1" math500 "$MATH500" "$PUBLIC_N" 1
        part "gsm8k_$1" evaluate_on "$1" gsm8k "$GSM8K" "$PUBLIC_N" 1
    fi
}
heldout start
public start
part distill distill
part sft sft_run
heldout sft
part grpo grpo_run grpo "$START"
heldout grpo
part sft_grpo grpo_run sft_grpo "$R/sft/final"
heldout sft_grpo
part control control
heldout control
for row in $PUBLIC; do
    if [ "$row" != start ]; then public "$row"; fi
done

# --- 9) the committed files and the tables -------------------------------------------
export_files
tables
