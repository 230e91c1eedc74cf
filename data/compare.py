"""Compare two evaluations of the same problems (data/README.md, "Does it learn?"):
each policy's right samples per problem family, and the gain in avg@k with a 95% paired
bootstrap interval over problems (a problem's two mean scores are resampled together, so
the interval reflects which problems were drawn, not only the k samples of each).

    python data/compare.py --families runs/learn_eval_qwen2.5-coder-0.5b/samples.jsonl runs/learn_eval_latest/samples.jsonl

With --families, a family is a problem's text with its numbers replaced by N (make_exact.py's templates).
"""
import argparse
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluate  # noqa: E402
import executor as ex  # noqa: E402


def per_problem(path: str) -> dict:
    """{(benchmark, problem id): (problem text, [0/1 for each sample])} from an
    evaluate.py samples file. Raises InputError naming file and line for a bad row
    (evaluate.load_samples), or an empty file."""
    rows = {}
    for r in evaluate.load_samples(path):
        rows.setdefault((r["benchmark"], r["id"]), (r.get("problem", ""), []))[1].append(float(r["correct"]))
    if not rows:
        raise ex.InputError(f"{path}: no samples")
    return rows


def check_paired(a: dict, b: dict, path_a: str, path_b: str) -> None:
    """Raises InputError unless the two files hold the same problems, each with the same
    text and number of samples: only then are their means paired problem by problem."""
    if a.keys() != b.keys():
        raise ex.InputError(f"{path_a} and {path_b} hold different problems ({len(a)} and {len(b)} ids)")
    for key in sorted(a):
        if a[key][0] != b[key][0] or len(a[key][1]) != len(b[key][1]):
            raise ex.InputError(f"{path_a} and {path_b} differ on problem {key}: its text or its number of "
                                f"samples ({len(a[key][1])} and {len(b[key][1])})")


def paired_bootstrap(before: np.ndarray, after: np.ndarray, draws: int, seed: int) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of mean(after - before) over problems resampled
    with replacement; before, after: [problems] mean scores in [0, 1]."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(before), size=(draws, len(before)))
    gains = (after - before)[idx].mean(axis=1)
    return float(np.percentile(gains, 2.5)), float(np.percentile(gains, 97.5))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("before", help="samples.jsonl of the starting policy")
    p.add_argument("after", help="samples.jsonl of the trained policy, the same problems and k")
    p.add_argument("--families", action="store_true", help="also the right samples per problem family")
    p.add_argument("--draws", type=ex.positive_int, default=10000, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed")
    args = p.parse_args(argv)
    a, b = per_problem(args.before), per_problem(args.after)
    check_paired(a, b, args.before, args.after)
    ids = sorted(a)
    family = {i: re.sub(r"\d+", "N", a[i][0]) for i in ids}
    for fam in sorted(set(family.values())) if args.families else []:
        right = [sum(sum(x[i][1]) for i in ids if family[i] == fam) for x in (a, b)]
        n = sum(len(a[i][1]) for i in ids if family[i] == fam)
        print(f"{right[0]:4.0f} -> {right[1]:4.0f} of {n:4d}  {fam}")
    before = np.array([np.mean(a[i][1]) for i in ids])
    after = np.array([np.mean(b[i][1]) for i in ids])
    lo, hi = paired_bootstrap(before, after, args.draws, args.seed)
    print(f"avg@k {100 * before.mean():.1f} -> {100 * after.mean():.1f}: gain {100 * (after - before).mean():+.1f} "
          f"points, 95% paired bootstrap over {len(ids)} problems [{100 * lo:+.1f}, {100 * hi:+.1f}]")


if __name__ == "__main__":
    sys.exit(ex.cli(main))
