"""Count the code lines of one GRPO step as a reader walks it (tests/benchmarks/walk.list).

    python tests/benchmarks/walk.py [--list]

A definition's code lines are its lines (decorators included) less docstring lines (of it and
of every def / class inside it), comment-only lines and blank lines. Three totals:
  full              every definition of the list, the sandbox's internals included;
  to Sandbox.run    the sandbox (marked S in the list) read as its interface, not entered;
  to the line       also not entered: what lies below executor.py's "# Internals" line (the
                    KV-cache slab, file and progress helpers), read by name and docstring.
--list prints each definition with its counts first.
"""
import ast
import io
import os
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
        sources.setdefault(name, read_source(name))
        tree, lines, comments, mark = sources[name]
        node = find(tree, qualname)
        span = range(min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno + 1)
        docs = docstring_lines(node)
        code = sum(i not in docs and i not in comments and bool(lines[i - 1].strip()) for i in span)
        below = mark is not None and node.lineno > mark
        rows.append((name, node.lineno, qualname, code, sandbox == "S", below))
    return rows


WAYS = {"full": lambda r: True, "to Sandbox.run": lambda r: not r[4], "to the line": lambda r: not r[4] and not r[5]}


def main():
    rows = walk()
    if "--list" in sys.argv:
        for name, line, qualname, code, sandbox, below in rows:
            where = " (sandbox)" if sandbox else " (below the line)" if below else ""
            print(f"{name}:{line} {qualname} {code}{where}")
    for title, keep in WAYS.items():
        kept = [r for r in rows if keep(r)]
        changes = sum(a[0] != b[0] for a, b in zip(kept, kept[1:]))
        print(f"{title:15s} {len(kept):3d} definitions {sum(r[3] for r in kept):5,d} code lines "
              f"({changes} changes of file)")


if __name__ == "__main__":
    main()
