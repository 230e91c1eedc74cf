"""The README's walk figures are the walk's (tests/benchmarks/walk.py): a change to a walked
definition that leaves the README's numbers stale fails here."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_readme_quotes_the_walk():
    out = subprocess.run([sys.executable, os.path.join(HERE, "benchmarks", "walk.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
