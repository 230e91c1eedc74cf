"""Per-block wall time of the sandbox (a fork server of pre-imported workers) against a
fresh interpreter per block, in the same run. Not a test (pytest does not collect it).

    python tests/benchmarks/bench_sandbox.py            # defaults: 50 sandbox runs, 15 fresh
    python tests/benchmarks/bench_sandbox.py --n 200 --n-fresh 30

Prints median and p90 per block for (1) a sympy block through Sandbox.run, (2) the same
block as `python -c` in a fresh interpreter, their ratio, (3) the overhead of an empty
block (`pass`) both ways, and (4) the amortised time per block of a batch through run_many.
Targets (issue 2): >= 30x faster than a fresh interpreter, <= 20 ms median overhead.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from executor import Sandbox  # noqa: E402

SYMPY_BLOCK = "import sympy\nprint(sympy.factorint(2**64 + 1))"
WANT = "{274177: 1, 67280421310721: 1}\n"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def line(name, xs):
    print(f"{name:<34} median {statistics.median(xs) * 1e3:9.2f} ms   "
          f"p90 {pct(xs, 0.9) * 1e3:9.2f} ms   (n={len(xs)})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=50, help="sandbox runs per measurement")
    p.add_argument("--n-fresh", type=int, default=15, help="fresh-interpreter runs per measurement")
    p.add_argument("--workers", type=int, default=0, help="sandbox workers (0 = CPU count)")
    p.add_argument("--batch", type=int, default=200, help="blocks in the run_many batch")
    args = p.parse_args()

    def fresh(code):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=60)
        return r.stdout

    assert fresh(SYMPY_BLOCK) == WANT
    t0 = time.perf_counter()
    with Sandbox(workers=args.workers or None) as sb:
        start_s = time.perf_counter() - t0
        for _ in range(5):  # warm up
            assert sb.run(SYMPY_BLOCK).output == WANT
            sb.run("pass")
        sb_sympy = timed(lambda: sb.run(SYMPY_BLOCK), args.n)
        sb_pass = timed(lambda: sb.run("pass"), args.n)
        t0 = time.perf_counter()
        rs = sb.run_many([SYMPY_BLOCK] * args.batch)
        batch_s = time.perf_counter() - t0
        assert all(r.output == WANT for r in rs)
        workers = sb.workers
    fr_sympy = timed(lambda: fresh(SYMPY_BLOCK), args.n_fresh)
    fr_pass = timed(lambda: fresh("pass"), args.n_fresh)

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, sandbox workers={workers}, "
          f"template start {start_s:.2f} s")
    print(f"block: {SYMPY_BLOCK!r}")
    line("sympy block, Sandbox.run", sb_sympy)
    line("sympy block, fresh python -c", fr_sympy)
    ratio = statistics.median(fr_sympy) / statistics.median(sb_sympy)
    print(f"{'ratio (fresh / sandbox, medians)':<34} {ratio:9.1f}x   (target >= 30x)")
    line("`pass`, Sandbox.run (overhead)", sb_pass)
    line("`pass`, fresh python -c", fr_pass)
    print(f"{'sympy block, run_many batch':<34} {batch_s / args.batch * 1e3:9.2f} ms per block "
          f"amortised ({args.batch} blocks, {workers} workers, {batch_s:.2f} s)")
    ok = ratio >= 30 and statistics.median(sb_pass) <= 0.020
    print(f"targets (>= 30x, <= 20 ms median overhead): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
