"""Evaluate THINC samples: avg@k / pass@k / maj@k and the paper's trajectory diagnostics.

Each problem is answered k times (paper: k = 16, temperature 0.6, top-p 1.0, 32K budget);
sample j of every problem forms run j. Metrics, as the paper reports them:

    avg@k   = 1/k sum_j acc(run j), reported +- the std of acc(run j) over the k runs
    pass@k  = mean_problems [1 - C(n - c, k) / C(n, k)]      (Chen et al. 2021, unbiased)
    maj@k   = mean_problems 1[the most frequent normalised answer is correct]
    code-grounded rate = share of answered samples whose answer appears in an execution output
    Recovery@k (k = 1..5) = accuracy among samples whose first k code blocks all failed
plus per-trajectory code lines, code blocks, tool calls, execution errors, model tokens,
plan tokens and plan share, prose written after the plan, and finish reasons.

Reads: samples JSONL, one row per (problem, sample) as written by executor.sample_record
(id, answer, pred, correct, finish_reason, n_code_blocks, n_exec_errors, completion,
completion_tokens, model_tokens, plan_tokens, blocks [{code, output, status}],
sample_idx, benchmark). Writes: metrics.json ({"args", "benchmarks": {name: metrics}})
and metrics.md (markdown tables, also printed), next to samples.jsonl.

    python evaluate.py --from-samples runs/eval1        # recompute every metric, no model

Fractions are stored in [0, 1] in metrics.json and printed as percentages.

Departures from the paper (it does not define these details):
  1. The std of avg@k is the population std (ddof = 0) of the k run accuracies.
  2. maj@k ties go to the answer whose first vote came earliest (lowest sample_idx);
     answers are grouped by their normalised string, so `0.5` and `\\frac{1}{2}` are
     different votes.
  3. Code grounding matches the answer as a token in the outputs (rules in
     `answer_in_output`), not by a general equivalence check.
"""
import argparse
import json
import math
import os
import re
import sys
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


def load_samples(path: str) -> list:
    """Rows of a samples JSONL. A torn last line (a run killed mid-write) is ignored.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a bad JSON line, a row missing one of REQUIRED_FIELDS, or a second row
            for the same (benchmark, id, sample_idx); the message names file and line.
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
            if lineno == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        missing = [k for k in REQUIRED_FIELDS if k not in row]
        if missing:
            raise ValueError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
        key = (row["benchmark"], row["id"], row["sample_idx"])
        if key in seen:
            raise ValueError(f"{path}:{lineno}: duplicate of line {seen[key]} "
                             f"(benchmark, id, sample_idx) = {key}")
        seen[key] = lineno
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="THINC evaluation metrics (avg@k, pass@k, maj@k, "
                                "code-grounded rate, Recovery@k, trajectory diagnostics).")
    p.add_argument("--from-samples", required=True, metavar="DIR",
                   help="recompute every metric from DIR/samples.jsonl (no model); writes "
                   "DIR/metrics.json and DIR/metrics.md")
    args = p.parse_args(argv)
    path = os.path.join(args.from_samples, "samples.jsonl")
    metrics = summarize(load_samples(path))
    table = markdown_table(metrics)
    write_json_atomic(os.path.join(args.from_samples, "metrics.json"),
                      {"args": vars(args), "benchmarks": metrics})
    write_json_atomic(os.path.join(args.from_samples, "metrics.md"), table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
