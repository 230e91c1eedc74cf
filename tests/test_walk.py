"""The README's walk figures are the walk's (tests/benchmarks/walk.py): a change to a walked
definition that leaves the README's numbers stale fails here. And the style guide's line
length holds for every Python file of the project (tests/faults.md T4)."""
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_readme_quotes_the_walk():
    out = subprocess.run([sys.executable, os.path.join(HERE, "benchmarks", "walk.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_python_line_is_at_most_120_characters():
    root = os.path.dirname(HERE)
    files = [f for pattern in ("*.py", "data/*.py", "tests/*.py", "tests/benchmarks/*.py")
             for f in sorted(glob.glob(os.path.join(root, pattern)))]
    assert len(files) > 20  # the five stage files, data's scripts, the tests and benchmarks
    long = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        long += [f"{os.path.relpath(f, root)}:{n}: {len(line)}" for n, line in enumerate(lines, 1) if len(line) > 120]
    assert long == []
