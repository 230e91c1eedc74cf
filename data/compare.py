"""Compare evaluations of the same problems (data/README.md's "Does it learn?", data/recipe.sh):
a row per policy, then its gain over the first policy with a paired test over problems.

A row: accuracy (avg@k) with a 95% interval (Wilson's at k = 1, never zero-width; else a
bootstrap over problems), accuracy among the
finished samples (ended by EOS: `finish_reason` 'stop'), the finish rate, the mean tool calls
(executed blocks) per sample and the code-grounded rate (evaluate.code_grounded_rate: the share
of answered samples whose answer appears in an execution output). A gain: the mean
over problems of (its avg@k - the first's), with a 95% paired bootstrap interval (a
problem's two mean scores are resampled together, so the interval reflects which problems
were drawn, not only the k samples of each), and at k = 1 the exact McNemar test (two-sided
binomial test on the problems right under one policy only). Then two floors: the constant
answer, the share of problems whose answer is the most common one (what always writing that
answer scores), and the echo, what boxing the question restated scores (`echo_answer`).
With --families, the right samples per problem family and each family's constant-answer
baseline.

    python data/compare.py --families runs/recipe/heldout_start/samples.jsonl runs/recipe/heldout_grpo/samples.jsonl
    python data/compare.py --budgets 768,1024,1536,2048 data/recipe/budget.samples.jsonl.gz
    python data/compare.py --lead data/recipe   # the README's lead tables (lead_tables)

With --budgets (one file, sampled at the largest budget), the finish rate at each budget:
a sample finishes within B model tokens iff it ended by EOS after at most B (sampling is
seeded per wave and row, so the same run at budget B writes the same first B tokens); the
last line printed is B, the smallest budget at which doubling it raises the finish rate by
less than --max-gain points (both B and 2B must be in the list): past it, what does not
finish loops to any budget rather than being cut short (data/README.md, the recipe's part 1).

A path ending in .gz is read as gzip. A family is a problem's text with its numbers
replaced by N (make_exact.py's templates).
"""
import argparse
import gzip
import itertools
import math
import os
import re
import shutil
import sys
import tempfile
import zlib
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluate  # noqa: E402
import executor as ex  # noqa: E402


def load(path: str) -> list:
    """The rows of an evaluate.py samples file (evaluate.load_samples), gunzipped first if
    the name ends in .gz. Raises InputError naming `path` and the line for a bad row."""
    if not path.endswith(".gz"):
        rows = evaluate.load_samples(path)
        evaluate.check_k(rows, path)  # (uneven samples per problem: not some k)
        return rows
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = os.path.join(tmp_dir, "samples.jsonl")
        try:
            with gzip.open(path, "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ex.InputError(f"{path}: not a whole gzip file ({e})") from None
        try:
            rows = evaluate.load_samples(tmp)
            evaluate.check_k(rows, tmp)
            return rows
        except ex.InputError as e:
            raise ex.InputError(str(e).replace(tmp, path)) from None


def per_problem(path: str, records: list | None = None) -> dict:
    """{(benchmark, problem id): (problem text, gold answer, [0/1 correct for each sample],
    [0/1 finished for each sample])} from a samples file (or its `records`, already loaded).
    Raises InputError naming file and line for a bad row (evaluate.load_samples), or an
    empty file."""
    rows = {}
    for r in load(path) if records is None else records:
        cell = rows.setdefault((r["benchmark"], r["id"]), (r.get("problem", ""), r["answer"], [], []))
        cell[2].append(float(r["correct"]))
        cell[3].append(float(r["finish_reason"] == "stop"))
    if not rows:
        raise ex.InputError(f"{path}: no samples")
    return rows


def check_paired(a: dict, b: dict, path_a: str, path_b: str) -> None:
    """Raises InputError unless the two files hold the same problems, each with the same
    text and number of samples: only then are their means paired problem by problem."""
    if a.keys() != b.keys():
        raise ex.InputError(f"{path_a} and {path_b} hold different problems ({len(a)} and {len(b)} ids)")
    for key in sorted(a):
        if a[key][0] != b[key][0] or len(a[key][2]) != len(b[key][2]):
            raise ex.InputError(f"{path_a} and {path_b} differ on problem {key}: its text or its number of "
                                f"samples ({len(a[key][2])} and {len(b[key][2])})")


def paired_bootstrap(before: np.ndarray, after: np.ndarray, draws: int, seed: int) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of mean(after - before) over problems resampled
    with replacement; before, after: [problems] mean scores in [0, 1]. With before all
    zeros it is the percentile interval of after's own mean."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(before), size=(draws, len(before)))
    gains = (after - before)[idx].mean(axis=1)
    return float(np.percentile(gains, 2.5)), float(np.percentile(gains, 97.5))


def wilson(right: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson's 95% score interval of a proportion right / n (n > 0): never zero-width, so 0 of
    100 is [0.0, 3.7], where the bootstrap over problems gives [0, 0]. For k = 1 rows."""
    p, q = right / n, z * z / n
    half = z * math.sqrt(p * (1 - p) / n + q / (4 * n))
    return max(0.0, (p + q / 2 - half) / (1 + q)), min(1.0, (p + q / 2 + half) / (1 + q))


def sign_flip_p(steps: np.ndarray) -> float:
    """Exact two-sided p-value of a paired sign-flip (permutation) test of mean = 0 on integer
    per-problem differences `steps` (problems,): a difference of means over seeds times both
    seed counts (the test is the same at any positive scale). Under no difference each is as
    likely negated, so the null of the sum is that of sum(+-|d|) over the 2^m sign patterns,
    counted exactly by convolution (2 sum|d| + 1 cells, m passes). Per-problem means over seeds
    take few values with many ties and zeros, where Wilcoxon's normal approximation is shaky;
    this test needs only the symmetry. It holds the trained checkpoints fixed: see
    `seed_permutation_p` for the seeds' own spread."""
    if not np.array_equal(steps, np.rint(steps)):
        raise ValueError(f"sign_flip_p takes integer differences (scale the means), got {steps}")
    sizes = np.abs(steps).astype(int)
    total = int(sizes.sum())
    null = np.zeros(2 * total + 1)  # null[j] = P(sum = j - total)
    null[total] = 1.0
    for d in sizes[sizes > 0]:  # the support stays within +-total: np.roll never wraps a mass
        null = (np.roll(null, d) + np.roll(null, -d)) / 2
    return float(null[np.abs(np.arange(-total, total + 1)) >= abs(int(steps.sum()))].sum())


def seed_permutation_p(a: list, b: list) -> tuple[float, float]:
    """Exact two-sided permutation test of two policies' accuracy with each training seed one
    value (a, b: each seed's accuracy): the share of the C(len(a) + len(b), len(a)) ways to split
    the pooled values into groups of those sizes whose |difference of means| reaches the
    observed one. Returns (p, the smallest p any split could give: 1/3 with 2 + 2 seeds, 1/10
    with 3 + 3). Unlike the per-problem tests it counts the seeds' spread (a policy's seeds
    differ by up to 19 points here), so few seeds cannot make it small."""
    pooled = np.array(list(a) + list(b), dtype=float)
    gaps = []
    for first in itertools.combinations(range(len(pooled)), len(a)):
        mask = np.isin(np.arange(len(pooled)), first)
        gaps.append(abs(pooled[~mask].mean() - pooled[mask].mean()))
    gaps = np.array(gaps)
    observed = abs(np.mean(b) - np.mean(a))
    return float((gaps >= observed - 1e-9).mean()), float((gaps >= gaps.max() - 1e-9).mean())


LEAD_ROWS = (("start", "start (packaged 0.5B)"), ("start_3shot", "start, the 3 exemplars as prior turns"),
             ("sft", "SFT"), ("grpo", "GRPO from start (no SFT)"), ("sft_grpo", "SFT + GRPO"),
             ("control", "control: rewards permuted among a rank's samples"),
             ("control_group", "control: rewards shuffled within each group"))


def seed_files(folder: str, name: str) -> dict:
    """{seed: path} of one policy's committed samples: NAME.samples.jsonl.gz is seed 0 (round 1's
    --seed 0), NAME_seedN.samples.jsonl.gz seed N (data/recipe.sh's round 2); {} for none."""
    pattern = re.compile(re.escape(name) + r"(?:_seed(\d+))?\.samples\.jsonl\.gz")
    found = {}
    for f in sorted(os.listdir(folder)):
        if m := pattern.fullmatch(f):
            found[int(m.group(1) or 0)] = os.path.join(folder, f)
    return dict(sorted(found.items()))


def one_sample_each(run: dict, path: str) -> np.ndarray:
    """(problems,) the 0/1 score of each problem of a k = 1 run (`per_problem`), in sorted
    order. Raises InputError for k > 1: the lead's tests (McNemar, Wilson) are for k = 1."""
    if any(len(run[i][2]) != 1 for i in run):
        raise ex.InputError(f"{path}: more than one sample a problem; --lead reads k = 1 runs")
    return np.array([run[i][2][0] for i in sorted(run)])


def holm(ps: list) -> list:
    """Holm's step-down adjustment of `ps` (family-wise error over the tests together): the
    i-th smallest (from 0) times (m - i), never below the one before it, at most 1."""
    adjusted, floor = [0.0] * len(ps), 0.0
    for i, j in enumerate(sorted(range(len(ps)), key=lambda j: ps[j])):
        floor = max(floor, min(1.0, (len(ps) - i) * ps[j]))
        adjusted[j] = floor
    return adjusted


def gained_lost(before: np.ndarray, after: np.ndarray) -> tuple[int, int]:
    """(problems right only after, right only before) of two (problems,) 0/1 score arrays:
    McNemar's discordant pairs (b, c)."""
    return int(((after == 1) & (before == 0)).sum()), int(((after == 0) & (before == 1)).sum())


def paired_test(before: np.ndarray, after: np.ndarray, seeds_before: int, seeds_after: int) -> str:
    """The p-value of after against before, (problems,) means over each side's seeds: with one
    seed a side (0/1 scores) the exact McNemar test with (gained, lost); else the exact sign-flip
    test on the per-problem differences. Raises ValueError when a mean is not one over its
    side's seed count (k / n with integer k)."""
    if seeds_before == seeds_after == 1:
        b, c = gained_lost(before, after)
        return f"{mcnemar_exact(b, c):.3g} ({b}, {c})"
    scaled = (after - before) * seeds_before * seeds_after  # k/n minus j/m, times n m: integers, up to rounding
    steps = np.rint(scaled)
    if not np.allclose(scaled, steps, rtol=0, atol=1e-6):
        raise ValueError(f"paired_test: accuracies are not means over {seeds_before} and {seeds_after} seeds")
    return f"{sign_flip_p(steps):.3g} (sign-flip)"


def interval(lo: float, hi: float, signed: bool = False) -> str:
    """'[lo, hi]' of two fractions in percent, one decimal; `signed`: with signs (a gain's)."""
    return f"[{100 * lo:+.1f}, {100 * hi:+.1f}]" if signed else f"[{pct(lo)}, {pct(hi)}]"


def lead_tables(folder: str, draws: int, seed: int) -> None:
    """The README's lead, from the committed k = 1 samples in `folder` (data/recipe/) alone: the
    held-out rows (`held_out_rows`), SFT + GRPO against GRPO over the seeds both have (the
    paper's question) per problem (`paired_test`) and with each seed as the unit
    (`seed_permutation_p`), then the public sets (`public_sets`). Raises InputError for unpaired
    files or k > 1."""
    scores = held_out_rows(folder, draws, seed)
    both = sorted(set(scores.get("grpo", {})) & set(scores.get("sft_grpo", {})))
    if both:
        a, b = (np.mean([scores[r][s] for s in both], axis=0) for r in ("grpo", "sft_grpo"))
        lo, hi = paired_bootstrap(a, b, draws, seed)
        print(f"\nSFT + GRPO against GRPO alone, per-problem accuracy over seeds {', '.join(map(str, both))} of "
              f"each: {100 * (b - a).mean():+.1f} {interval(lo, hi, True)}, p = "
              f"{paired_test(a, b, len(both), len(both))}")
        accs = {r: [scores[r][s].mean() for s in both] for r in ("grpo", "sft_grpo")}
        p, floor = seed_permutation_p(accs["grpo"], accs["sft_grpo"])
        each = {r: f"{pct(np.mean(x))} ({', '.join(pct(v) for v in x)})" for r, x in accs.items()}
        print(f"\nThe same seeds as the unit (a seed's accuracy one value): GRPO {each['grpo']}, SFT + GRPO "
              f"{each['sft_grpo']}; exact permutation p = {p:.3g} over the {math.comb(2 * len(both), len(both))} "
              f"splits (no split gives less than {floor:.3g})")
    public_sets(folder, draws, seed)


def held_out_rows(folder: str, draws: int, seed: int) -> dict:
    """Print the held-out table: a row per policy of LEAD_ROWS that has samples. One seed: its
    accuracy with Wilson's interval, the gain over the start model with a paired bootstrap
    interval and the exact McNemar test. Several seeds (each named): the mean accuracy (per
    problem, averaged over seeds) with a bootstrap interval over problems (it covers which
    problems were drawn, not the seeds' spread: that is their range), and the sign-flip test.
    Returns {row: {seed: (problems,) 0/1 scores}}."""
    start_path = os.path.join(folder, "heldout_start.samples.jsonl.gz")
    start = per_problem(start_path)
    base = one_sample_each(start, start_path)  # (problems,)
    scores = {}  # row -> {seed: (problems,) 0/1}
    print(f"Held out ({len(base)} problems, k = 1 a seed):\n")
    print("| policy | seeds | accuracy [95% CI over problems] | gain over start [paired 95% CI] | p (gained, lost) |")
    print("|---|---|---|---|---|")
    for row, name in LEAD_ROWS:
        files = seed_files(folder, f"heldout_{row}")
        if not files:
            continue
        runs = {s: per_problem(f) for s, f in files.items()}
        for s, run in runs.items():
            check_paired(start, run, start_path, files[s])
        scores[row] = {s: one_sample_each(run, files[s]) for s, run in runs.items()}
        mean = np.mean(list(scores[row].values()), axis=0)  # (problems,)
        single = len(runs) == 1
        lo, hi = wilson(int(mean.sum()), len(mean)) if single else \
            paired_bootstrap(np.zeros(len(mean)), mean, draws, seed)
        acc = f"{pct(mean.mean())} {interval(lo, hi)}"
        if not single:
            acc += "; seeds " + ", ".join(f"{s}: {pct(x.mean())}" for s, x in scores[row].items())
        gain, test = "-", "-"
        if row != "start":
            glo, ghi = paired_bootstrap(base, mean, draws, seed)
            gain = f"{100 * (mean - base).mean():+.1f} {interval(glo, ghi, True)}"
            test = paired_test(base, mean, 1, len(runs))
        print(f"| {name} | {', '.join(map(str, scores[row]))} | {acc} | {gain} | {test} |")
    return scores


def public_sets(folder: str, draws: int, seed: int) -> None:
    """Print the public sets' table, start against SFT + GRPO: the full rows where both sets
    have them (SFT + GRPO's seed 2), else the first 100 problems of both (seed 0); nothing
    when neither pair is complete. McNemar's p is adjusted by Holm's method over the two sets.
    Then a line: each set's gain without the problems whose gold is 0, 1 or 2 (`guessable`)."""
    sets = (("math500", "MATH-500, integer answers"), ("gsm8k", "GSM8K test"))
    full = {bench: [f"{bench}_all_start", f"{bench}_all_sft_grpo_seed2"] for bench, _ in sets}
    first = {bench: [f"{bench}_start", f"{bench}_sft_grpo"] for bench, _ in sets}
    for names, which in ((full, "seed 2"), (first, "seed 0")):
        paths = {bench: [os.path.join(folder, f"{n}.samples.jsonl.gz") for n in names[bench]] for bench, _ in sets}
        if all(os.path.exists(f) for fs in paths.values() for f in fs):
            break
    else:
        return
    rows = []
    for bench, what in sets:
        (pa, a), (pb, b) = ((f, per_problem(f)) for f in paths[bench])
        check_paired(a, b, pa, pb)
        rows.append((what, one_sample_each(a, pa), one_sample_each(b, pb), guessable(a)))  # (problems,) each
    print(f"\nPublic sets (k = 1; SFT + GRPO's {which}; p adjusted by Holm's method for the two sets):\n")
    print("| set | problems | start [95% CI] | SFT + GRPO [95% CI] | gain [paired 95% CI] | McNemar p (gained, lost) "
          "| Holm p |")
    print("|---|---|---|---|---|---|---|")
    adjusted = holm([mcnemar_exact(*gained_lost(x, y)) for _, x, y, _ in rows])
    for (what, x, y, _), adj in zip(rows, adjusted):
        lo, hi = paired_bootstrap(x, y, draws, seed)
        print(f"| {what} | {len(x)} | {pct(x.mean())} {interval(*wilson(int(x.sum()), len(x)))} | {pct(y.mean())} "
              f"{interval(*wilson(int(y.sum()), len(y)))} | {100 * (y - x).mean():+.1f} {interval(lo, hi, True)} | "
              f"{paired_test(x, y, 1, 1)} | {adj:.3g} |")
    # a sensitivity check: 0, 1 and 2 are answers a policy can reach without solving, so the gain
    # is recomputed without the problems whose gold is one of them, each set alone
    without = []
    for what, x, y, small in rows:
        if small.all():
            without.append(f"{what}: no problem left")
            continue
        without.append(f"{what}: {int((~small).sum())} problems (of the {int(small.sum())} left out, start solved "
                       f"{int(x[small].sum())}, SFT + GRPO {int(y[small].sum())}), gain "
                       f"{100 * (y - x)[~small].mean():+.1f}, McNemar p = {paired_test(x[~small], y[~small], 1, 1)}")
    print(f"\nWithout the problems whose gold is 0, 1 or 2 (a sensitivity check; gain in points, p unadjusted): "
          f"{'; '.join(without)}")


def guessable(run: dict) -> np.ndarray:
    """(problems,) True where the gold (`per_problem`'s, in its sorted order) is 0, 1 or 2:
    answers a policy may write without solving the problem."""
    return np.array([str(run[i][1]).strip() in ("0", "1", "2") for i in sorted(run)])


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b, c >= 0 problems right under only one policy each;
    under no difference each of the b + c is either with probability 1/2, so
    p = min(1, 2 P[Binomial(b + c, 1/2) <= min(b, c)])."""
    n = b + c
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n)


def constant_baseline(answers: list) -> tuple[str, float]:
    """(the most common answer, the share of `answers` equal to it): what a policy that
    always writes it scores. Ties go to the smallest answer string; [] gives ('', 0.0)."""
    counts = Counter(answers)
    best = max(sorted(counts), key=counts.get, default="")
    return best, counts[best] / len(answers) if answers else 0.0


_RESTATED = [(re.compile(r"What is \$?([^?$]+)\$?\?"), r"\1"),   # What is 8412 \times 2500?
             (re.compile(r"remainder when \$([^$]+)\$ is divided by (\d+)"), r"\1 \\mod \2")]


def echo_answer(problem: str) -> str:
    """The question restated as its answer, what boxing the question would write:
    `What is 8412 \\times 2500?` -> `8412 \\times 2500`; `... the remainder when $4^{142}$ is
    divided by 101?` -> `4^{142} \\mod 101`; any other problem, its own text. Each evaluates
    to the gold, so only a grader that computes expressions pays for it (tests/faults.md A19)."""
    for pattern, answer in _RESTATED:
        if m := pattern.search(problem):
            return m.expand(answer).strip()
    return problem


def finish_rate(rows: list, budget: int) -> float:
    """The share of samples that end by EOS ('stop') within `budget` model tokens."""
    return sum(r["finish_reason"] == "stop" and r["model_tokens"] <= budget for r in rows) / len(rows)


def budget_list(text: str) -> list[int]:
    """An argparse type: '384,768' -> [384, 768]; each a positive integer."""
    return [ex.positive_int(b) for b in text.split(",")]


def label(path: str) -> str:
    """A short row name: the file name without .gz, .jsonl and .samples, or its folder's
    name for a plain samples.jsonl."""
    name = os.path.basename(path).removesuffix(".gz").removesuffix(".jsonl")
    if name == "samples":
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return name.removesuffix(".samples")


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("samples", nargs="+", help="samples.jsonl[.gz] of each policy, the same problems and k; "
                                              "the first is the one the others are compared with")
    p.add_argument("--families", action="store_true", help="also the right samples per problem family")
    p.add_argument("--lead", action="store_true", help="the README's lead tables from one folder's committed "
                                                       "samples (data/recipe/, lead_tables)")
    p.add_argument("--budgets", type=budget_list, help="model tokens, comma-separated (384,768): the finish rate "
                                                         "at each (one file, sampled at the largest)")
    p.add_argument("--max-gain", type=float, default=3.0,
                   help="--budgets: B is the smallest budget whose double finishes fewer than this many points more")
    p.add_argument("--draws", type=ex.positive_int, default=10000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed")
    args = p.parse_args(argv)
    if args.budgets:
        if len(args.samples) != 1:
            p.error(f"--budgets reads one samples file, got {len(args.samples)}")
        if not 0 < args.max_gain <= 100:
            p.error(f"--max-gain must be in (0, 100] points, got {args.max_gain}")
        rows = load(args.samples[0])
        # a sample cut by the budget it was drawn at ran that many model tokens: a larger
        # budget's finish rate is unknown, not the same (what was cut might have finished)
        drawn = max((r["model_tokens"] for r in rows if r["finish_reason"] == "length"), default=None)
        if drawn is not None and max(args.budgets) > drawn:
            raise ex.InputError(f"{args.samples[0]}: sampled at {drawn} model tokens (its samples cut by the "
                                f"budget ran that many): --budgets {max(args.budgets)} is beyond it")
        rates = {b: finish_rate(rows, b) for b in sorted(args.budgets)}
        for b, rate in rates.items():
            print(f"budget {b}: {pct(rate)}% of {len(rows)} samples finished")
        fits = [b for b in rates if 2 * b in rates and 100 * (rates[2 * b] - rates[b]) < args.max_gain]
        if not fits:
            raise ex.InputError(f"{args.samples[0]}: no budget of {sorted(args.budgets)} whose double (also listed) "
                                f"finishes fewer than {args.max_gain} points more of the samples")
        print(fits[0])
        return
    if args.lead:
        if len(args.samples) != 1 or not os.path.isdir(args.samples[0]):
            p.error(f"--lead reads one folder (data/recipe), got {' '.join(args.samples)}")
        lead_tables(args.samples[0], args.draws, args.seed)
        return
    records = [load(path) for path in args.samples]
    runs = [per_problem(path, rs) for path, rs in zip(args.samples, records)]
    for path, run in zip(args.samples[1:], runs[1:]):
        check_paired(runs[0], run, args.samples[0], path)
    ids = sorted(runs[0])
    k = len(runs[0][ids[0]][2])
    first = np.array([np.mean(runs[0][i][2]) for i in ids])
    print(f"{len(ids)} problems, k = {k}; gains are over {label(args.samples[0])}\n")
    print("| policy | accuracy [95% CI] | among finished | finished | tool calls | code-grounded | "
          "gain [95% paired CI] | McNemar p (b, c) |")
    print("|---|---|---|---|---|---|---|---|")
    for path, run, rs in zip(args.samples, runs, records):
        scores = np.array([np.mean(run[i][2]) for i in ids])  # (problems,)
        right = np.array([x for i in ids for x in run[i][2]])  # (problems * k,)
        done = np.array([x for i in ids for x in run[i][3]])  # (problems * k,)
        if k == 1:
            lo, hi = wilson(int(scores.sum()), len(ids))
        else:
            lo, hi = paired_bootstrap(np.zeros(len(ids)), scores, args.draws, args.seed)
        right_done = (right * done).sum()
        among = f"{pct(right_done / done.sum())} ({right_done:.0f} of {done.sum():.0f})" if done.sum() else "-"
        glo, ghi = paired_bootstrap(first, scores, args.draws, args.seed)
        gain = f"{100 * (scores - first).mean():+.1f} {interval(glo, ghi, True)}"
        # at k = 1 a problem's score is 0 or 1: b problems right only here, c only in the first
        b, c = gained_lost(first, scores)
        test = f"{mcnemar_exact(b, c):.3g} ({b}, {c})" if k == 1 else "-"
        if run is runs[0]:
            gain, test = "-", "-"
        tools = np.mean([r["n_code_blocks"] for r in rs])
        rate, answered = evaluate.code_grounded_rate(rs)
        grounded = f"{pct(rate)} (of {answered})" if answered else "-"
        print(f"| {label(path)} | {pct(scores.mean())} [{pct(lo)}, {pct(hi)}] | {among} | {pct(done.mean())} | "
              f"{tools:.2f} | {grounded} | {gain} | {test} |")
    answer, share = constant_baseline([runs[0][i][1] for i in ids])
    print(f"\nconstant answer {answer!r}: {pct(share)}% of the {len(ids)} problems")
    echo = np.mean([ex.grade(echo_answer(runs[0][i][0]), runs[0][i][1]) for i in ids])
    print(f"the question restated (`echo_answer`): {pct(echo)}% of the {len(ids)} problems")
    if not args.families:
        return
    family = {i: re.sub(r"\d+", "N", runs[0][i][0]) for i in ids}
    print("\n| family | problems | constant answer | " + " | ".join(label(s) for s in args.samples) + " |")
    print("|---|---|---|" + "---|" * len(runs))
    for fam in sorted(set(family.values())):
        members = [i for i in ids if family[i] == fam]
        answer, share = constant_baseline([runs[0][i][1] for i in members])
        n = sum(len(runs[0][i][2]) for i in members)
        cells = [f"{sum(sum(run[i][2]) for i in members):.0f} of {n}" for run in runs]
        print(f"| {fam} | {len(members)} | {pct(share)}% ({answer}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(ex.cli(main))
