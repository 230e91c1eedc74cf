"""Wall time per grade() call: 200 typical integer answers (the integer rule, in process)
and 200 typical non-integer ones (Math-Verify in the helper process), each against a
baseline in the same run: Math-Verify called directly in this process's main thread
(its own SIGALRM timeouts, which only the main thread can use). Not a test (pytest does
not collect it).

    python tests/benchmarks/bench_grading.py            # 200 + 200 pairs, seed 0

Prints median and max per call for each set and both ways, the ratios of the medians, and
the verdicts' agreement with the baseline.
"""
import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import executor  # noqa: E402
from math_verify import parse, verify  # noqa: E402


def integer_pairs(rng, n):
    """(pred, gold): AIME-style golds 0..999, predictions in the forms models write."""
    forms = ["{}", "{}", "{}", "0{}", "{}.0", "\\frac{{{}}}{{1}}", "{} ways", "x = {}", "\\text{{{}}}"]
    out = []
    for _ in range(n):
        gold = rng.randrange(1000)
        value = gold if rng.random() < 0.6 else rng.randrange(1000)
        out.append((rng.choice(forms).format(value), str(gold)))
    return out


def non_integer_pairs(rng, n):
    """(pred, gold): MATH-style answers (fractions, roots, pi, tuples, intervals,
    polynomials, equations), right about half the time."""
    out = []
    for _ in range(n):
        a, b = rng.randrange(1, 20), rng.randrange(2, 20)
        c = a if rng.random() < 0.5 else a + 1
        kind = rng.randrange(7)
        if kind == 0:
            out.append((str(round(c / b, 6)) if c % b else f"\\frac{{{2 * c}}}{{{2 * b}}}", f"\\frac{{{a}}}{{{b}}}"))
        elif kind == 1:
            out.append((f"\\sqrt{{{c * c * b}}}", f"{a}\\sqrt{{{b}}}"))
        elif kind == 2:
            out.append((f"{c}\\pi", f"{a} \\pi"))
        elif kind == 3:
            out.append((f"({c}, {b})", f"\\left( {a}, {b} \\right)"))
        elif kind == 4:
            out.append((f"[{c}, {b + 20})", f"[{a},{b + 20})"))
        elif kind == 5:
            out.append((f"{b} + {c}x", f"{a}x+{b}"))
        else:
            out.append((f"y = {c}x + {b}", f"y={a}x+{b}"))
    return out


def direct(pred, gold):
    return verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}"))


def timed(fn, pairs):
    times, verdicts = [], []
    for pred, gold in pairs:
        t0 = time.perf_counter()
        verdicts.append(bool(fn(pred, gold)))
        times.append(time.perf_counter() - t0)
    return times, verdicts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200, help="pairs per set")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated pairs")
    args = p.parse_args()
    rng = random.Random(args.seed)
    executor.grade("0.5", "\\frac{1}{2}")   # start the helper (not counted per call)
    direct("0.5", "\\frac{1}{2}")           # the baseline's first-call imports
    for name, pairs in (("integer", integer_pairs(rng, args.n)), ("non-integer", non_integer_pairs(rng, args.n))):
        t_grade, v_grade = timed(executor.grade, pairs)
        t_direct, v_direct = timed(direct, pairs)
        agree = sum(a == b for a, b in zip(v_grade, v_direct))
        print(f"{name:12s} grade: median {1e3 * statistics.median(t_grade):7.3f} ms, max "
              f"{1e3 * max(t_grade):7.2f} ms | Math-Verify in process: median "
              f"{1e3 * statistics.median(t_direct):7.3f} ms, max {1e3 * max(t_direct):7.2f} ms | "
              f"ratio of medians {statistics.median(t_direct) / statistics.median(t_grade):6.2f} | "
              f"right {sum(v_grade)}/{len(pairs)}, same verdict {agree}/{len(pairs)}")
    print("grader failures:", executor.GRADER_FAILURES)


if __name__ == "__main__":
    main()
