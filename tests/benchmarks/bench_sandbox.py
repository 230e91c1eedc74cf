"""Cost of a sympy block in three designs, measured in one run. Not a test (pytest does not
collect it).

    python tests/benchmarks/bench_sandbox.py                # 40 timed blocks, 120 for throughput
    python tests/benchmarks/bench_sandbox.py --n 100 --batch 400

Rows: (a) the sandbox (executor.Sandbox: a fork server; per block a PID, mount and IPC
namespace, a seccomp filter and, where the caller may make one, a cgroup), (b) a fresh
`python -c` per block (what a pool of fresh interpreters pays for each block), (c) the fork
server of commit ffd26f0 (no namespaces, a subreaper and a /proc
scan), loaded from git history into this process only. Columns: median / p90 latency of
one block when a worker is free, CPU seconds per block (all processes: caller, template,
block; what competes with decoding on the same cores), and sustained throughput with a
worker per CPU. Target: a sympy block waits <= 30 ms median.
"""
import argparse
import concurrent.futures
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from executor import Sandbox  # noqa: E402

SYMPY_BLOCK = "import sympy\nprint(sympy.factorint(2**64 + 1))"
WANT = "{274177: 1, 67280421310721: 1}\n"
OLD_COMMIT = "ffd26f0"


def old_sandbox_class(commit):
    """Sandbox of executor.py at `commit`, imported from git history (None without git). The
    file is named executor.py in a folder of its own: its template imports it by that name."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:executor.py"], capture_output=True, text=True)
    if src.returncode != 0:
        return None
    path = os.path.join(tempfile.mkdtemp(), "executor.py")
    with open(path, "w") as f:
        f.write(src.stdout)
    spec = importlib.util.spec_from_file_location(f"executor_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sandbox


def cpu_seconds(pid=None):
    """CPU seconds of this process and its reaped children, plus those of `pid` and its
    reaped children (the template), from /proc."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    if pid is not None:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def fresh(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60).stdout


def measure(name, run_one, run_batch, template_pid, n, batch):
    for _ in range(3):  # warm up
        assert run_one() == WANT
    lat = []
    cpu0 = cpu_seconds(template_pid)
    for _ in range(n):
        t0 = time.perf_counter()
        assert run_one() == WANT
        lat.append(time.perf_counter() - t0)
    time.sleep(0.3)  # (the template reaps the last block)
    cpu = (cpu_seconds(template_pid) - cpu0) / n
    t0 = time.perf_counter()
    assert all(out == WANT for out in run_batch([SYMPY_BLOCK] * batch))
    rate = batch / (time.perf_counter() - t0)
    lat.sort()
    print(f"{name:<40} {statistics.median(lat) * 1e3:8.1f} ms {lat[int(0.9 * (len(lat) - 1))] * 1e3:8.1f} ms "
          f"{cpu * 1e3:9.1f} ms {rate:9.1f}")
    return statistics.median(lat), cpu, rate


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=40, help="timed blocks, one at a time, per design")
    p.add_argument("--batch", type=int, default=120, help="blocks of the throughput run (fresh: a third)")
    p.add_argument("--old", default=OLD_COMMIT, help="commit whose sandbox is row (c)")
    args = p.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"python {sys.version.split()[0]}, {cpus} CPUs usable, load average {os.getloadavg()[0]:.1f}, "
          f"uid {os.geteuid()}; block: {SYMPY_BLOCK!r}")
    print(f"{'design':<40} {'median':>11} {'p90':>11} {'CPU/block':>12} {'blocks/s':>9}")
    rows = {}
    with Sandbox(workers=cpus) as sb:
        rows["a"] = measure(f"(a) Sandbox (contained={sb.contained})", lambda: sb.run(SYMPY_BLOCK).output,
                            lambda codes: [r.output for r in sb.run_many(codes)], sb._proc.pid, args.n, args.batch)
    with concurrent.futures.ThreadPoolExecutor(cpus) as pool:
        rows["b"] = measure("(b) fresh python -c per block", lambda: fresh(SYMPY_BLOCK),
                            lambda codes: list(pool.map(fresh, codes)), None, max(5, args.n // 4),
                            max(cpus, args.batch // 3))
    old = old_sandbox_class(args.old)
    if old is None:
        print(f"(c) fork server of {args.old}: not in this checkout's git history, skipped")
    else:
        with old(workers=cpus) as sb:
            rows["c"] = measure(f"(c) fork server of {args.old}", lambda: sb.run(SYMPY_BLOCK).output,
                                lambda codes: [r.output for r in sb.run_many(codes)], sb._proc.pid,
                                args.n, args.batch)
    a, b = rows["a"], rows["b"]
    print(f"fresh / sandbox: latency {b[0] / a[0]:.1f}x, CPU per block {b[1] / a[1]:.1f}x, "
          f"throughput {a[2] / b[2]:.1f}x; sympy block median {a[0] * 1e3:.1f} ms "
          f"(target <= 30 ms: {'met' if a[0] <= 0.030 else 'NOT met'})")


if __name__ == "__main__":
    main()
