"""Problems whose answers need exact computation: the setting of data/README.md's "Does it
learn?" experiment. Six families, drawn in turn from a seeded RNG: a product of
a 4-5-digit and a 4-digit number, a^e mod m, the digit sum of 2^n, the sum of the primes
below n, the divisor count of n, and an inclusion-exclusion count (a, b, c distinct, none
dividing another). An untrained small model mostly answers these in prose and gets them
wrong; a short program gets them right.

    python data/make_exact.py --seed 1 --n 400 --out data/exact_train.jsonl
    python data/make_exact.py --seed 2 --n 100 --exclude data/exact_train.jsonl --out data/exact_test.jsonl

Each line: {"id", "problem", "answer"}, the answer computed here by code (and recomputed
another way in tests/test_data.py). A problem whose text is in an --exclude file is drawn
again, so the held-out set shares no problem with the training set.
"""
import argparse
import json
import os
import random


def primes_below(n: int) -> list[int]:
    """The primes p < n, by a sieve of Eratosthenes."""
    sieve = [True] * max(n, 2)
    sieve[0] = sieve[1] = False
    for p in range(2, int(n**0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = [False] * len(range(p * p, n, p))
    return [p for p in range(n) if sieve[p]]


def divisor_count(n: int) -> int:
    """The number of positive divisors of n >= 1, by trial division up to sqrt(n)."""
    count = 0
    d = 1
    while d * d <= n:
        if n % d == 0:
            count += 1 if d * d == n else 2
        d += 1
    return count


def proper_triple(a: int, b: int, c: int) -> bool:
    """True iff a, b, c are distinct and none divides another: else "divisible by a or b but
    not by c" collapses (c = a, or a | b, leaves one condition or none)."""
    return all(x % y for x, y in ((a, b), (b, a), (a, c), (c, a), (b, c), (c, b)))


def draw(rng: random.Random, family: int) -> tuple[str, int]:
    """One problem of a family (0-5): (its text, its answer)."""
    if family == 0:
        a, b = rng.randint(1000, 99999), rng.randint(1000, 9999)
        return f"What is {a} \\times {b}?", a * b
    if family == 1:
        a, e, m = rng.randint(2, 19), rng.randint(50, 300), rng.choice([97, 101, 999, 1000, 10007])
        return f"What is the remainder when ${a}^{{{e}}}$ is divided by {m}?", pow(a, e, m)
    if family == 2:
        n = rng.randint(40, 200)
        return f"What is the sum of the digits of $2^{{{n}}}$?", sum(int(c) for c in str(2**n))
    if family == 3:
        n = rng.randint(100, 2000)
        return f"What is the sum of all prime numbers less than {n}?", sum(primes_below(n))
    if family == 4:
        n = rng.randint(1000, 100000)
        return f"How many positive divisors does {n} have?", divisor_count(n)
    n, a, b, c = rng.randint(200, 5000), rng.randint(2, 9), rng.randint(2, 13), rng.randint(2, 11)
    # a degenerate triple is drawn again from an RNG seeded by this draw, not from `rng`, so
    # the other families' problems stay those drawn before the triple had to be proper
    redraw = random.Random(f"{n} {a} {b} {c}")
    while not proper_triple(a, b, c):
        a, b, c = redraw.randint(2, 9), redraw.randint(2, 13), redraw.randint(2, 11)
    count = sum(1 for x in range(1, n + 1) if (x % a == 0 or x % b == 0) and x % c != 0)
    return f"How many integers from 1 to {n} are divisible by {a} or {b} but not by {c}?", count


def make(seed: int, n: int, exclude: set[str], max_draws: int = 100_000) -> list[dict]:
    """n problems, families in turn, none whose text is in `exclude` or repeated.
    Raises ValueError after `max_draws` draws (a family has only so many problems: the
    digit sum of 2^n, 161)."""
    rng = random.Random(seed)
    seen = set(exclude)
    rows = []
    for _ in range(max_draws):
        if len(rows) == n:
            break
        problem, answer = draw(rng, len(rows) % 6)
        if problem not in seen:
            seen.add(problem)
            rows.append({"id": f"exact-s{seed}-{len(rows):04d}", "problem": problem, "answer": str(answer)})
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} of {n} distinct problems after {max_draws} draws: ask for fewer")
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seed", type=int, default=1, help="RNG seed")
    p.add_argument("--n", type=int, default=400, help="problems to write (at most 968, fewer with --exclude: see make)")
    p.add_argument("--exclude", nargs="*", default=[], help="JSONL files whose problems are not drawn")
    p.add_argument("--out", required=True, help="JSONL to write")
    args = p.parse_args()
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    try:
        excluded = {json.loads(line)["problem"] for path in args.exclude for line in open(path) if line.strip()}
        rows = make(args.seed, args.n, excluded)
    except (OSError, ValueError, KeyError) as e:
        p.error(str(e))
    # written whole, then renamed: a failed run leaves the old file as it was
    with open(args.out + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(args.out + ".tmp", args.out)
