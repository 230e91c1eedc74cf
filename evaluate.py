"""Evaluate a THINC policy: k samples per problem, then avg@k / pass@k / maj@k and the
paper's trajectory diagnostics (code-grounded answer rate, Recovery@k).

Each problem is answered k times (paper: k = 16, temperature 0.6, top-p 1.0, 32K budget);
sample j of every problem forms run j. Metrics, as the paper reports them:

    avg@k   = 1/k sum_j acc(run j), reported +- the std of acc(run j) over the k runs
    pass@k  = mean_problems [1 - C(n - c, k) / C(n, k)]      (Chen et al. 2021, unbiased)
    maj@k   = mean_problems 1[the most frequent normalised answer is correct]
    code-grounded rate = share of answered samples whose answer appears in an execution output
    Recovery@k (k = 1..5) = accuracy among samples whose first k code blocks all failed
plus per-trajectory code lines, code blocks, tool calls, execution errors, model tokens,
plan tokens and plan share, prose written after the plan, and finish reasons.

Reads: a model (HF directory, .gguf, or a packaged name) and problems JSONL files
({"id", "problem", "answer"}; the file stem names the benchmark). Writes, in --out:
samples.rank{r}.jsonl while running (each rank appends its finished waves), then
samples.jsonl (all ranks merged: the problem's fields and executor.sample_record's
fields plus benchmark, sample_idx, seed, rollout_ids, rollout_n), metrics.json
({"args", "benchmarks": {name: metrics}}), metrics.md (the tables, also printed) and
args.json. A killed run restarted with the same command skips the samples already written.

    python evaluate.py --model DIR --data aime24.jsonl aime25.jsonl --out runs/eval1
    torchrun --standalone --nproc_per_node=8 evaluate.py --model DIR --data a.jsonl --out runs/eval1
    python evaluate.py --from-samples runs/eval1        # recompute every metric, no model

Fractions are stored in [0, 1] in metrics.json and printed as percentages.

Departures from the paper (it does not define these details):
  1. The std of avg@k is the population std (ddof = 0) of the k run accuracies.
  2. maj@k ties go to the answer whose first vote came earliest (lowest sample_idx);
     answers are grouped by their normalised string, so `0.5` and `\\frac{1}{2}` are
     different votes.
  3. Code grounding matches the answer as a token in the outputs (rules in
     `answer_in_output`), not by a general equivalence check.
  4. Sampling runs in waves of --batch-size problems x k samples, one rollout call (one
     seed, a generator per row) per wave; waves depend only on the data and --batch-size, never on
     the number of ranks, so a sample is reproduced by rerunning its wave (its row names
     the call's seed and problem ids) and 1 or N ranks give the same samples.
"""
import argparse
import datetime
import json
import math
import os
import re
import sys
import time
from collections import Counter, defaultdict
from fractions import Fraction

from executor import normalize_answer, write_json_atomic

RECOVERY_KS = (1, 2, 3, 4, 5)
REQUIRED_FIELDS = ("id", "answer", "pred", "correct", "sample_idx", "benchmark",
                   "finish_reason", "completion", "blocks", "n_code_blocks", "n_exec_errors",
                   "completion_tokens", "model_tokens", "plan_tokens")

# -----------------------------------------------------------------------------
# Accuracy: avg@k, pass@k, maj@k


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _by_problem(records) -> dict:
    """(benchmark, id) -> that problem's records sorted by sample_idx."""
    groups = defaultdict(list)
    for r in records:
        groups[(r.get("benchmark"), r["id"])].append(r)
    return {key: sorted(rs, key=lambda r: r["sample_idx"]) for key, rs in groups.items()}


def avg_at_k(records) -> tuple:
    """(mean, std) of the per-run accuracies, as fractions in [0, 1].

    Run j is every record with sample_idx == j; its accuracy is the share of its records
    marked correct (over the problems present in that run). mean is the average over runs
    (equal to the overall accuracy when every problem has every run); std is the
    population std over runs (the paper's +-). Raises ValueError on no records.
    """
    runs = defaultdict(list)
    for r in records:
        runs[r["sample_idx"]].append(bool(r["correct"]))
    if not runs:
        raise ValueError("avg_at_k: no records")
    accs = [sum(v) / len(v) for _, v in sorted(runs.items())]
    mean = sum(accs) / len(accs)
    std = math.sqrt(sum((a - mean) ** 2 for a in accs) / len(accs))
    return mean, std


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with n samples of which c are correct:
    1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which
    never forms the large binomials (Chen et al. 2021, Codex paper, Fig. 3).
    Raises ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:   # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(records, k: int) -> float:
    """pass_at_k averaged over problems (n, c counted per problem). Raises ValueError if
    some problem has fewer than k samples."""
    vals = []
    for key, rs in _by_problem(records).items():
        if len(rs) < k:
            raise ValueError(f"pass@{k}: problem {key[1]!r} has only {len(rs)} samples")
        vals.append(pass_at_k(len(rs), sum(bool(r["correct"]) for r in rs), k))
    return _mean(vals)


def majority_answer(records, normalize=normalize_answer):
    """The voted record of one problem: records with a pred vote for normalize(pred); the
    answer with most votes wins, ties going to the answer whose first vote has the lowest
    sample_idx. Returns the earliest record of the winning answer, or None if no record
    has a (non-empty) answer."""
    groups = {}   # normalised answer -> records, in first-vote order
    for r in sorted(records, key=lambda r: r["sample_idx"]):
        if r["pred"] is None:
            continue
        key = normalize(r["pred"])
        if key:
            groups.setdefault(key, []).append(r)
    if not groups:
        return None
    # max() keeps the first of equal counts, and groups are in first-vote order
    return max(groups.values(), key=len)[0]


def maj_at_k(records, k: int | None = None, normalize=normalize_answer) -> float:
    """maj@k: share of problems whose majority answer (majority_answer over the samples
    with sample_idx < k; all samples when k is None) is correct. A problem with no
    answer at all counts as wrong."""
    hits = []
    for rs in _by_problem(records).values():
        voted = majority_answer([r for r in rs if k is None or r["sample_idx"] < k], normalize)
        hits.append(voted is not None and bool(voted["correct"]))
    return _mean(hits)


# -----------------------------------------------------------------------------
# Code grounding: does the final answer appear in an execution output?

# A number in interpreter output: optional minus, digits, then a fraction `/d`, or
# thousands groups and/or a decimal part. Not inside a word (`x70`, `a_70`), not part of a
# longer number (`170`, `1.70`, `70.5`); a sentence-final period is allowed (`is 70.`).
_OUT_NUMBER = re.compile(r"(?<![\w.])(-?)(\d+)(?:/(\d+)|((?:,\d{3})+)?(\.\d+)?)(?![\w]|\.\d)")
_PRED_NUMBER = re.compile(r"^-?(?:\d+(?:\.\d+)?)$")
_PRED_FRAC = re.compile(r"^(-?)(?:\\frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))$")


def _number_value(pred_norm: str):
    """Fraction value of a normalised answer that is a plain number or a fraction of
    integers, else None."""
    if _PRED_NUMBER.match(pred_norm):
        return Fraction(pred_norm)
    m = _PRED_FRAC.match(pred_norm)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
        if int(den) != 0:
            return Fraction(int(num), int(den)) * (-1 if m.group(1) else 1)
    return None


def _output_numbers(output: str):
    """Fraction values of the number tokens of an interpreter output."""
    for m in _OUT_NUMBER.finditer(output):
        sign, whole, den, groups, dec = m.groups()
        if den is not None:
            if int(den) == 0:
                continue
            v = Fraction(int(whole), int(den))
        else:
            v = Fraction(whole + (groups or "").replace(",", "") + (dec or ""))
        yield -v if sign else v


def _plain_forms(pred_norm: str) -> set:
    """Spellings of a normalised LaTeX answer that code prints: itself, and a sympy-like
    transliteration (`\\frac{\\sqrt{3}}{2}` -> `sqrt(3)/2`, `2\\pi` -> `2*pi`,
    `x^{2}` -> `x**2`), all without whitespace."""
    s = pred_norm
    for _ in range(5):   # innermost first, a few levels of nesting
        t = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
        t = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}",
                   lambda m: _wrap(m.group(1), "+-") + "/" + _wrap(m.group(2), "+-*/"), t)
        if t == s:
            break
        s = t
    for a, b in (("\\pi", "pi"), ("\\cdot", "*"), ("\\times", "*"), ("\\infty", "oo"),
                 ("^", "**"), ("{", "("), ("}", ")"), (" ", "")):
        s = s.replace(a, b)
    s = re.sub(r"(\d)(?=[a-zA-Z(])", r"\1*", s)   # implicit products: 2sqrt(3) -> 2*sqrt(3)
    return {pred_norm.replace(" ", ""), s}


def _wrap(x: str, ops: str) -> str:
    """x in parentheses if it has an operator of ops outside parentheses (a leading minus
    does not count)."""
    depth = 0
    for i, ch in enumerate(x):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and ch in ops and i > 0:
            return "(" + x + ")"
    return x


def _contains_token(haystack: str, needle: str) -> bool:
    """needle occurs in haystack not glued to a neighbouring name, number or product."""
    start = haystack.find(needle)
    while start >= 0:
        before = haystack[start - 1] if start > 0 else " "
        end = start + len(needle)
        after = haystack[end] if end < len(haystack) else " "
        glued_before = before.isalnum() or before in "._*/^"
        glued_after = after.isalnum() or after in "._*/^("
        if not glued_before and not glued_after:
            return True
        start = haystack.find(needle, start + 1)
    return False


def answer_in_output(pred: str, outputs, normalize=normalize_answer) -> bool:
    """Whether the answer appears in at least one of the execution outputs.

    Matching rule: the answer is normalised. A plain number or a fraction of integers
    matches a number token of an output with the same exact value (`70` matches
    `answer = 70`, `70.0`, `1,000`-style groups and `140/2`, but not `170`, `x70`, `1.70`
    or `70.5`; `\\frac{1}{2}` matches `0.5` and `1/2`). Any other answer matches when
    its normalised LaTeX or its sympy-like spelling (see _plain_forms) occurs, with
    whitespace removed, in an output, not glued to a neighbouring name or number.
    """
    p = normalize(pred)
    if not p:
        return False
    value = _number_value(p)
    if value is not None:
        return any(v == value for out in outputs if out for v in _output_numbers(out))
    forms = _plain_forms(p)
    for out in outputs:
        flat = re.sub(r"\s+", "", out or "")
        if any(_contains_token(flat, f) for f in forms):
            return True
    return False


def code_grounded_rate(records, normalize=normalize_answer) -> tuple:
    """(rate or None, count): among records with a pred, the share whose pred appears in
    some block output (answer_in_output); count is the number of records with a pred."""
    hits = [answer_in_output(r["pred"], [b.get("output") for b in r["blocks"]], normalize)
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


_FENCE_LINE = re.compile(r"^[ \t]*```")


def prose_after_plan(completion: str) -> str:
    """The model's text outside code and output blocks after the plan (the plan is the
    text before the first code fence), without the last line that holds a `\\boxed` /
    `\\fbox` answer. Empty for a completion with no code block. Format adherence: THINC
    writes no prose between or after its blocks."""
    lines = completion.split("\n")
    first = next((i for i, ln in enumerate(lines) if _FENCE_LINE.match(ln)), None)
    if first is None:
        return ""
    prose, in_block = [], False
    for ln in lines[first:]:
        if _FENCE_LINE.match(ln):
            # an opening fence has a language tag or starts a block; a bare one closes it
            in_block = not in_block if ln.strip() == "```" else True
            continue
        if not in_block:
            prose.append(ln)
    boxed = [i for i, ln in enumerate(prose) if "\\boxed" in ln or "\\fbox" in ln]
    if boxed:
        del prose[boxed[-1]]
    return "\n".join(prose).strip()


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
    n = len(records)
    prose = [len(prose_after_plan(r["completion"]).split()) for r in records]
    return {
        "code_lines": _mean(code_lines(r) for r in records),
        "code_blocks": _mean(r["n_code_blocks"] for r in records),
        "tool_calls": _mean(len(r["blocks"]) for r in records),
        "exec_errors": _mean(r["n_exec_errors"] for r in records),
        "model_tokens": _mean(r["model_tokens"] for r in records),
        "completion_tokens": _mean(r["completion_tokens"] for r in records),
        "plan_tokens": _mean(r["plan_tokens"] for r in records),
        "plan_share": _mean(r["plan_tokens"] / r["model_tokens"] for r in records
                            if r["model_tokens"] > 0),
        "prose_words_after_plan": _mean(prose),
        "prose_after_plan_share": _mean(w > 0 for w in prose),
        "no_code_share": _mean(r["n_code_blocks"] == 0 for r in records),
        "no_answer_share": _mean(r["pred"] is None for r in records),
        "finish_reasons": {k: c / n for k, c in sorted(Counter(r["finish_reason"]
                                                               for r in records).items())},
    }


# -----------------------------------------------------------------------------
# Summary and tables


def summarize(records, normalize=normalize_answer) -> dict:
    """{benchmark: metrics} with, per benchmark: n_problems, n_samples, k (fewest samples
    of any problem) and k_max, avg_at_k and avg_at_k_std, pass_at_k {str(k): value} for
    k = 1, 2, 4, ... <= k and k itself, maj_at_k (over all samples), code_grounded
    {rate, count}, recovery {str(k): {value, count}} for k = 1..5, and the
    trajectory_stats keys. Raises ValueError on no records."""
    if not records:
        raise ValueError("summarize: no records")
    by_bench = defaultdict(list)
    for r in records:
        by_bench[r["benchmark"]].append(r)
    out = {}
    for bench, rs in sorted(by_bench.items()):
        sizes = [len(v) for v in _by_problem(rs).values()]
        k = min(sizes)
        ks = sorted({2 ** i for i in range(k.bit_length()) if 2 ** i <= k} | {k})
        mean, std = avg_at_k(rs)
        rate, count = code_grounded_rate(rs, normalize)
        out[bench] = {
            "n_problems": len(sizes), "n_samples": len(rs), "k": k, "k_max": max(sizes),
            "avg_at_k": mean, "avg_at_k_std": std,
            "pass_at_k": {str(j): mean_pass_at_k(rs, j) for j in ks},
            "maj_at_k": maj_at_k(rs, None, normalize),
            "code_grounded": {"rate": rate, "count": count},
            "recovery": {str(j): dict(zip(("value", "count"), recovery_at_k(rs, j)))
                         for j in RECOVERY_KS},
            **trajectory_stats(rs),
        }
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_table(metrics: dict) -> str:
    """Two markdown tables for {benchmark: metrics} (as from summarize): accuracy
    (avg@k +- std, maj@k, pass@k at the largest k, in %; a `mean` row of the benchmarks'
    avg@k when there are several) and diagnostics (per-trajectory means, code-grounded
    rate, Recovery@1..5 with their counts, finish-reason shares)."""
    acc = ["| benchmark | problems | k | avg@k | maj@k | pass@k |",
           "|---|---|---|---|---|---|"]
    for bench, m in metrics.items():
        top = max(m["pass_at_k"], key=int)
        acc.append(f"| {bench} | {m['n_problems']} | {m['k']} | {_pct(m['avg_at_k'])} ± "
                   f"{_pct(m['avg_at_k_std'])} | {_pct(m['maj_at_k'])} | "
                   f"{_pct(m['pass_at_k'][top])} (k={top}) |")
    if len(metrics) > 1:
        acc.append(f"| mean | | | {_pct(_mean(m['avg_at_k'] for m in metrics.values()))} | | |")
    rec_head = " | ".join(f"R@{j} (n)" for j in RECOVERY_KS)
    diag = [f"| benchmark | tool calls | code lines | errors | model tokens | plan share | "
            f"prose words | grounded | {rec_head} | stop / length / tool_budget |",
            "|---" * (9 + len(RECOVERY_KS)) + "|"]
    for bench, m in metrics.items():
        rec = " | ".join(f"{_pct(r['value'])} ({r['count']})"
                         for r in (m["recovery"][str(j)] for j in RECOVERY_KS))
        fr = m["finish_reasons"]
        ends = " / ".join(_pct(fr.get(x, 0.0)) for x in ("stop", "length", "tool_budget"))
        diag.append(f"| {bench} | {_num(m['tool_calls'])} | {_num(m['code_lines'])} | "
                    f"{_num(m['exec_errors'])} | {_num(m['model_tokens'], 0)} | "
                    f"{_pct(m['plan_share'])} | {_num(m['prose_words_after_plan'])} | "
                    f"{_pct(m['code_grounded']['rate'])} | {rec} | {ends} |")
    return "\n".join(acc) + "\n\n" + "\n".join(diag) + "\n"


# -----------------------------------------------------------------------------
# Files


# the type of each field a metric reads (bool is not an int here: `"correct": "false"` or
# `"sample_idx": true` is an error, not a silently wrong number)
FIELD_TYPES = {"id": str, "benchmark": str, "answer": str, "correct": bool, "sample_idx": int,
               "finish_reason": str, "completion": str, "blocks": list, "n_code_blocks": int,
               "n_exec_errors": int, "completion_tokens": int, "model_tokens": int, "plan_tokens": int}


def load_samples(path: str, torn_tail_ok: bool = False) -> list:
    """Rows of a samples JSONL. With `torn_tail_ok` (a rank's file, appended as it goes) a
    torn last line, from a run killed mid-write, is ignored; samples.jsonl is written
    atomically, so there a torn line is an error.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a bad JSON line, a row missing one of REQUIRED_FIELDS or with a field of
            the wrong type (FIELD_TYPES; `pred` a string or null), or a second row for the
            same (benchmark, id, sample_idx); the message names file, line and field.
    """
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    rows, seen = [], {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if torn_tail_ok and lineno == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        missing = [k for k in REQUIRED_FIELDS if k not in row]
        if missing:
            raise ValueError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
        for k, t in FIELD_TYPES.items():
            v = row[k]
            if not isinstance(v, t) or (t is int and isinstance(v, bool)):
                raise ValueError(f"{path}:{lineno}: field '{k}' must be {t.__name__}, got {v!r}")
        if row["pred"] is not None and not isinstance(row["pred"], str):
            raise ValueError(f"{path}:{lineno}: field 'pred' must be a string or null, got {row['pred']!r}")
        key = (row["benchmark"], row["id"], row["sample_idx"])
        if key in seen:
            raise ValueError(f"{path}:{lineno}: duplicate of line {seen[key]} "
                             f"(benchmark, id, sample_idx) = {key}")
        seen[key] = lineno
        rows.append(row)
    return rows


RANK_FILE = re.compile(r"samples\.rank\d+\.jsonl")   # a rank's samples while a run is in progress


class InputError(Exception):
    """A problem with the user's input (files, arguments, a run directory): main prints
    the message as one line and exits with code 2."""


def merged_samples(out_dir: str) -> dict:
    """Every sample row found in out_dir: samples.jsonl (a finished run's merge) and
    samples.rank*.jsonl (in-progress rows of any earlier world size), each read with
    load_samples (a torn last line of a rank's file, from a killed write, is ignored). Returns
    {(benchmark, id, sample_idx): row}; the same key in two files must hold the same row.

    Raises:
        InputError: a bad line, a row missing a field, or conflicting rows for one key.
    """
    names = sorted(n for n in os.listdir(out_dir) if RANK_FILE.fullmatch(n)) if os.path.isdir(out_dir) else []
    rows, where = {}, {}
    for name in ["samples.jsonl"] + names:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        try:
            file_rows = load_samples(path, torn_tail_ok=name != "samples.jsonl")
        except ValueError as e:
            raise InputError(str(e)) from None
        for row in file_rows:
            key = (row["benchmark"], row["id"], row["sample_idx"])
            if key in rows and rows[key] != row:
                raise InputError(f"{path}: sample {key} differs from the one in {where[key]} "
                                 "(two runs wrote to this folder?)")
            rows[key], where[key] = row, path
    return rows


# -----------------------------------------------------------------------------
# Config


# arguments that change what a sample is: a run folder is only resumed with the same ones
SAMPLING_ARGS = ("model", "dtype", "temperature", "top_p", "top_k", "max_context",
                 "max_new_tokens", "max_tool_calls", "seed", "exec_timeout")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="THINC evaluation: k samples per problem, then avg@k, "
                                "pass@k, maj@k, code-grounded rate, Recovery@k and trajectory "
                                "diagnostics. Launch with python or torchrun.")
    # model and data
    p.add_argument("--model", default=None, help="policy: HF model dir, .gguf file or packaged "
                   "model name (default: executor.DEFAULT_POLICY)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="weights dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--data", nargs="+", metavar="JSONL",
                   default=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo_problems.jsonl")],
                   help="problems files, one benchmark each (named by the file stem); default: "
                   "data/demo_problems.jsonl")
    p.add_argument("--limit", type=int, default=0, help="first N problems of each file; 0 = all")
    p.add_argument("--out", metavar="DIR", default="runs/eval", help="run folder (created; a folder "
                   "holding a killed run of the same command is resumed)")
    # sampling (paper defaults)
    p.add_argument("--k", type=int, default=16, help="samples per problem (avg@k, pass@k, maj@k)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1.0 = off")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter; 0 = off")
    p.add_argument("--max-context", type=int, default=32768,
                   help="tokens of prompt + completion (model and interpreter output) per sample")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="model-written tokens per sample; 0 = no limit beyond --max-context")
    p.add_argument("--max-tool-calls", type=int, default=40, help="executed code blocks per sample")
    p.add_argument("--seed", type=int, default=0, help="base seed; each wave's rollout seed is "
                   "derived from it, the benchmark, the wave's problem ids and k")
    # throughput
    p.add_argument("--batch-size", type=int, default=4, help="problems per rollout call (a wave "
                   "of batch-size x k sequences shares the KV cache, per rank); lower it if out "
                   "of memory. Part of what makes a sample reproducible (see waves)")
    p.add_argument("--exec-workers", type=int, default=0,
                   help="code blocks run at once, per rank; 0 = CPUs / local ranks")
    p.add_argument("--exec-timeout", type=float, default=10.0, help="seconds per code block, wall clock")
    # no model
    p.add_argument("--from-samples", metavar="DIR", help="recompute every metric from "
                   "DIR/samples.jsonl (no model); writes DIR/metrics.json and DIR/metrics.md")
    p.add_argument("--show", type=int, default=0, metavar="N", help="after the tables, print the "
                   "first N trajectories of samples.jsonl readably; 0 = none")
    p.add_argument("--plot", nargs="+", metavar="RUN_DIR", help="draw PNGs instead (needs matplotlib): "
                   "training curves from a grpo.py run's metrics.jsonl, diagnostics from an evaluation's samples.jsonl")
    args = p.parse_args(argv)
    if args.from_samples is None and not args.plot:
        if not args.data or not args.out:
            p.error("--data and --out are required (or --from-samples DIR)")
        for name in ("k", "batch_size"):
            if getattr(args, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1")
        if args.limit < 0 or args.exec_workers < 0:
            p.error("--limit and --exec-workers must be >= 0")
        if args.model is None:
            from executor import DEFAULT_POLICY
            args.model = DEFAULT_POLICY
    return args


# -----------------------------------------------------------------------------
# Work: benchmarks, waves, resume


def read_benchmarks(paths, limit: int) -> dict:
    """{benchmark name (file stem): its problems (the first `limit`, 0 = all)}, in --data
    order. Raises InputError naming the file (and line) for a missing file, a bad line, a
    line without problem / answer, a duplicate problem id, or two files with one stem."""
    from executor import read_problems
    benches = {}
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        if name in benches:
            raise InputError(f"{path}: a second file for benchmark '{name}' (file stems name benchmarks)")
        try:
            problems = read_problems(path)
        except FileNotFoundError:
            raise InputError(f"{path}: no such file") from None
        except ValueError as e:
            raise InputError(str(e)) from None
        if limit:
            problems = problems[:limit]
        benches[name] = problems
    return benches


def wave_seed(seed: int, benchmark: str, ids, k: int) -> int:
    """The rollout seed of one wave: a stable hash (not Python's salted hash()) of the base
    seed, the benchmark, the wave's problem ids in order, and k."""
    import hashlib
    h = hashlib.sha256(json.dumps([seed, benchmark, list(ids), k]).encode()).hexdigest()
    return int(h[:15], 16)


def make_waves(benches: dict, batch_size: int, k: int, seed: int) -> list:
    """Waves: each benchmark's problems cut, in file order, into chunks of batch_size; one
    rollout call each. A wave is a dict (benchmark, problems, seed). The list depends only
    on the data, --batch-size, k and seed (never on the number of ranks): rank r runs
    waves w with w % world_size == r, all k samples of a problem in one call so that the
    prompt is prefilled once."""
    waves = []
    for bench, problems in benches.items():
        for s in range(0, len(problems), batch_size):
            chunk = problems[s:s + batch_size]
            waves.append(dict(benchmark=bench, problems=chunk,
                              seed=wave_seed(seed, bench, [q["id"] for q in chunk], k)))
    return waves


def wave_keys(wave: dict, k: int) -> list:
    """The wave's work items (benchmark, problem id, sample_idx), problem-major."""
    return [(wave["benchmark"], q["id"], j) for q in wave["problems"] for j in range(k)]


def check_resume(args, out_dir: str, done: dict, benches: dict) -> None:
    """A run folder with samples is resumed only by a compatible command: the same
    SAMPLING_ARGS as its args.json, and every saved sample one of this run's work items
    (benchmark, id, sample_idx < k) made for the same problem and answer. Raises
    InputError saying what differs."""
    if not done:
        return
    saved_path = os.path.join(out_dir, "args.json")
    if os.path.exists(saved_path):
        with open(saved_path, encoding="utf-8") as f:
            saved = json.load(f)
        for name in SAMPLING_ARGS:
            if name in saved and saved[name] != getattr(args, name):
                flag = "--" + name.replace("_", "-")
                raise InputError(f"{out_dir} holds samples made with {flag} {saved[name]}, this run "
                                 f"has {getattr(args, name)}: use another --out")
    problems = {(b, q["id"]): q for b, qs in benches.items() for q in qs}
    outside = [key for key in done if key[:2] not in problems or not 0 <= key[2] < args.k]
    if outside:
        raise InputError(f"{out_dir} holds {len(outside)} samples outside this run's problems x "
                         f"--k {args.k} (e.g. {outside[0]}): rerun with its --data / --limit / --k, "
                         "or use another --out")
    for key, row in done.items():
        q = problems[key[:2]]
        if row.get("problem") != q["problem"] or str(row["answer"]) != q["answer"]:
            raise InputError(f"{out_dir}: sample {key} was made for another problem or answer than "
                             "the data now has: use another --out")


def write_report(out_dir: str, args_dict: dict) -> dict:
    """Metrics of out_dir/samples.jsonl: writes metrics.json ({"args": args_dict,
    "benchmarks"}) and metrics.md, prints the tables, warns when most samples of a
    benchmark ended on a budget. The same function serves a run and --from-samples, so
    both give identical metrics. Raises InputError for a bad or missing samples file."""
    path = os.path.join(out_dir, "samples.jsonl")
    try:
        rows = load_samples(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except ValueError as e:
        raise InputError(str(e)) from None
    if not rows:
        raise InputError(f"{path}: no samples")
    metrics = summarize(rows)
    table = markdown_table(metrics)
    write_json_atomic(os.path.join(out_dir, "metrics.json"), {"args": args_dict, "benchmarks": metrics})
    write_json_atomic(os.path.join(out_dir, "metrics.md"), table)
    print(table, flush=True)
    for bench, m in metrics.items():
        fr = m["finish_reasons"]
        cut = fr.get("length", 0.0) + fr.get("tool_budget", 0.0)
        if cut > 0.5:
            print(f"WARNING: {bench}: {100 * cut:.0f}% of samples ended on a budget (length "
                  f"{100 * fr.get('length', 0.0):.0f}%, tool_budget {100 * fr.get('tool_budget', 0.0):.0f}%): "
                  "raise --max-context / --max-tool-calls", file=sys.stderr, flush=True)
    return metrics


# -----------------------------------------------------------------------------
# Reading a run: trajectories as text, curves and diagnostics as pictures


def show_trajectories(out_dir: str, n: int) -> None:
    """Print the first n samples of out_dir/samples.jsonl readably (executor.format_trajectory)."""
    from executor import format_trajectory
    for row in load_samples(os.path.join(out_dir, "samples.jsonl"))[:n]:
        print(format_trajectory(row) + "\n", flush=True)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def plot_training_curves(rows, path: str, title: str) -> None:
    """Training curves like the paper's Fig. 3 from metrics.jsonl rows (grpo.py), one panel
    each per step: reward and accuracy; model tokens per sample (response length); tool
    calls and execution errors per sample; share of groups with zero reward variance."""
    plt = _pyplot()
    steps = [m["step"] for m in rows]
    panels = [("reward / accuracy", [("reward mean", "reward_mean"), ("accuracy", "accuracy")]),
              ("model tokens per sample", [("model tokens", "model_tokens_per_sample")]),
              ("tool calls per sample", [("tool calls", "tool_calls_per_sample"),
                                         ("execution errors", "exec_errors_per_sample")]),
              ("zero-variance groups (no signal)", [("share of groups", "zero_var_share")])]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for ax, (name, series) in zip(axes, panels):
        for j, (label, key) in enumerate(series):  # the second dashed: reward = accuracy by default
            ax.plot(steps, [m[key] for m in rows], marker="o", linestyle="-" if j == 0 else "--", label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("GRPO step")
        if len(steps) <= 10:
            ax.set_xticks(steps)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    for ax in (axes[0], axes[3]):
        ax.set_ylim(-0.05, 1.05)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_diagnostics(records, path: str, title: str) -> None:
    """The THINC diagnostics like the paper's Figs. 4-5 from samples.jsonl rows, per
    benchmark: the distribution of code lines per trajectory, Recovery@k (k = 1..5;
    accuracy after k failed first blocks, with the count of such samples) and the
    code-grounded rate (share of answers that appear in an execution output)."""
    plt = _pyplot()
    metrics = summarize(records)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 3.4))
    width = 0.8 / len(metrics)
    for i, (bench, m) in enumerate(metrics.items()):
        lines = [code_lines(r) for r in records if r["benchmark"] == bench]
        a.hist(lines, bins=range(0, max(lines) + 2, max(1, (max(lines) + 1) // 20)), histtype="step",
               linewidth=1.5, label=f"{bench} (mean {m['code_lines']:.1f})")
        rec = [m["recovery"][str(k)] for k in RECOVERY_KS]
        xs = [k + (i - (len(metrics) - 1) / 2) * width for k in RECOVERY_KS]
        bars = b.bar(xs, [0 if r["value"] is None else 100 * r["value"] for r in rec], width, label=bench)
        for bar, r in zip(bars, rec):
            b.annotate(f"n={r['count']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                       ha="center", va="bottom", fontsize=7)
        rate = m["code_grounded"]["rate"]
        c.bar(i, 0 if rate is None else 100 * rate, 0.6)
        c.annotate(f"{m['code_grounded']['count']} answered", (i, 0 if rate is None else 100 * rate),
                   ha="center", va="bottom", fontsize=8)
    if not any(r["count"] for m in metrics.values() for r in m["recovery"].values()):
        b.text(0.5, 0.5, "no sample's first block failed", transform=b.transAxes, ha="center")
    a.set(title="code lines per trajectory", xlabel="non-empty code lines", ylabel="trajectories")
    b.set(title="Recovery@k: accuracy after k failed first blocks", xlabel="k", ylabel="% correct",
          xticks=list(RECOVERY_KS), ylim=(0, 110))
    c.set(title="code-grounded answers", ylabel="% of answered", xticks=range(len(metrics)),
          xticklabels=list(metrics), xlim=(-1, len(metrics)), ylim=(0, 110))
    for ax in (a, b, c):
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_run(run_dir: str) -> list:
    """The PNGs for one run folder: training_curves.png from metrics.jsonl (a grpo.py run)
    and diagnostics.png from samples.jsonl (an evaluation), whichever it holds. Returns
    the paths written. Raises InputError when it holds neither or matplotlib is missing."""
    from executor import read_jsonl_tolerant
    written = []
    metrics_path, samples_path = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "samples.jsonl")
    if os.path.isfile(metrics_path):
        rows = read_jsonl_tolerant(metrics_path)
        if not rows:
            raise InputError(f"{metrics_path}: no steps")
        written.append(os.path.join(run_dir, "training_curves.png"))
        plot_training_curves(rows, written[-1], f"GRPO training, {run_dir} ({len(rows)} steps)")
    if os.path.isfile(samples_path):
        rows = load_samples(samples_path)
        if not rows:
            raise InputError(f"{samples_path}: no samples")
        written.append(os.path.join(run_dir, "diagnostics.png"))
        plot_diagnostics(rows, written[-1], f"THINC diagnostics, {run_dir} ({len(rows)} samples)")
    if not written:
        raise InputError(f"{run_dir}: neither metrics.jsonl (a grpo.py run) nor samples.jsonl (an evaluation)")
    return written


# -----------------------------------------------------------------------------
# Evaluation run


def run(args) -> None:
    """Sample k completions per problem on every rank's waves, append them as they finish,
    then (rank 0) merge the ranks' files and write the report."""
    # 1) inputs and resume state, checked before any process group exists so that every
    #    rank fails the same clean way (all ranks read the same files; a rank only ever
    #    appends to its own file, and only rows of its own waves, so what another rank
    #    reads while this one writes cannot change its decisions)
    import executor as ex
    benches = read_benchmarks(args.data, args.limit)
    waves = make_waves(benches, args.batch_size, args.k, args.seed)
    done = merged_samples(args.out)
    check_resume(args, args.out, done, benches)
    if args.model not in ex.PACKAGED_MODELS and not os.path.exists(args.model):
        raise InputError(f"{args.model}: no such model folder or file (nor a packaged model name)")

    import torch.distributed as dist
    from sft import cleanup_distributed, print0, setup_distributed

    rank, local_rank, world, device = setup_distributed(args.seed)
    try:
        # the end-of-run barrier waits for the slowest rank: a CPU (gloo) group with a long
        # timeout, since NCCL's default (10 min) is far shorter than rollout time differences
        group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=48))
                 if dist.is_initialized() else None)
        mine = [w for i, w in enumerate(waves) if i % world == rank]
        todo = [w for w in mine if any(key not in done for key in wave_keys(w, args.k))]
        n_items = sum(len(qs) for qs in benches.values()) * args.k
        print0(f"{len(benches)} benchmarks, {n_items // args.k} problems x k {args.k} = {n_items} samples "
               f"in {len(waves)} waves of <= {args.batch_size} problems; {world} ranks (rank r runs "
               f"waves w % {world} == r); {len(done)} samples already in {args.out}")
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            write_json_atomic(os.path.join(args.out, "args.json"), vars(args))

        # 2) rollouts, one wave at a time; finished waves are appended to this rank's file.
        #    No collective in here: ranks finish their waves at different times.
        if todo:
            my_file = os.path.join(args.out, f"samples.rank{rank}.jsonl")
            os.makedirs(args.out, exist_ok=True)
            ex.drop_torn_tail(my_file)
            model, tok = ex.load_model(args.model, dtype=args.dtype, device=device)
            workers = args.exec_workers or max(1, (os.cpu_count() or 1)
                                                  // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            with ex.Sandbox(workers=workers, timeout=args.exec_timeout) as sandbox:
                for wi, w in enumerate(todo):
                    t0 = time.time()
                    prompts = [ex.build_prompt_ids(tok, q["problem"]) for q in w["problems"]]
                    # the whole wave is rerun even when a resumed run lacks only some of its
                    # samples: the same call (prompts, n, seed) reproduces the same samples
                    samples = ex.rollout(
                        model, tok, prompts, sandbox, n=args.k, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, max_context=args.max_context,
                        max_new_tokens=args.max_new_tokens, max_tool_calls=args.max_tool_calls,
                        seed=w["seed"], progress=rank == 0 and sys.stderr.isatty())
                    ids = [q["id"] for q in w["problems"]]
                    rows = []
                    for i, q in enumerate(w["problems"]):
                        for j in range(args.k):
                            if (w["benchmark"], q["id"], j) in done:
                                continue
                            row = ex.sample_record(q, samples[i * args.k + j])  # seed = the call's
                            row.update(benchmark=w["benchmark"], sample_idx=j, rollout_ids=ids,
                                       rollout_n=args.k)
                            rows.append(row)
                    ex.append_jsonl(my_file, rows)
                    print(f"[rank {rank}] wave {wi + 1}/{len(todo)} ({w['benchmark']}, {len(ids)} problems): "
                          f"{sum(r['correct'] for r in rows)}/{len(rows)} correct, {time.time() - t0:.1f}s",
                          flush=True)

        # 3) every rank done; rank 0 merges the ranks' files into samples.jsonl (no collective
        #    below), then removes them (a crash in between leaves identical duplicates, which
        #    merged_samples accepts)
        if group is not None:
            dist.barrier(group=group)
        if rank == 0:
            rows = merged_samples(args.out)
            order = {key: n for n, key in enumerate(key for w in waves for key in wave_keys(w, args.k))}
            assert set(rows) == set(order), f"{len(set(order) - set(rows))} samples missing after the run"
            text = "".join(json.dumps(rows[key], ensure_ascii=False) + "\n"
                           for key in sorted(rows, key=order.get))
            write_json_atomic(os.path.join(args.out, "samples.jsonl"), text)
            for name in os.listdir(args.out):
                if RANK_FILE.fullmatch(name):
                    os.remove(os.path.join(args.out, name))
            write_report(args.out, vars(args))
    finally:
        cleanup_distributed()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.plot:
            for run_dir in args.plot:
                for path in plot_run(run_dir):
                    print(f"wrote {path}")
        elif args.from_samples is not None:
            write_report(args.from_samples, {"from_samples": args.from_samples})
        else:
            run(args)
        if args.show and not args.plot:
            show_trajectories(args.from_samples or args.out, args.show)
    except InputError as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
