"""THINC-SFT data: sample trajectories from a 3-shot prompted teacher and keep those that
pass the paper's four-rule filter (paper, Sec. "THINC-SFT data").

For each problem the teacher samples tau = (q, t1, c1, o1, ..., cN, oN, a) with the engine
of executor.py. A trajectory is kept iff (i) grade(pred, gold), pred taken from the model's
own text after its last output block, never from an interpreter output; (ii) every block's
sandbox status is 'ok' (error, timeout, memory, killed all fail); (iii) >= 3 code blocks;
(iv) plan tokens / trajectory tokens < 0.5, with the teacher's tokenizer: the plan is the
model text before the first ```python block, the denominator every completion token (model +
interpreter output + final EOS), as the paper states the ratio over the whole trajectory.
With a thinking template (generation prompt ending in `<think>\n`) the trajectory is
written inside the think block, so prose reasoning there before the first block is plan.
Prompt (executor.stage_prompt_ids): SYSTEM_PROMPT (byte-identical to what the student sees in the other
stages), the exemplars of data/exemplars.jsonl as prior user / assistant turns (so each
sits in the assistant role exactly as the teacher must write), then the problem, all
through the teacher's own chat template.

In:  --teacher (HF model directory or .gguf), --data problems JSONL {"id", "problem", "answer"}.
Out: --out kept rows (design-card trajectory JSONL + "sample_idx", "plan_share");
     <stem>.rejected.jsonl (same rows + "reasons": every failed rule);
     <stem>.summary.json (counts and shares per rule, acceptance, means, args);
     <stem>.args.json (the arguments; a rerun must repeat those of RUN_ARGS).
Resumable: whole-line appends; a rerun skips every (problem, sample_idx) in either file.
A problem whose prompt leaves no room under --max-context is skipped (and counted), never
prefilled.

    python distill.py --teacher Qwen3-32B/ --data data.jsonl --out runs/distill/traj.jsonl
    torchrun --standalone --nproc_per_node=8 distill.py --teacher Qwen3-32B/ --data data.jsonl \
        --out runs/distill/traj.jsonl

Departures from the paper:
  1. A fifth rule, 'unfinished': finish_reason must be 'stop' (EOS), so text cut at a budget
     is not learned. --allow-unfinished restores the paper's four rules.
  2. The exemplars are this project's own three problems (the paper's are not released).
"""
import json
import os
import sys
import time
from collections import Counter
from datetime import timedelta
from statistics import fmean

import executor as ex
from sft import barrier, cleanup_distributed, memory_plan, print0, setup_distributed, start_run, weights_gib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
RULES = ("incorrect", "exec_error", "few_blocks", "long_plan", "unfinished")

# -----------------------------------------------------------------------------
# Exemplars: data/exemplars.jsonl, one {"id", "problem", "answer", "completion"} a line

def split_completion(completion: str, where: str = ""):
    """Split an exemplar into (plan, [(code, output), ...], final) with the engine's parser
    (`executor.split_completion`). Raises InputError (a ValueError; its message starts with
    `where`) unless it is a plan, then python blocks each followed by its output block,
    then a final text without fences. Prose after an output block is accepted and left out
    of the blocks: the format the teacher is shown is the prompt's and its exemplars' (a
    TIR ablation's interleave prose, tests/faults.md L32); test_distill checks that this
    project's own exemplars hold none."""
    segs = ex.split_completion(completion)
    plan = segs.pop(0).text if segs and segs[0].kind == "plan" else ""
    final = segs.pop().text if segs and segs[-1].kind == "prose" else ""
    segs = [s for i, s in enumerate(segs) if not (s.kind == "prose" and i and segs[i - 1].kind == "output")]
    kinds = [s.kind for s in segs]
    if not segs or kinds != ["code", "output"] * (len(segs) // 2) or "```" in final:
        raise ex.InputError(f"{where}not a plan, python blocks each followed by its output, the answer: {kinds}")
    return plan, [(code.body, out.body) for code, out in zip(segs[::2], segs[1::2])], final


def load_exemplars(path: str) -> list:
    """Read and check the few-shot exemplars, rows with "problem" and "completion" strings
    (every line whole: a torn last line is an error, never a shot dropped). Raises
    InputError naming file and line unless each completion parses as plan / blocks / answer."""
    rows = []
    for n, row in ex.read_jsonl(path):
        if not all(isinstance(row.get(key), str) for key in ("problem", "completion")):
            raise ex.InputError(f"{path}:{n}: an exemplar needs fields 'problem' and 'completion', strings")
        split_completion(row["completion"], where=f"{path}:{n}: ")
        rows.append(row)
    if not rows:
        raise ex.InputError(f"{path}: no exemplars in the file (the teacher's prompt is few-shot)")
    return rows


# -----------------------------------------------------------------------------
# Filter: the paper's four rules (+ 'unfinished'), a pure function of one row

def plan_share(record: dict) -> float:
    """plan tokens / all completion tokens (model + output); 1.0 for an empty completion."""
    return record["plan_tokens"] / record["completion_tokens"] if record["completion_tokens"] else 1.0


def filter_reasons(record: dict, min_blocks: int = 3, max_plan_share: float = 0.5,
                   require_stop: bool = True) -> list:
    """Every rule the trajectory row fails, in RULES order; [] means keep.

    record: a `sample_record` row (needs answer, pred, blocks, n_code_blocks, plan_tokens,
        completion_tokens, finish_reason). pred is the model's own answer (the engine takes it
        from the text after the last output block), so a box printed by code never counts.
    min_blocks: rule (iii), at least this many executed blocks.
    max_plan_share: rule (iv), plan_share must be strictly below it.
    require_stop: departure 1, finish_reason must be 'stop'.
    """
    failed = (not ex.correct(record["pred"], record),  # in RULES order
              any(b["status"] != "ok" for b in record["blocks"]),
              record["n_code_blocks"] < min_blocks,
              plan_share(record) >= max_plan_share,
              require_stop and record["finish_reason"] != "stop")
    return [rule for rule, f in zip(RULES, failed) if f]


def summarize(kept: list, rejected: list) -> dict:
    """Counts and shares (over all trajectories) of each failed rule, acceptance rate, mean
    blocks and mean plan share (all trajectories and kept ones), finish reasons. A share or
    mean over no trajectory is None."""
    rows = kept + rejected
    n = len(rows)
    fails = {r: sum(r in row["reasons"] for row in rejected) for r in RULES}
    return {
        "trajectories": n, "kept": len(kept), "acceptance_rate": len(kept) / n if n else None,
        "rejected": len(rejected), "failed": {r: {"count": c, "share": c / n if n else None} for r, c in fails.items()},
        "only_failed": {r: sum(row["reasons"] == [r] for row in rejected) for r in RULES},
        "mean_blocks": fmean(r["n_code_blocks"] for r in rows) if rows else None,
        "mean_blocks_kept": fmean(r["n_code_blocks"] for r in kept) if kept else None,
        "mean_plan_share": fmean(map(plan_share, rows)) if rows else None,
        "mean_plan_share_kept": fmean(map(plan_share, kept)) if kept else None,
        "mean_completion_tokens": fmean(r["completion_tokens"] for r in rows) if rows else None,
        "finish_reasons": dict(Counter(row["finish_reason"] for row in rows)),
    }


# -----------------------------------------------------------------------------
# Files and resume: --out runs/traj.jsonl has runs/traj.rejected.jsonl, .summary.json and
# .args.json beside it

# rollout's keyword arguments, taken from the flags of the same names; with them, the
# arguments that change what a trajectory is or whether it is kept: earlier rows in --out are
# only continued with the same ones (batch size, seed and limit may change)
RUN_ARGS = ("teacher", "exemplars", "dtype", *ex.ROLLOUT_ARGS, "exec_timeout", "min_blocks", "max_plan_share",
            "allow_unfinished")


def work_key(problem: dict, j: int) -> tuple:
    """What resume keys sample j of a problem on: the problem itself (id, text, answer),
    so a reused id with another problem is new work. Trajectory rows carry the same fields."""
    return problem["id"], problem["problem"], problem["answer"], j


def parse_args(argv=None):
    p = ex.ArgumentParser(description="Distil THINC trajectories from a 3-shot teacher.")
    # data
    p.add_argument("--teacher", type=ex.model_path, default=ex.DEFAULT_TEACHER, help="HF dir, .gguf or packaged name")
    p.add_argument("--data", type=ex.input_file, default=ex.DEMO_PROBLEMS, help="problems JSONL")
    p.add_argument("--out", default="runs/distill/traj.jsonl", help="kept trajectories; the other files go beside it")
    p.add_argument("--exemplars", type=ex.input_file, default=f"{DATA}/exemplars.jsonl", help="few-shot turns JSONL")
    p.add_argument("--limit", type=ex.nonneg_int, default=0, help="use the first N problems only; 0 = all")
    # sampling (paper: 1 sample per problem)
    p.add_argument("--samples-per-problem", type=ex.size_int, default=1, help="trajectories per problem")
    p.add_argument("--temperature", type=ex.nonneg_float, default=0.6, help="0 = greedy")
    p.add_argument("--top-p", type=ex.unit_float, default=1.0, help="nucleus mass; 1.0 = off")
    p.add_argument("--top-k", type=ex.nonneg_int, default=0, help="0 = off")
    p.add_argument("--seed", type=ex.seed_int, default=0, help="base seed; a batch's also depends on its first problem")
    p.add_argument("--batch-size", type=ex.positive_int, default=8, help="problems per rollout call, per rank")
    p.add_argument("--kv-cache-gb", type=ex.nonneg_float, default=0.0, help="GiB of KV cache a rank: fewer rows decode "
                   "at once; 0 = 90%% of GPU memory less the weights (none on CPU)")
    # budgets
    p.add_argument("--max-context", type=ex.positive_int, default=32768, help="tokens, 3-shot prompt + completion")
    p.add_argument("--max-new-tokens", type=ex.nonneg_int, default=0, help="model tokens per sample; 0 = no limit")
    p.add_argument("--max-tool-calls", type=ex.nonneg_int, default=40, help="executed blocks per sample")
    p.add_argument("--exec-timeout", type=ex.positive_float, default=10.0, help="seconds, wall clock, per block")
    p.add_argument("--exec-workers", type=ex.nonneg_int, default=0, help="blocks run at once per rank; 0 = CPUs/ranks")
    p.add_argument("--stateful", action="store_true", help="block k sees what blocks 1..k-1 defined (Sandbox.run)")
    # filter
    p.add_argument("--min-blocks", type=ex.nonneg_int, default=3, help="rule (iii): at least this many code blocks")
    p.add_argument("--max-plan-share", type=ex.unit_float, default=0.5,
                   help="rule (iv): plan tokens / completion tokens must be below this")
    p.add_argument("--allow-unfinished", action="store_true", help="keep samples cut by a budget (the paper's 4 rules)")
    # model
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="None: bf16 on GPU, fp32 on CPU")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# Main: shard, resume, rollout, filter, append, summary

def main(argv=None):
    args = parse_args(argv)
    out, stem = args.out, args.out.removesuffix(".jsonl")
    rejected_path, args_path = f"{stem}.rejected.jsonl", f"{stem}.args.json"
    if not out.endswith(".jsonl") or os.path.exists(out) and not os.path.isfile(out):  # '', a folder, /dev/null
        raise ex.InputError(f"--out {out or repr(out)}: not a .jsonl file{' (a folder)' if os.path.isdir(out) else ''}")
    outputs = (out, rejected_path, args_path, f"{stem}.summary.json")
    ex.check_out(os.path.dirname(os.path.abspath(out)), "distill", (args.data, args.exemplars), outputs)
    # trajectories to continue: this stage's own (an empty --out: a run stopped before its args.json)
    if os.path.exists(out) and os.path.getsize(out) or os.path.exists(rejected_path):
        if not os.path.exists(args_path):
            raise ex.InputError(f"--out {out}: not written by distill.py (no {args_path}): give another --out")
        ex.check_same_args(args_path, args, RUN_ARGS, f"the trajectories in {out}")
    if os.path.exists(out):  # a live run into it holds its lock (tests/faults.md B16)
        ex.lock_run(out)
    # 1) problems and exemplars, read before anything is written (bad input changes no file)
    problems = ex.read_problems(args.data)[:args.limit or None]
    exemplars = load_exemplars(args.exemplars)

    # gloo even on GPUs: the only collectives are two barriers, which ranks may reach hours
    # apart (hence the long timeout); none runs inside the rollout loop
    rank, _, world, device = setup_distributed(args.seed, backend="gloo", timeout=timedelta(days=7))
    if rank == 0:
        for path in (out, rejected_path):
            if cut := ex.drop_torn_tail(path):
                print(f"{path}: dropped a torn last line ({cut} bytes)", file=sys.stderr)
    barrier()  # no rank reads or appends before the torn lines are gone

    # what earlier runs already wrote, keyed on the problem itself (a reused id with another
    # problem or answer is new work)
    k = args.samples_per_problem
    done = {work_key(r, r["sample_idx"]) for path in (out, rejected_path) for r in ex.read_jsonl_tolerant(path)}
    # shard by position in the file, not in the work left: a rank's share never depends on
    # what another rank has appended meanwhile; batches too, so that a batch cut by a kill or a
    # full disk is drawn again with its seed and gives the same rows (tests/faults.md B22)
    mine = [(i, p) for i, p in enumerate(problems) if i % world == rank]
    left = sum(any(work_key(p, j) not in done for j in range(k)) for _, p in mine)
    n_todo = sum(work_key(p, j) not in done for p in problems for j in range(k))
    print0(f"problems {len(problems)} x {k} samples: {len(problems) * k - n_todo} done before, {n_todo} to sample "
           f"on {world} rank(s); rank 0: {left} problems in batches of <= {args.batch_size}")

    # 2) teacher and sandbox (not loaded when this rank has nothing left to sample)
    if left:
        model, tokenizer = ex.load_model(args.teacher, dtype=args.dtype, device=device)
        max_rows, plan = memory_plan(model.config, model.dtype.itemsize, args.batch_size * k, args.max_context,
                                     args.kv_cache_gb, weights_gib(model), device)
        print0(plan)  # rows at once: a batch's, or fewer so that their KV cache fits (tests/faults.md D12)
        # prompts are measured before any forward: one with no room for a token under
        # --max-context is skipped and counted, never prefilled
        prompt_ids = {i: ex.stage_prompt_ids(tokenizer, p["problem"], args.stateful, exemplars) for i, p in mine}
        mine = [(i, p) for i, p in mine if len(prompt_ids[i]) < args.max_context]
        if not mine:  # (under torchrun the other ranks stop with this one)
            raise ex.InputError(f"--max-context {args.max_context}: no prompt of {args.data} leaves room for a token")
        if len(mine) < len(prompt_ids):
            print(f"[rank {rank}] skipped {len(prompt_ids) - len(mine)} problems whose prompt leaves no room "
                  f"under --max-context {args.max_context}", file=sys.stderr, flush=True)
    if rank == 0:  # after the last check (the prompts' lengths): nothing is written before it
        start_run(args_path, "distill", args, lock=out)
    t0, n_new, n_kept = time.time(), 0, 0
    with ex.Sandbox(workers=args.exec_workers, timeout=args.exec_timeout) as sandbox:
        for b in range(0, len(mine) if left else 0, args.batch_size):
            batch = mine[b:b + args.batch_size]
            if all(work_key(p, j) in done for _, p in batch for j in range(k)):
                continue
            # 3) rollout: one call per batch, no collective (ranks run at their own pace)
            samples = ex.rollout(model, tokenizer, [prompt_ids[i] for i, _ in batch], sandbox, n=k,
                                 seed=args.seed * 1_000_003 + batch[0][0], max_num_seqs=max_rows,
                                 **{a: getattr(args, a) for a in ex.ROLLOUT_ARGS})
            # 4) filter; only samples not written before (a kill may split a batch's writes)
            rows = [{**ex.sample_record(p, samples[i * k + j]), "sample_idx": j}
                    for i, (_, p) in enumerate(batch) for j in range(k) if work_key(p, j) not in done]
            for row in rows:
                row["plan_share"] = plan_share(row)
                why = filter_reasons(row, args.min_blocks, args.max_plan_share, not args.allow_unfinished)
                # 5) whole-line appends: safe across ranks (O_APPEND) and against kills
                ex.append_jsonl(rejected_path if why else out, [{**row, "reasons": why} if why else row])
                n_kept += not why
            n_new += len(rows)
            print(f"[rank {rank}] {b + len(batch)}/{len(mine)} problems, kept {n_kept}/{n_new}, "
                  f"{time.time() - t0:.0f} s", flush=True)

    # 6) summary of both files (earlier runs included), by rank 0 once every rank is done
    barrier()
    if rank == 0:
        summary = summarize(ex.read_jsonl_tolerant(out), ex.read_jsonl_tolerant(rejected_path))
        ex.write_json_atomic(f"{stem}.summary.json", {**summary, "args": vars(args)})
        print(json.dumps(summary, indent=2))
    cleanup_distributed()


def interrupted() -> str:
    """The line a Ctrl-C prints: what is kept, and the command that continues."""
    out = parse_args().out
    return f"kept {out} and {out.removesuffix('.jsonl')}.rejected.jsonl; resume: {ex.command_line()}"


if __name__ == "__main__":
    sys.exit(ex.cli(main, interrupted=interrupted))
