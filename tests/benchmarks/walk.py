"""Count the code lines of one GRPO step as a reader walks it (tests/benchmarks/walk.list).

    python tests/benchmarks/walk.py [--list] [--check]

A definition's code lines are its lines (decorators included) less docstring lines (of it and
of every def / class inside it), comment-only lines and blank lines. Three totals:
  full              every definition of the list, the sandbox's internals included;
  to Sandbox.run    the sandbox (marked S in the list) read as its interface, not entered;
  to the line       also not entered: what lies below executor.py's "# Internals" line (the
                    grouped attention, file and progress helpers), read by name and docstring.
--list prints each definition with its counts first. The README quotes two of the totals, read
from two phrases (the marker: keep them when the README is rewritten):
  "one step is N definitions and M code lines"          to the line
  "the internals too, N and M"                           full
Every run prints where they differ from the counts; --check then exits 1 (tests/test_walk.py).
"""
import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "# Internals: below this line"


def read_source(name):
    """(tree, lines, set of comment-only line numbers, the marked line or None) of a file."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][:tok.start[1]].strip()}
    mark = next((i + 1 for i, line in enumerate(lines) if line.startswith(MARK)), None)
    return ast.parse(text), lines, comments, mark


def find(tree, qualname):
    """The one def / class node named `qualname` (Class.method for a method)."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            named = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            path = prefix + [child.name] if named else prefix
            if named and ".".join(path) == qualname:
                found.append(child)
            visit(child, path)

    visit(tree, [])
    if len(found) != 1:
        sys.exit(f"walk.list: {qualname} matches {len(found)} definitions")
    return found[0]


def docstring_lines(node) -> set:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(n) is not None:
            out.update(range(n.body[0].lineno, n.body[0].end_lineno + 1))
    return out


def walk() -> list:
    """The walk's rows: (file, line, qualname, code lines, in the sandbox, below the line)."""
    sources, rows = {}, []
    with open(os.path.join(ROOT, "tests", "benchmarks", "walk.list"), encoding="utf-8") as f:
        entries = [line.split(None, 3) for line in f if line.strip() and not line.startswith("#")]
    for name, qualname, sandbox, _ in entries:
        if name not in sources:  # (setdefault would read and tokenize the file again for every entry)
            sources[name] = read_source(name)
        tree, lines, comments, mark = sources[name]
        node = find(tree, qualname)
        span = range(min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno + 1)
        docs = docstring_lines(node)
        code = sum(i not in docs and i not in comments and bool(lines[i - 1].strip()) for i in span)
        below = mark is not None and node.lineno > mark
        rows.append((name, node.lineno, qualname, code, sandbox == "S", below))
    return rows


# the README's phrases that quote the walk: total -> pattern (definitions, code lines)
README_FIGURES = {"to the line": r"one step is (\d+) definitions and ([\d,]+) code lines",
                  "full": r"the internals too, (\d+) and ([\d,]+)"}


def readme_mismatches(totals: dict) -> list:
    """Lines naming each README figure that differs from `totals` (title -> (definitions, code
    lines)) or that the README lacks."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())  # (a phrase may be wrapped over lines)
    out = []
    for title, pattern in README_FIGURES.items():
        found = re.findall(pattern, text)
        quoted = [(int(n), int(m.replace(",", ""))) for n, m in found]
        if quoted != [totals[title]]:
            out.append(f"README.md quotes the walk {title} as {quoted or 'nothing'} "
                       f"(phrase {pattern!r}); walk.py counts {totals[title][0]} definitions, "
                       f"{totals[title][1]:,} lines")
    return out


WAYS = {"full": lambda r: True, "to Sandbox.run": lambda r: not r[4], "to the line": lambda r: not r[4] and not r[5]}


def main():
    rows = walk()
    if "--list" in sys.argv:
        for name, line, qualname, code, sandbox, below in rows:
            where = " (sandbox)" if sandbox else " (below the line)" if below else ""
            print(f"{name}:{line} {qualname} {code}{where}")
    totals = {}
    for title, keep in WAYS.items():
        kept = [r for r in rows if keep(r)]
        changes = sum(a[0] != b[0] for a, b in zip(kept, kept[1:]))
        totals[title] = (len(kept), sum(r[3] for r in kept))
        print(f"{title:15s} {len(kept):3d} definitions {totals[title][1]:5,d} code lines ({changes} changes of file)")
    stale = readme_mismatches(totals)
    for line in stale:
        print(line)
    if stale and "--check" in sys.argv:
        sys.exit(1)


if __name__ == "__main__":
    main()
