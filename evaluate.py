"""Evaluate a THINC policy: k samples per problem, then avg@k / pass@k / maj@k and the
paper's trajectory diagnostics (code-grounded answer rate, Recovery@k).

Each problem is answered k times (paper: k = 16, temperature 0.6, top-p 1.0, 32K budget);
sample j of every problem forms run j. Metrics, as the paper reports them:

    avg@k   = 1/k sum_j acc(run j), reported +- the std of acc(run j) over the k runs
    pass@k  = mean_problems [1 - C(n - c, k) / C(n, k)]      (Chen et al. 2021, unbiased)
    best@k  = pass@k at the full k (the paper reports best@16; multiple-choice sets are not read here)
    maj@k   = mean_problems 1[the most frequent answer (grouped by grade) is correct]
    code-grounded rate = share of answered samples whose answer appears in an execution output
    Recovery@k (k = 1..5) = accuracy among samples whose first k code blocks all failed
plus per-trajectory code lines, code blocks, tool calls, execution errors, model tokens,
plan tokens and plan share, prose written after the plan, and finish reasons. When rows
carry a subject (MATH's `subject`) the accuracy is also split by subject.

Reads: a model (HF directory, .gguf, or a packaged name) and problems JSONL files
({"id", "problem", "answer"}; the file stem names the benchmark). Writes, in --out:
samples.rank{r}.jsonl while running (each rank appends each sample as it finishes), then
samples.jsonl (all ranks merged: the problem's fields and executor.sample_record's
fields plus benchmark and sample_idx), metrics.json
({"args", "benchmarks": {name: metrics}}), metrics.md (the tables, also printed) and
args.json. A killed run restarted with the same command skips the samples already written.

    python evaluate.py --model DIR --data aime24.jsonl aime25.jsonl --out runs/eval1
    torchrun --standalone --nproc_per_node=8 evaluate.py --model DIR --data a.jsonl --out runs/eval1
    python evaluate.py --from-samples runs/eval1        # regrade, recompute every metric, no model

Fractions are stored in [0, 1] in metrics.json and printed as percentages.

Departures from the paper (it does not define these details):
  1. The std of avg@k is the population std (ddof = 0) of the k run accuracies.
  2. maj@k ties go to the answer whose first vote came earliest (lowest sample_idx);
     answers are grouped by the grader's equivalence (`0.5` and `\\frac{1}{2}` are one
     vote), so maj@k never disagrees with grade.
  3. Code grounding matches the answer as a token in the outputs (rules in
     `answer_in_output`), not by a general equivalence check.
  4. Each rank samples its problems (`rank_share`: every world_size-th of those left, in a
     hash order of benchmark and id) in one rollout call, at most --max-num-seqs sequences
     at once (continuous batching). Sample j of a problem draws from its own generator,
     seeded (its row's seed) from --seed, the benchmark, the problem id and j only
     (`sample_seed`): 1 or N ranks, any --max-num-seqs and a resume give the same samples in
     fp32 (up to the floating-point effects of which rows share a forward). In bf16 (CUDA's
     default) or fp16 those effects change samples, so a resume there keeps the
     run's --max-num-seqs (tests/faults.md G20).
"""
import datetime
import glob
import hashlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter, defaultdict

import executor as ex

RECOVERY_KS = (1, 2, 3, 4, 5)

# -----------------------------------------------------------------------------
# Accuracy: avg@k, pass@k, maj@k


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _group(records, *fields) -> dict:
    """(the values of `fields`) -> the records that have them, sorted by sample_idx;
    _group(records, "benchmark", "id") groups the samples of each problem."""
    groups = defaultdict(list)
    for r in sorted(records, key=lambda r: r["sample_idx"]):
        groups[tuple(r.get(f) for f in fields)].append(r)
    return groups


def avg_at_k(records) -> tuple:
    """(mean, std) of the per-run accuracies, as fractions in [0, 1].

    Run j is every record with sample_idx == j; its accuracy is the share of its records
    marked correct (over the problems present in that run). mean is the average over runs
    (equal to the overall accuracy when every problem has every run); std is the
    population std over runs (the paper's +-). Raises ValueError (statistics.StatisticsError)
    on no records.
    """
    accs = [_mean(bool(r["correct"]) for r in run) for run in _group(records, "sample_idx").values()]
    return statistics.fmean(accs), statistics.pstdev(accs)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with n samples of which c are correct:
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021, Codex paper); Python's exact integers
    and correctly rounded int / int keep it exact for any n (C(n - c, k) = 0 when every
    k-subset holds a correct sample). Raises ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(records, k: int) -> float:
    """pass_at_k averaged over problems (n, c counted per problem). Raises ValueError (from
    pass_at_k) if some problem has fewer than k samples."""
    return _mean(pass_at_k(len(rs), sum(bool(r["correct"]) for r in rs), k)
                 for rs in _group(records, "benchmark", "id").values())


def majority_answer(records, equal=ex.grade):
    """The voted record of one problem. Records with a pred vote, grouped by the grader's
    equivalence: a pred joins the first group whose first pred it equals (the same string,
    or equal(pred, first pred), the first pred in the gold's place), else it opens a new
    group; so `\\frac{140}{2}` and `70` are one answer, as they are to grade. The group
    with most votes wins, ties going to the group whose first vote has the lowest
    sample_idx. Returns the winning group's first record, or None if no record has an
    answer."""
    groups = []   # in first-vote order
    for r in sorted((r for r in records if r["pred"]), key=lambda r: r["sample_idx"]):
        g = next((g for g in groups if r["pred"] == g[0]["pred"] or equal(r["pred"], g[0]["pred"])), [])
        if not g:
            groups.append(g)
        g.append(r)
    # max() keeps the first of equal counts, and groups are in first-vote order
    return max(groups, key=len)[0] if groups else None


def maj_at_k(records, k: int | None = None, equal=ex.grade) -> float:
    """maj@k: share of problems whose majority answer (majority_answer over the samples
    with sample_idx < k; all samples when k is None) is correct. A problem with no
    answer at all counts as wrong."""
    voted = [majority_answer([r for r in rs if k is None or r["sample_idx"] < k], equal)
             for rs in _group(records, "benchmark", "id").values()]
    return _mean(v is not None and bool(v["correct"]) for v in voted)


# -----------------------------------------------------------------------------
# Code grounding: does the final answer appear in an execution output?

# A number in interpreter output: optional minus, digits with thousands groups, then a
# decimal part or `/d`. Not inside a word (`x70`, `a_70`), not part of a longer number
# (`170`, `1.70`, `70.5`); a sentence-final period is allowed (`is 70.`).
_OUT_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+|/\d+)?(?!\w|\.\d)")
# Where Python's error text starts in an output: a traceback, or a compile error's location
# (a SyntaxError prints `File "<code>", line 3` without the header); its line numbers are not results
_ERROR_TEXT = re.compile(r'^Traceback \(most recent call last\):$|^\s*File "[^"\n]*", line \d+', re.M)
# What printed code does not write: LaTeX markup, brackets, `*`, `^`, whitespace
_MARKUP = re.compile(r"\\(?:[dt]?frac|text\w*|mathrm|left|right|cdot|times|[,!;])|[\s$*^{}()\\]")


def _bare(s: str) -> str:
    """s without _MARKUP, `}{` read as `/`: `\\frac{\\sqrt{3}}{2}` and `sqrt(3)/2` are
    both `sqrt3/2`, `x^{2}+1` and `x**2 + 1` both `x2+1`."""
    return _MARKUP.sub("", s.replace("}{", "/"))


def answer_in_output(pred: str, outputs) -> bool:
    """Whether the answer appears in at least one of the execution outputs.

    An answer that executor.number_value reads (a number, a fraction or power of
    integers) matches a number token of an output with the same exact value (`70`
    matches `answer = 70`, `70.0`, `1,000`-style groups and `140/2`, but not `170`, `x70`,
    `1.70` or `70.5`; `\\frac{1}{2}` matches `0.5` and `1/2`). Any other answer matches
    when its _bare form occurs in an output's _bare form, not glued to a neighbouring
    name, number or `/` (`2\\pi` matches `2*pi`, not `32*pi`). The bare forms drop
    brackets, so `(1+x)/2` and `1+x/2` match each other: a diagnostic, not a grader.
    Only what the block printed counts, not Python's error text after it: `2` does not
    match the `line 2` of a traceback (tests/faults.md A18).
    """
    outputs = [_ERROR_TEXT.split(out, maxsplit=1)[0] for out in outputs if out]  # what the blocks printed
    value = ex.number_value(pred)
    if value is not None:
        return any(ex.number_value(t) == value for out in outputs if out for t in _OUT_NUMBER.findall(out))
    bare = _bare(pred)
    token = re.compile(r"(?<![\w./])" + re.escape(bare) + r"(?![\w./])")
    return bool(bare) and any(token.search(_bare(out)) for out in outputs if out)


def code_grounded_rate(records) -> tuple:
    """(rate or None, count): among records with a pred, the share whose pred appears in
    some block output (answer_in_output); count is the number of records with a pred."""
    hits = [answer_in_output(r["pred"], [b.get("output") for b in r["blocks"]])
            for r in records if r["pred"] is not None]
    return _mean(hits), len(hits)


# -----------------------------------------------------------------------------
# Recovery@k and per-trajectory diagnostics


def recovery_at_k(records, k: int) -> tuple:
    """(accuracy or None, count) over the records whose first k code blocks all failed
    (status != 'ok': error, timeout, memory). A record with fewer than k blocks is not
    counted. None when no record qualifies."""
    picked = [bool(r["correct"]) for r in records
              if len(r["blocks"]) >= k and all(b["status"] != "ok" for b in r["blocks"][:k])]
    return _mean(picked), len(picked)


def prose_after_plan(completion: str) -> str:
    """The model's text outside code and output blocks after the plan (`split_completion`'s
    prose segments), without the last line that holds a `\\boxed` / `\\fbox` answer and
    without `</think>` (a thinking template's trajectory closes its think block before the
    answer). Empty for a completion with no code block. Format adherence: THINC writes no
    prose between or after its blocks."""
    prose = "".join(s.text for s in ex.split_completion(completion) if s.kind == "prose")
    lines = prose.replace("</think>", "").split("\n")
    if boxed := [i for i, ln in enumerate(lines) if "\\boxed" in ln or "\\fbox" in ln]:
        del lines[boxed[-1]]
    return "\n".join(lines).strip()


def code_lines(record) -> int:
    """Non-empty lines of code over all blocks of a trajectory (comments included: THINC
    reflects in code comments)."""
    return sum(1 for b in record["blocks"] for ln in b["code"].split("\n") if ln.strip())


def trajectory_stats(records) -> dict:
    """Means over records (per trajectory): code_lines, code_blocks (n_code_blocks),
    tool_calls (executed blocks, len(blocks)), exec_errors, model_tokens (tokens the model
    wrote), completion_tokens (model + interpreter-output tokens), plan_tokens,
    plan_share (mean of plan_tokens / model_tokens over records with model tokens),
    prose_words_after_plan (whitespace-separated words of prose_after_plan) and
    prose_after_plan_share (share of records with any); shares of records with no code
    block and with no answer; finish_reasons: share of each finish_reason."""
    prose = [len(prose_after_plan(r["completion"]).split()) for r in records]
    finish = Counter(r["finish_reason"] for r in records)
    fields = {"code_blocks": "n_code_blocks", "exec_errors": "n_exec_errors", "model_tokens": "model_tokens",
              "completion_tokens": "completion_tokens", "plan_tokens": "plan_tokens"}
    return {
        "code_lines": _mean(code_lines(r) for r in records), "tool_calls": _mean(len(r["blocks"]) for r in records),
        **{name: _mean(r[field] for r in records) for name, field in fields.items()},
        "plan_share": _mean(r["plan_tokens"] / r["model_tokens"] for r in records if r["model_tokens"] > 0),
        "prose_words_after_plan": _mean(prose), "prose_after_plan_share": _mean(w > 0 for w in prose),
        "no_code_share": _mean(r["n_code_blocks"] == 0 for r in records),
        "no_answer_share": _mean(r["pred"] is None for r in records),
        "finish_reasons": {k: c / len(records) for k, c in sorted(finish.items())},
    }


# -----------------------------------------------------------------------------
# Summary and tables


def summarize(records) -> dict:
    """{benchmark: metrics} with, per benchmark: n_problems, n_samples, k (fewest samples
    of any problem) and k_max, avg_at_k and avg_at_k_std, pass_at_k {str(k): value} for
    k = 1, 2, 4, ... <= k and k itself, best_at_k (pass@k at k), by_subject {subject:
    n_problems, k, avg_at_k(_std), maj_at_k, best_at_k} ({} without subjects), maj_at_k
    (over all samples), code_grounded {rate, count}, recovery {str(k): {value, count}} for k = 1..5, and the
    trajectory_stats keys. Raises ValueError on no records."""
    if not records:
        raise ValueError("summarize: no records")
    return {bench: _bench_metrics(rs) for (bench,), rs in sorted(_group(records, "benchmark").items())}


def _accuracy(rs) -> dict:
    """n_problems, k (fewest samples of any problem), avg_at_k and its std, maj_at_k and
    best_at_k (pass@k at that k: the paper's best@16 is pass@16) of some records."""
    k = min(len(v) for v in _group(rs, "benchmark", "id").values())
    return {"n_problems": len(_group(rs, "benchmark", "id")), "k": k,
            **dict(zip(("avg_at_k", "avg_at_k_std"), avg_at_k(rs))), "maj_at_k": maj_at_k(rs),
            "best_at_k": mean_pass_at_k(rs, k)}


def _subject(record):
    """A row's subject (MATH's `subject`), or None."""
    return record["subject"] if isinstance(record.get("subject"), str) else None


def _bench_metrics(rs) -> dict:
    """summarize's metrics of one benchmark's records."""
    sizes = [len(v) for v in _group(rs, "benchmark", "id").values()]
    k = min(sizes)
    ks = sorted({2 ** i for i in range(k.bit_length())} | {k})   # 2 ** (bit_length - 1) <= k
    subjects = sorted({_subject(r) for r in rs} - {None})
    return {
        **_accuracy(rs), "n_samples": len(rs), "k_max": max(sizes),
        "pass_at_k": {str(j): mean_pass_at_k(rs, j) for j in ks},
        "by_subject": {s: _accuracy([r for r in rs if _subject(r) == s]) for s in subjects},
        "code_grounded": dict(zip(("rate", "count"), code_grounded_rate(rs))),
        "recovery": {str(j): dict(zip(("value", "count"), recovery_at_k(rs, j))) for j in RECOVERY_KS},
        **trajectory_stats(rs),
    }


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def markdown_table(metrics: dict) -> str:
    """Two markdown tables for {benchmark: metrics} (as from summarize): accuracy
    (avg@k +- std, maj@k, pass@k at the largest k = best@k, in %; a row per subject under
    its benchmark; a `mean` row of the benchmarks' avg@k when there are several) and
    diagnostics (per-trajectory means, code-grounded rate, Recovery@1..5 with their counts,
    finish-reason shares)."""
    acc = ["| benchmark | problems | k | avg@k | maj@k | pass@k = best@k |", "|---" * 6 + "|"]
    diag = [_row("benchmark", "tool calls", "code lines", "errors", "model tokens", "plan share", "prose words",
                 "grounded", *(f"R@{j} (n)" for j in RECOVERY_KS), "stop / length / tool_budget"),
            "|---" * (9 + len(RECOVERY_KS)) + "|"]
    for bench, m in metrics.items():
        # the benchmark's row (its best@k is its pass@k at its largest k), then one a subject
        for name, a in [(bench, m), *((f"{bench}: {s}", a) for s, a in m["by_subject"].items())]:
            acc.append(_row(name, a["n_problems"], a["k"], f"{_pct(a['avg_at_k'])} ± {_pct(a['avg_at_k_std'])}",
                            _pct(a["maj_at_k"]), f"{_pct(a['best_at_k'])} (k={a['k']})"))
        rec = [f"{_pct(r['value'])} ({r['count']})" for r in (m["recovery"][str(j)] for j in RECOVERY_KS)]
        ends = " / ".join(_pct(m["finish_reasons"].get(x, 0.0)) for x in ("stop", "length", "tool_budget"))
        diag.append(_row(bench, _num(m["tool_calls"]), _num(m["code_lines"]), _num(m["exec_errors"]),
                         _num(m["model_tokens"], 0), _pct(m["plan_share"]), _num(m["prose_words_after_plan"]),
                         _pct(m["code_grounded"]["rate"]), *rec, ends))
    if len(metrics) > 1:
        acc.append(f"| mean | | | {_pct(_mean(m['avg_at_k'] for m in metrics.values()))} | | |")
    return "\n".join(acc) + "\n\n" + "\n".join(diag) + "\n"


# -----------------------------------------------------------------------------
# Files


# the fields a metric reads and their types (bool is not an int here: `"correct": "false"` or
# `"sample_idx": true` is an error, not a silently wrong number)
FIELD_TYPES = {"id": str, "benchmark": str, "answer": str, "pred": (str, type(None)), "correct": bool,
               "sample_idx": int, "finish_reason": str, "completion": str, "blocks": list, "n_code_blocks": int,
               "n_exec_errors": int, "completion_tokens": int, "model_tokens": int, "plan_tokens": int}


def load_samples(path: str, torn_tail_ok: bool = False) -> list:
    """Rows of a samples JSONL. With `torn_tail_ok` (a rank's file, appended as it goes) a
    torn last line, from a run killed mid-write, is ignored; samples.jsonl is written
    atomically, so there a torn line is an error.

    Raises:
        OSError: no such file.
        InputError (a ValueError) naming file, line and field: a bad JSON line, a row
            missing one of FIELD_TYPES or with a field of another type (`pred`: a string or
            null), or a second row for the same (benchmark, id, sample_idx).
    """
    rows, seen = [], {}
    for lineno, row in ex.read_jsonl(path, torn_tail_ok):
        if missing := [k for k in FIELD_TYPES if k not in row]:
            raise ex.InputError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
        for k, t in FIELD_TYPES.items():
            if not isinstance(row[k], t) or t is int and isinstance(row[k], bool):
                want = getattr(t, "__name__", "str or null")
                raise ex.InputError(f"{path}:{lineno}: field '{k}' must be {want}, got {row[k]!r}")
        if "choices" in row:   # (a multiple-choice row of an older run: no longer graded by its letter)
            raise ex.InputError(f"{path}:{lineno}: field 'choices': multiple-choice samples are not supported")
        key = (row["benchmark"], row["id"], row["sample_idx"])
        if seen.setdefault(key, lineno) != lineno:   # the line of the key's first row
            raise ex.InputError(f"{path}:{lineno}: duplicate of line {seen[key]} (benchmark, id, sample_idx) = {key}")
        rows.append(row)
    return rows


def check_k(rows: list, path: str) -> None:
    """Refuse samples whose problems do not all hold sample_idx 0..k-1 for one k (samples of
    runs with another --k mixed: avg@k and pass@k would average unlike things; tests/faults.md
    B35). Raises InputError naming the file and the first problem that differs."""
    idx = {}
    for r in rows:
        idx.setdefault((r["benchmark"], r["id"]), []).append(r["sample_idx"])
    k = len(next(iter(idx.values()), []))
    if bad := next((key for key, js in idx.items() if sorted(js) != list(range(k))), None):
        raise ex.InputError(f"{path}: problem {bad} has samples {sorted(idx[bad])[:8]}, the first problem 0..{k - 1}: "
                            "samples of runs with another --k mixed?")


def merged_samples(out_dir: str) -> dict:
    """Every sample row found in out_dir: samples.jsonl (a finished run's merge) and
    samples.rank*.jsonl (in-progress rows of any earlier world size, a torn last line
    ignored). Returns {(benchmark, id, sample_idx): row}; the same key in two files must
    hold the same row. Raises InputError (see load_samples) or for conflicting rows."""
    rows, where = {}, {}
    merged = os.path.join(out_dir, "samples.jsonl")
    for path in [merged] + sorted(glob.glob(os.path.join(glob.escape(out_dir), "samples.rank*.jsonl"))):
        for row in load_samples(path, torn_tail_ok=path != merged) if os.path.exists(path) else []:
            key = (row["benchmark"], row["id"], row["sample_idx"])
            if key in rows and rows[key] != row:
                raise ex.InputError(f"{path}: sample {key} differs from the one in {where[key]} (two runs wrote here?)")
            rows[key], where[key] = row, path
    return rows


# -----------------------------------------------------------------------------
# Config


# the run's identity: everything that decides what a sample is (not --max-num-seqs in fp32, nor
# --limit: a sample's seed is its own, so a larger --limit extends a run and check_resume refuses
# the samples of problems past a smaller one). A run folder is resumed only with the same.
SAMPLING_ARGS = ("model", "dtype", "data", "exemplars", "k", "seed", "exec_timeout", *ex.ROLLOUT_ARGS)


def parse_args(argv=None):
    p = ex.ArgumentParser(description="THINC evaluation: k samples per problem, avg@k, pass@k, maj@k, diagnostics.")
    # model and data
    p.add_argument("--model", type=ex.model_path, default=ex.DEFAULT_POLICY, help="HF dir, .gguf or packaged name")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="None: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--data", nargs="+", metavar="JSONL", type=ex.input_file, default=[ex.DEMO_PROBLEMS],
                   help="problems files, one benchmark each (named by the file stem)")
    p.add_argument("--limit", type=ex.nonneg_int, default=0, help="first N problems of each file; 0 = all")
    p.add_argument("--exemplars", type=ex.input_file, help="few-shot turns JSONL (data/exemplars.jsonl, the "
                   "teacher's prompt: a prompting baseline); none = zero-shot, the paper's evaluation")
    p.add_argument("--out", metavar="DIR", default="runs/eval", help="run folder (a killed run's folder is resumed)")
    # sampling (paper defaults)
    p.add_argument("--k", type=ex.size_int, default=16, help="samples per problem (avg@k, pass@k, maj@k)")
    p.add_argument("--temperature", type=ex.nonneg_float, default=0.6, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=ex.unit_float, default=1.0, help="nucleus mass; 1.0 = off")
    p.add_argument("--top-k", type=ex.nonneg_int, default=0, help="top-k filter; 0 = off")
    p.add_argument("--max-context", type=ex.positive_int, default=32768, help="tokens of prompt + completion")
    p.add_argument("--max-new-tokens", type=ex.nonneg_int, default=0, help="model-written tokens; 0 = no limit")
    p.add_argument("--max-tool-calls", type=ex.nonneg_int, default=40, help="executed code blocks per sample")
    p.add_argument("--seed", type=ex.seed_int, default=0, help="base seed of the samples' seeds (sample_seed)")
    # throughput
    p.add_argument("--max-num-seqs", type=ex.positive_int, default=64, help="sequences decoding at once per rank "
                   "(a finished one's place goes to the next); lower it if out of memory. Changes no sample in "
                   "float32; in bf16 / fp16 it does, so a resume keeps it")
    p.add_argument("--kv-cache-gb", type=ex.nonneg_float, default=0.0,
                   help="GiB of KV cache a rank; caps --max-num-seqs; 0 = 90%% of GPU memory less weights (CPU: none)")
    p.add_argument("--exec-workers", type=ex.nonneg_int, default=0, help="blocks run at once per rank; 0 = CPUs/ranks")
    p.add_argument("--exec-timeout", type=ex.positive_float, default=10.0, help="seconds per code block, wall clock")
    p.add_argument("--stateful", action="store_true", help="block k sees what blocks 1..k-1 defined (Sandbox.run)")
    # no model
    p.add_argument("--from-samples", metavar="DIR",
                   help="grade DIR/samples.jsonl again (rewritten if a verdict changed), recompute every metric "
                        "(no model)")
    p.add_argument("--show", type=ex.nonneg_int, default=0, metavar="N", help="then print N trajectories; 0 = none")
    args = p.parse_args(argv)
    # --from-samples reads only DIR (and --show): any other flag would be ignored
    ignored = [a for a, v in vars(args).items() if a not in ("from_samples", "show") and v != p.get_default(a)]
    if args.from_samples is not None and ignored:
        p.error(f"--{ignored[0].replace('_', '-')} has no effect with --from-samples")
    return args


# -----------------------------------------------------------------------------
# Work: benchmarks, seeds, resume


def read_benchmarks(paths, limit: int) -> dict:
    """{benchmark name (file stem): its problems (the first `limit`, 0 = all)}, in --data
    order. Raises InputError naming the file (and line) for a bad line, a line without
    problem / answer, a duplicate problem id, or two files with one stem; OSError for a
    missing file."""
    benches = {}
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        if name in benches:
            raise ex.InputError(f"{path}: a second file for benchmark '{name}' (file stems name benchmarks)")
        benches[name] = ex.read_problems(path)[:limit or None]
    return benches


def rank_share(problems, done, k: int, rank: int, world: int):
    """This rank's share of `problems` ((benchmark, problem dict) pairs): every world-th of
    those lacking one of their k samples in `done` (a set of (benchmark, id, j)), taken in the
    order of sample_seed(0, benchmark, id, 0), a hash of the benchmark and id alone. So a resume
    spreads what is left over every rank, and a file whose kinds of problem come in turn (six
    families in data/exact_test.jsonl) does not put half the kinds on each of two ranks (their
    lengths differ: 13 min against 48 for two halves of one held-out row)."""
    todo = [(b, q) for b, q in problems if any((b, q["id"], j) not in done for j in range(k))]
    return sorted(todo, key=lambda bq: sample_seed(0, bq[0], bq[1]["id"], 0))[rank::world]


def sample_seed(seed: int, benchmark: str, problem_id: str, j: int) -> int:
    """The generator seed of sample j of a problem: a stable hash (not Python's salted
    hash()) of the base seed, the benchmark, the problem id and j, nothing else."""
    return int(hashlib.sha256(json.dumps([seed, benchmark, problem_id, j]).encode()).hexdigest()[:15], 16)


def check_resume(args, out_dir: str, done: dict, benches: dict) -> None:
    """A run folder with samples is resumed only by the same run: the same SAMPLING_ARGS as
    its args.json (and --max-num-seqs, unless in fp32), and every saved sample one of this
    run's work items (benchmark, id, sample_idx < k) made for the same problem and answer
    (the data files may have changed), and not drawn in waves (rows with rollout_ids, from an
    evaluate.py that cut the problems into waves of --batch-size: other seeds). Raises
    InputError saying what differs."""
    if done:
        # in bf16 / fp16 which rows share a forward changes the samples (tests/faults.md G20)
        import torch
        fp32 = (args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")) == "float32"
        same = SAMPLING_ARGS if fp32 else SAMPLING_ARGS + ("max_num_seqs",)
        ex.check_same_args(os.path.join(out_dir, "args.json"), args, same, f"the samples in {out_dir}")
    problems = {(b, q["id"]): q for b, qs in benches.items() for q in qs}
    for key, row in done.items():
        q = problems.get(key[:2])
        if "rollout_ids" in row:
            raise ex.InputError(f"{out_dir}: sample {key} was drawn in waves, with other seeds: use another --out")
        if q is None or key[2] >= args.k or row.get("problem") != q["problem"] or str(row["answer"]) != q["answer"]:
            raise ex.InputError(f"{out_dir}: sample {key} was not made from this run's problems x --k {args.k} "
                             "(the data files changed?): use another --out")


def regrade(path: str) -> list:
    """Grade every row of a samples file again with today's `executor.correct` (a grader
    fixed after the run: tests/faults.md A19; a GSM8K gold kept whole by an older reader is
    read after its `####`) and rewrite the file atomically when a verdict changed, printing
    each change; a symlink's target is rewritten, its mode kept. Returns the (benchmark, id,
    sample_idx) keys changed. Raises InputError, before any change, for a file it may not write."""
    rows = load_samples(path)
    changed = []
    for row in rows:
        verdict = ex.correct(row["pred"], dict(row, answer=ex.final_answer(row["answer"])))
        if verdict != row["correct"]:
            changed.append((row["benchmark"], row["id"], row["sample_idx"]))
            print(f"regraded {changed[-1]}: pred {row['pred']!r}, gold {row['answer']!r}: "
                  f"{row['correct']} -> {verdict}", flush=True)
            row["correct"] = verdict
    target = os.path.realpath(path)
    mode = os.stat(target).st_mode & 0o7777
    # (root may write a 0444 file; it is not meant to be written)
    if changed and not (mode & 0o222 and os.access(target, os.W_OK)):
        raise ex.InputError(f"{path}: read-only, so its {len(changed)} changed verdicts cannot be written: "
                            "regrade a copy")
    if changed:
        ex.write_json_atomic(target, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        os.chmod(target, mode)
    print(f"{path}: {len(changed)} of {len(rows)} verdicts changed by regrading", flush=True)
    return changed


def write_report(out_dir: str, args_dict: dict) -> None:
    """Metrics of out_dir/samples.jsonl: writes metrics.json ({"args": args_dict,
    "benchmarks"}) and metrics.md, prints the tables, warns when most samples of a
    benchmark ended on a budget. The same function serves a run and --from-samples, so
    both give identical metrics. Raises InputError for a bad or missing samples file."""
    path = os.path.join(out_dir, "samples.jsonl")
    rows = load_samples(path)
    if not rows:
        raise ex.InputError(f"{path}: no samples")
    check_k(rows, path)
    metrics = summarize(rows)
    table = markdown_table(metrics)
    ex.write_json_atomic(os.path.join(out_dir, "metrics.json"), {"args": args_dict, "benchmarks": metrics})
    ex.write_json_atomic(os.path.join(out_dir, "metrics.md"), table)
    print(table, flush=True)
    for bench, m in metrics.items():
        length, tools = (m["finish_reasons"].get(x, 0.0) for x in ("length", "tool_budget"))
        if length + tools > 0.5:
            print(f"WARNING: {bench}: {length + tools:.0%} of samples ended on a budget (length {length:.0%}, "
                  f"tool_budget {tools:.0%}): raise --max-new-tokens / --max-context / --max-tool-calls",
                  file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# Evaluation run


def run(args) -> None:
    """Sample k completions per problem on every rank's problems, append each as it finishes,
    then (rank 0) merge the ranks' files and write the report."""
    # 1) inputs and resume state, checked before any process group exists so that every
    #    rank fails the same clean way. Every rank must read the same `done` (rank_share
    #    splits what is left by it): each reads it here, before the rendezvous of
    #    setup_distributed, which waits for every rank, and no rank writes before that
    # (its own samples.jsonl as --data fails check_resume below); a live run there holds its lock
    from distill import load_exemplars

    ex.check_out(args.out, "evaluate", (args.model, *args.data))
    if os.path.isdir(args.out):
        ex.lock_run(args.out)
    benches = read_benchmarks(args.data, args.limit)
    shots = load_exemplars(args.exemplars) if args.exemplars else ()   # (distill.py's check of them)
    problems = [(b, q) for b, qs in benches.items() for q in qs]
    keys = [(b, q["id"], j) for b, q in problems for j in range(args.k)]  # the work items, in report order
    done = merged_samples(args.out)
    check_resume(args, args.out, done, benches)

    from sft import barrier, cleanup_distributed, memory_plan, print0, setup_distributed, start_run, weights_gib

    # gloo even on GPUs: the only collective is the end-of-run barrier, which waits for the
    # slowest rank (hence the long timeout; NCCL's default, 10 min, is far shorter than
    # rollout time differences)
    rank, local_rank, world, device = setup_distributed(args.seed, backend="gloo", timeout=datetime.timedelta(hours=48))
    try:
        # a problem that lacks a sample is sampled whole again: its seeds reproduce the saved ones
        todo = rank_share(problems, done, args.k, rank, world)
        print0(f"{len(keys)} samples ({len(benches)} benchmarks, k {args.k}), <= {args.max_num_seqs} at once on each "
               f"of {world} ranks; {len(done)} samples already in {args.out}")
        if todo:
            model, tok = ex.load_model(args.model, dtype=args.dtype, device=device)
            # rows admitted so that the KV cache they can reach fits (tests/faults.md D12)
            args.max_num_seqs, plan = memory_plan(model.config, model.dtype.itemsize, args.max_num_seqs,
                                                  args.max_context, args.kv_cache_gb, weights_gib(model), device)
            print0(plan)
            # every prompt is measured before any forward: one with no room for a token under
            # --max-context would be prefilled for nothing, and a benchmark is not cut silently
            prompts = {(b, q["id"]): ex.stage_prompt_ids(tok, q["problem"], args.stateful, shots) for b, q in problems}
            if long := [key for key, ids in prompts.items() if len(ids) >= args.max_context]:
                raise ex.InputError(f"{len(long)} of {len(prompts)} prompts leave no room under --max-context "
                                    f"{args.max_context} (e.g. {long[0]}: {len(prompts[long[0]])} tokens): "
                                    "raise it, or remove those problems")
        # nothing is written before the prompts are measured (the last check)
        os.makedirs(args.out, exist_ok=True)  # every rank: a rank on another node writes its own file here
        if rank == 0:  # one writer; its lock: a run started meanwhile into a new --out, one of the two goes on
            start_run(os.path.join(args.out, "args.json"), "evaluate", args, args.out)

        # 2) rollouts: one call for all of this rank's problems; each sample is appended to this
        #    rank's file as it finishes. No collective in here: ranks finish at different times.
        if todo:
            my_file = os.path.join(args.out, f"samples.rank{rank}.jsonl")
            ex.drop_torn_tail(my_file)
            t0, mine = time.time(), [(b, q, j) for b, q in todo for j in range(args.k)]  # sample n of the call

            def save(n, sample):
                b, q, j = mine[n]
                if (b, q["id"], j) not in done:
                    ex.append_jsonl(my_file, [{**ex.sample_record(q, sample), "benchmark": b, "sample_idx": j}])
            with ex.Sandbox(workers=args.exec_workers, timeout=args.exec_timeout) as sandbox:
                ex.rollout(model, tok, [prompts[b, q["id"]] for b, q in todo], sandbox, n=args.k,
                           seed=[sample_seed(args.seed, b, q["id"], j) for b, q, j in mine],
                           max_num_seqs=args.max_num_seqs, on_sample=save, progress=rank == 0,
                           **{a: getattr(args, a) for a in ex.ROLLOUT_ARGS})
            print(f"[rank {rank}] sampled {len(todo)} problems x {args.k} in {time.time() - t0:.1f}s", flush=True)

        # 3) every rank done; rank 0 merges the ranks' files into samples.jsonl (no collective
        #    below), then removes them (a crash in between leaves identical duplicates, which
        #    merged_samples accepts)
        barrier()
        if rank == 0:
            rows = merged_samples(args.out)
            assert set(rows) == set(keys), f"{len(set(keys) - set(rows))} samples missing after the run"
            ex.write_json_atomic(os.path.join(args.out, "samples.jsonl"),
                              "".join(json.dumps(rows[key], ensure_ascii=False) + "\n" for key in keys))
            for path in glob.glob(os.path.join(glob.escape(args.out), "samples.rank*.jsonl")):
                os.remove(path)
            write_report(args.out, {"stage": "evaluate", **vars(args)})
    finally:
        cleanup_distributed()


def main(argv=None) -> None:
    """The command line (exit status, one-line errors and Ctrl-C: `executor.cli`)."""
    args = parse_args(argv)
    if args.from_samples is not None:
        regrade(os.path.join(args.from_samples, "samples.jsonl"))
        write_report(args.from_samples, {"from_samples": args.from_samples})
    else:
        run(args)
    if args.show:   # the first N samples, readably
        for row in load_samples(os.path.join(args.from_samples or args.out, "samples.jsonl"))[:args.show]:
            print(ex.format_trajectory(row) + "\n", flush=True)


def interrupted() -> str:
    """The line a Ctrl-C prints: what is kept, and the command that continues."""
    return f"the finished samples are kept in {parse_args().out}; resume: {ex.command_line()}"


if __name__ == "__main__":
    sys.exit(ex.cli(main, interrupted=interrupted))
