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
# Round 2 (each after round 1's parts, each with its held-out row):
#  10 heldout_start_3shot  the start model with data/exemplars.jsonl as three prior turns (what the
#               teacher and SFT's data saw): the prompting baseline
#  11 grpo_seed1, grpo_seed2, sft_grpo_seed1, sft_grpo_seed2: grpo and sft_grpo again with --seed 1
#               and 2 (round 1's ran with --seed 0), from the same SFT model (trained again here)
#  12 control_group  5 with rewards shuffled within each group (permuted_reward.group_permuted_reward:
#               each group keeps its reward multiset, so the same groups carry signal)
#  13 math500_all_*, gsm8k_all_*: every problem of MATH500 (math500_int: 311) and the first
#               PUBLIC_ALL_N of GSM8K for ALL_ROWS; the start model's extend its first PUBLIC_N
#               (a sample's seed is its own, so those samples are reused)
# A part whose name is in runs/recipe/done.txt is skipped, and so is one whose samples (or kept
# trajectories, or training metrics) data/recipe/ holds with an end line in data/recipe/times.tsv:
# a new machine resumes from the committed files (a training part is retrained there when a part
# still to run needs its model). A killed part is rerun, and every stage resumes its own partial output (evaluate.py
# and distill.py skip what they wrote, grpo.py and sft.py continue from their newest checkpoint).
# runs/recipe/times.tsv gets a line as each part starts and ends, with the commit it ran on.
# The start model's full public sets (13) take longer than one machine lives: each export keeps their finished
# rows (data/recipe/*_all_start.partial.samples.jsonl.gz), and a new machine goes on from them.
# A part is done only while its output exists (a done part whose samples are gone runs again)
# and only for the settings R and OUT_DIR were made with (their settings.txt): a run with
# other settings over them is refused (tests/faults.md P7).
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
PUBLIC_ALL_N=${PUBLIC_ALL_N:-500}    # GSM8K problems in round 2's full public rows (MATH500: all 311)
ALL_ROWS=${ALL_ROWS:-"start sft_grpo_seed2"}  # rows evaluated on the full public sets (a trained row's
                                     # model must be on this machine: sft_grpo_seed2 is the last trained)
MATH500=${MATH500:-../shared/data/math500_int.jsonl}
GSM8K=${GSM8K:-../shared/data/gsm8k_test.jsonl}
START=qwen2.5-coder-0.5b
PARTS=${PARTS:-}                     # empty: every part
POLL=${POLL:-60}                     # seconds between looks at done.txt while a part waits
ALL_PARTS="budget heldout_start math500_start gsm8k_start distill sft heldout_sft grpo heldout_grpo sft_grpo
heldout_sft_grpo control heldout_control math500_sft_grpo gsm8k_sft_grpo heldout_start_3shot grpo_seed1
heldout_grpo_seed1 sft_grpo_seed1 heldout_sft_grpo_seed1 control_group heldout_control_group grpo_seed2
heldout_grpo_seed2 sft_grpo_seed2 heldout_sft_grpo_seed2"
for row in $ALL_ROWS; do ALL_PARTS="$ALL_PARTS math500_all_$row gsm8k_all_$row"; done
# numbers are checked before anything starts: RANKS=0 or 'two' would reach torchrun (tests/faults.md P7)
for var in RANKS K TOOLS EVAL_BATCH BUDGET_PROBLEMS DISTILL_N DISTILL_BATCH SFT_BATCH SFT_EPOCHS STEPS PROMPTS G \
           ROLLOUT PUBLIC_N PUBLIC_ALL_N ${BUDGET+BUDGET}; do
    if ! [[ "${!var}" =~ ^[1-9][0-9]{0,8}$ ]]; then
        echo "$var must be a positive integer, got '${!var}'" >&2
        exit 2
    fi
done
for var in LR MAX_GAIN POLL; do
    if ! [[ "${!var}" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE]-?[0-9]{1,2})?$ ]] || [[ "${!var}" =~ ^[0.]+([eE].*)?$ ]]; then
        echo "$var must be a positive number, got '${!var}'" >&2
        exit 2
    fi
done
# the ranges the stages check too, here before any part runs: G = 1 has no group, an lr over 1 diverges
if [ "$G" -lt 2 ] || ! python3 -c "import sys; sys.exit(not 0 < float(sys.argv[1]) <= 1)" "$LR"; then
    echo "G must be at least 2 and LR in (0, 1], got G=$G LR=$LR" >&2
    exit 2
fi
for f in "$MATH500" "$GSM8K"; do  # read by the last parts: a typo would end the run hours in
    if [ ! -f "$f" ]; then
        echo "no file '$f' (MATH500 / GSM8K): the public parts read it" >&2
        exit 2
    fi
done
for row in $PUBLIC $ALL_ROWS; do
    if [[ ! " start sft grpo sft_grpo control grpo_seed1 grpo_seed2 sft_grpo_seed1 sft_grpo_seed2 control_group " \
          == *" $row "* ]]; then
        echo "PUBLIC / ALL_ROWS: no row '$row'" >&2
        exit 2
    fi
done
if [ -n "$PARTS" ] && [ -z "${PARTS//[[:space:]]/}" ]; then  # blanks only: it would run nothing, status 0
    echo "PARTS holds only blanks: name parts, or unset it for every part" >&2
    exit 2
fi
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
        sft|grpo*|sft_grpo*|control*)  # the model is not committed: done only while no part still to run reads it
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
        sft) echo heldout_sft sft_grpo sft_grpo_seed1 sft_grpo_seed2 ;;
        *) echo "heldout_$1"
           if [[ " $PUBLIC " == *" $1 "* ]]; then echo "math500_$1 gsm8k_$1"; fi
           if [[ " $ALL_ROWS " == *" $1 "* ]]; then echo "math500_all_$1 gsm8k_all_$1"; fi ;;
    esac
}

row_of() {  # the policy row an evaluation part evaluates: heldout_grpo_seed1 -> grpo_seed1
    local r=${1#*_}
    echo "${r#all_}"
}

part() {  # part NAME COMMAND...: skipped when NAME is done, else run and timed
    local name=$1
    shift
    if is_done "$name" || restored "$name"; then
        is_done "$name" || mark_done "$name"
        echo "== $name: done before"
        return
    fi
    if listed "$name"; then
        echo "== $name: listed in $R/done.txt, but $(product "$name") is gone: running it again"
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
    mark_done "$name"
    exec 9>&-  # the part's lock
    export_files  # what is done so far is in data/recipe/, should a later part fail
}

listed() {  # listed NAME: done.txt names the part (a CRLF file reads the same)
    tr -d '\r' < "$R/done.txt" | grep -qx "$1"
}

is_done() {  # is_done NAME: listed, and its samples (or trajectories) still there
    listed "$1" && { [ -z "$(product "$1")" ] || [ -s "$(product "$1")" ]; }
}

product() {  # the file a done part keeps (none for a training part: its model may be gone, P6)
    case $1 in
        budget|heldout_*|math500_*|gsm8k_*) echo "$R/$1/samples.jsonl" ;;
        distill) echo "$R/distill/traj.jsonl" ;;
    esac
}

mark_done() {  # mark_done NAME: one whole line, even after a torn last line (a kill mid-append)
    if [ -s "$R/done.txt" ] && [ -n "$(tail -c 1 "$R/done.txt")" ]; then echo >> "$R/done.txt"; fi
    echo "$1" >> "$R/done.txt"
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
        budget|distill|grpo|grpo_seed*|control|control_group|*_start|*_start_3shot) ;;
        sft) echo distill ;;
        sft_grpo|sft_grpo_seed*) echo sft ;;
        heldout_*|math500_*|gsm8k_*) row_of "$1" ;;
    esac
}

policy() {  # the model directory (or packaged name) of a row
    case $1 in
        start|start_3shot) echo "$START" ;;
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
    # AdamW restarts on a resume (weights-only checkpoints, --no-save-optimizer): 2 GB a step, not 6.
    # Two ranks' updates peaked past this 24 GB machine at micro-batch 2 (12.3-12.9 GB a rank on dd35a7e;
    # 11.4 with --shard-optimizer on 7fb6f46): since then micro-batch 1 (a 2 x 2,048-token micro-batch's
    # forward and backward take 3.4 GB above the weights and gradients, one of 2,048 1.3 GB; the loss is the
    # same, its normaliser fixed over the step) and ZeRO-1 (the same AdamW arithmetic, 1.8 GiB a rank less)
    launch grpo.py --model "$model" --data data/exact_train.jsonl --out "$out" \
        --steps "$STEPS" --prompts-per-step "$PROMPTS" --group-size "$G" "$ROLLOUT_FLAG" "$ROLLOUT" --lr "$LR" \
        --temperature 0.8 --max-context $((B + 1536)) --max-new-tokens "$B" --max-tool-calls "$TOOLS" \
        --micro-batch 1 --chunk-size 256 --grad-checkpointing --shard-optimizer --save-every 1 --no-save-optimizer \
        --seed 0 \
        "$@" "${resume[@]}"
}

control() {
    if ! python grpo.py --help | grep -q -- "--reward"; then
        echo "grpo.py has no --reward flag yet: the control needs it" >&2
        return 2
    fi
    grpo_run control "$START" --reward data/permuted_reward.py:permuted_reward
}

control_group() {
    grpo_run control_group "$START" --reward data/permuted_reward.py:group_permuted_reward
}

evaluate_on() {  # evaluate_on ROW NAME JSONL LIMIT K: runs/recipe/NAME_ROW
    local shots=()
    local room=1536  # tokens for the prompt and the blocks' outputs
    if [ "$1" = start_3shot ]; then
        shots=(--exemplars data/exemplars.jsonl)
        room=$((room + 4096))  # the three exemplars' turns (1.5-4K tokens, as the teacher's prompt)
    fi
    launch evaluate.py --model "$(policy "$1")" --data "$3" --limit "$4" --k "$5" "$BATCH_FLAG" "$EVAL_BATCH" \
        --max-context $((B + room)) --max-new-tokens "$B" --max-tool-calls "$TOOLS" --seed 0 --out "$R/$2_$1" \
        "${shots[@]}"
}

evaluate_all() {  # evaluate_all ROW BENCH JSONL LIMIT: the whole set, from the first PUBLIC_N's samples
    local first=$R/$2_$1/samples.jsonl
    local partial=$OUT/$2_all_$1.partial.samples.jsonl.gz
    if [ ! -e "$R/$2_all_$1" ]; then
        mkdir -p "$R/$2_all_$1"
        if [ -s "$first" ]; then
            cp "$first" "$R/$2_all_$1/samples.jsonl"  # evaluate.py resumes from them: the same seeds
        fi
        if [ "$1" = start ] && [ -f "$partial" ]; then  # an earlier machine's unfinished rows (export_files)
            gunzip -c "$partial" > "$R/$2_all_$1/samples.rank0.jsonl"
        fi
    fi
    evaluate_on "$1" "$2_all" "$3" "$4" 1
}

export_files() {  # gzip -n: the same samples give the same bytes; only finished parts (another
    local d       # process's part in flight, or a killed one, holds a partial samples file)
    for d in "$R"/budget "$R"/heldout_* "$R"/math500_* "$R"/gsm8k_*; do
        if [ -f "$d/samples.jsonl" ] && is_done "$(basename "$d")"; then
            gzip -9 -n -c "$d/samples.jsonl" > "$OUT/$(basename "$d").samples.jsonl.gz"
        fi
    done
    for d in grpo sft_grpo control grpo_seed1 grpo_seed2 sft_grpo_seed1 sft_grpo_seed2 control_group; do
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
    export_partial
    cp "$R/times.tsv" "$OUT/times.tsv"
    if [ -n "${SETTINGS:-}" ]; then echo "$SETTINGS" > "$OUT/settings.txt"; fi
}

export_partial() {  # the start model's unfinished full public sets, whole lines only: the packaged model is
    local bench d f s  # the same on every machine, so a later one goes on from these rows (a trained model is not)
    for bench in math500 gsm8k; do
        d=$R/${bench}_all_start
        f=$OUT/${bench}_all_start.partial.samples.jsonl.gz
        if is_done "${bench}_all_start"; then
            rm -f "$f"
        elif compgen -G "$d/samples*.jsonl" > /dev/null; then
            for s in "$d"/samples*.jsonl; do head -n "$(wc -l < "$s")" "$s"; done | sort -u | gzip -9 -n > "$f.tmp"
            mv "$f.tmp" "$f"
        fi
    done
}

tables() {  # only from the committed files: anyone can recompute them without a model
    local rows=()
    local row
    for row in start start_3shot sft grpo grpo_seed1 grpo_seed2 sft_grpo sft_grpo_seed1 sft_grpo_seed2 control \
               control_group; do
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
            echo "## Held out (data/exact_test.jsonl, k = $K); gains over $(basename "${rows[0]}" .samples.jsonl.gz)"
            echo
            python data/compare.py --families "${rows[@]}"
        fi
        local pair
        for pair in "grpo control" "grpo sft_grpo" "grpo control_group" "start start_3shot"; do
            set -- $pair
            if [ -f "$OUT/heldout_$1.samples.jsonl.gz" ] && [ -f "$OUT/heldout_$2.samples.jsonl.gz" ]; then
                echo
                echo "## Held out: $2 against $1"
                echo
                python data/compare.py "$OUT/heldout_$1.samples.jsonl.gz" "$OUT/heldout_$2.samples.jsonl.gz"
            fi
        done
        if [ -f "$OUT/heldout_start.samples.jsonl.gz" ]; then
            echo
            echo "## The README's lead: each policy over its seeds, sft_grpo against grpo, the public sets"
            echo
            python data/compare.py --lead "$OUT"
        fi
        local set bench rows_of_set what
        for set in "math500_all:$ALL_ROWS:every problem" "gsm8k_all:$ALL_ROWS:first $PUBLIC_ALL_N problems" \
                   "math500:$PUBLIC:first $PUBLIC_N problems" "gsm8k:$PUBLIC:first $PUBLIC_N problems"; do
            IFS=: read -r bench rows_of_set what <<< "$set"
            local pub=()
            for row in $rows_of_set; do
                if [ -f "$OUT/${bench}_$row.samples.jsonl.gz" ]; then pub+=("$OUT/${bench}_$row.samples.jsonl.gz"); fi
            done
            if [ ${#pub[@]} -gt 0 ]; then
                echo
                echo "## ${bench%_all} ($what, k = 1)"
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
# what a part's result depends on (not RANKS for an evaluation, nor EVAL_BATCH: fp32 changes no sample)
SETTINGS="B=$B K=$K TOOLS=$TOOLS TEACHER=$TEACHER DISTILL_N=$DISTILL_N SFT_BATCH=$SFT_BATCH SFT_EPOCHS=$SFT_EPOCHS \
STEPS=$STEPS PROMPTS=$PROMPTS G=$G LR=$LR PUBLIC_N=$PUBLIC_N PUBLIC_ALL_N=$PUBLIC_ALL_N MATH500=$(basename "$MATH500") \
GSM8K=$(basename "$GSM8K")"
for f in "$R/settings.txt" "$OUT/settings.txt"; do  # parts of other settings are never counted done here
    if [ -f "$f" ] && [ "$(tr -d '\r' < "$f")" != "$SETTINGS" ]; then
        echo "$f: its parts were made with $(cat "$f"), this run has $SETTINGS: use another R and OUT_DIR" >&2
        exit 2
    fi
done
echo "$SETTINGS" > "$R/settings.txt"

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

# --- 10-13) round 2 ----------------------------------------------------------------------
part heldout_start_3shot evaluate_on start_3shot heldout data/exact_test.jsonl 0 "$K"
for seed in 1 2; do
    part "grpo_seed$seed" grpo_run "grpo_seed$seed" "$START" --seed "$seed"
    heldout "grpo_seed$seed"
    part "sft_grpo_seed$seed" grpo_run "sft_grpo_seed$seed" "$R/sft/final" --seed "$seed"
    heldout "sft_grpo_seed$seed"
    if [ "$seed" = 1 ]; then
        part control_group control_group
        heldout control_group
    fi
done
for row in $ALL_ROWS; do
    part "math500_all_$row" evaluate_all "$row" math500 "$MATH500" 0
    part "gsm8k_all_$row" evaluate_all "$row" gsm8k "$GSM8K" "$PUBLIC_ALL_N"
done

# --- 9) the committed files and the tables -------------------------------------------
export_files
tables
