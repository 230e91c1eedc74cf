"""evaluate.py metrics on hand-made sample records whose right values are worked out by
hand in the comments (samples with no code, with all blocks failing, with no answer,
truncated by length)."""
import json
import math

import pytest

import evaluate as ev

OK, ERR, TIMEOUT, MEM = "ok", "error", "timeout", "memory"


def block(code="print(1)", output="1\n", status=OK):
    return {"code": code, "output": output, "status": status}


def rec(id, idx, correct, pred, blocks=(), completion="", finish="stop", model_tokens=10,
        plan_tokens=1, completion_tokens=None, bench="toy", answer="70"):
    blocks = list(blocks)
    return {"id": id, "problem": "q", "answer": answer, "sample_idx": idx, "benchmark": bench,
            "pred": pred, "correct": correct, "finish_reason": finish, "completion": completion,
            "blocks": blocks, "n_code_blocks": len(blocks),
            "n_exec_errors": sum(b["status"] != OK for b in blocks),
            "model_tokens": model_tokens, "plan_tokens": plan_tokens,
            "completion_tokens": model_tokens if completion_tokens is None else completion_tokens}


# A toy benchmark: 2 problems x 2 samples.
#   p1/0: plan, two ok blocks (4 + 2 code lines) printing 70, answers 70: correct
#   p1/1: no code at all, answers 71: wrong
#   p2/0: two blocks, both failing (error, timeout; 1 + 2 lines), prose "Both failed, so
#         by hand" (5 words), answers 0.5 for gold 1/2: correct
#   p2/1: one ok block (1 line) printing 0.5, truncated by length with no answer
P1_0 = ("Enumerate pairs.\n```python\ns = set()\nfor a in range(3):\n\n    s.add(a)\nprint(70)\n```\n"
        "```output\n70\n```\n```python\n# check\nprint(70)\n```\n```output\n70\n```\n\\boxed{70}")
P2_0 = ("Divide.\n```python\nprint(1/0)\n```\n```output\nTraceback (most recent call last):\n"
        "  File \"<string>\", line 1\nZeroDivisionError: division by zero\n```\n"
        "```python\nwhile True:\n    pass\n```\n```output\ntimed out after 5 s\n```\n"
        "Both failed, so by hand\n\\boxed{0.5}")
P2_1 = ("Half.\n```python\nprint(1/2)\n```\n```output\n0.5\n```\n"
        "Now let me think about whether")


def toy_records(bench="toy"):
    return [
        rec("p1", 0, True, "70", [block("s = set()\nfor a in range(3):\n\n    s.add(a)\nprint(70)", "70\n"),
                                  block("# check\nprint(70)", "70\n")],
            P1_0, model_tokens=100, plan_tokens=10, completion_tokens=130, bench=bench),
        rec("p1", 1, False, "71", [], "I think \\boxed{71}", model_tokens=20, plan_tokens=20,
            bench=bench),
        rec("p2", 0, True, "0.5", [block("print(1/0)", "Traceback (most recent call last):\n"
                                         "  File \"<string>\", line 1\nZeroDivisionError: "
                                         "division by zero\n", ERR),
                                   block("while True:\n    pass", "timed out after 5 s\n", TIMEOUT)],
            P2_0, model_tokens=50, plan_tokens=5, completion_tokens=80, bench=bench,
            answer="\\frac{1}{2}"),
        rec("p2", 1, False, None, [block("print(1/2)", "0.5\n")], P2_1, finish="length",
            model_tokens=200, plan_tokens=0, completion_tokens=250, bench=bench,
            answer="\\frac{1}{2}"),
    ]


# --- pass@k -----------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_pass_at_k_hand_values():
    assert ev.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(0.5)       # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert ev.pass_at_k(5, 2, 2) == pytest.approx(0.7)       # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert ev.pass_at_k(4, 0, 3) == 0.0
    assert ev.pass_at_k(4, 4, 1) == 1.0
    assert ev.pass_at_k(4, 2, 4) == 1.0                      # n - c < k


@pytest.mark.timeout(10)
def test_pass_at_k_matches_binomial_formula():
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert ev.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert ev.pass_at_k(1000, 3, 500) == pytest.approx(1 - math.comb(997, 500) / math.comb(1000, 500))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        ev.pass_at_k(n, c, k)


@pytest.mark.timeout(10)
def test_mean_pass_at_k():
    rs = toy_records()
    assert ev.mean_pass_at_k(rs, 1) == pytest.approx(0.5)    # (1/2 + 1/2) / 2
    assert ev.mean_pass_at_k(rs, 2) == pytest.approx(1.0)    # each problem has a correct sample
    with pytest.raises(ValueError):
        ev.mean_pass_at_k(rs, 3)


# --- avg@k --------------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_avg_at_k_mean_and_std_over_runs():
    # run 0: [T, T, F] -> 2/3; run 1: [T, F, F] -> 1/3; mean 1/2; population std 1/6
    rs = [rec("a", 0, True, "1"), rec("b", 0, True, "1"), rec("c", 0, False, "1"),
          rec("a", 1, True, "1"), rec("b", 1, False, "1"), rec("c", 1, False, "1")]
    mean, std = ev.avg_at_k(rs)
    assert mean == pytest.approx(0.5)
    assert std == pytest.approx(1 / 6)
    mean, std = ev.avg_at_k(toy_records())                   # runs 1.0 and 0.0
    assert (mean, std) == (pytest.approx(0.5), pytest.approx(0.5))
    with pytest.raises(ValueError):
        ev.avg_at_k([])


# --- maj@k --------------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_maj_at_k_votes_ties_and_no_answers():
    rs = [
        # tie 2-2 between 5 (first vote at idx 0) and 7: 5 wins, and is correct
        rec("tie", 0, True, "5"), rec("tie", 1, False, "7"), rec("tie", 2, False, "7"),
        rec("tie", 3, True, "5"),
        # None does not vote: 7 has 2 votes against 5's 1 -> 7, wrong
        rec("none", 0, False, None), rec("none", 1, False, "7"), rec("none", 2, False, "7"),
        rec("none", 3, True, "5"),
        # no answer at all -> wrong
        rec("empty", 0, False, None), rec("empty", 1, False, None),
        # normalised votes: 70.0, 70 and \text{70} are one answer (3 votes) against 71
        rec("norm", 0, False, "71"), rec("norm", 1, True, "70.0"), rec("norm", 2, True, "70"),
        rec("norm", 3, True, "\\text{70}"),
    ]
    assert ev.maj_at_k(rs) == pytest.approx(2 / 4)           # tie, norm right; none, empty wrong
    assert ev.majority_answer([r for r in rs if r["id"] == "tie"])["pred"] == "5"
    assert ev.majority_answer([r for r in rs if r["id"] == "empty"]) is None
    # k = 2: tie -> 5 (idx 0) vs 7 (idx 1) tie -> 5 right; none -> 7 wrong; empty wrong;
    # norm -> 71 (idx 0) vs 70.0 (idx 1) tie -> 71 wrong
    assert ev.maj_at_k(rs, k=2) == pytest.approx(1 / 4)
    assert ev.maj_at_k(toy_records()) == pytest.approx(1.0)  # p1: 70 beats 71 on the tie


@pytest.mark.timeout(10)
def test_maj_at_k_uses_the_given_equivalence():
    rs = [rec("x", 0, False, "A"), rec("x", 1, True, "b"), rec("x", 2, True, "B")]
    assert ev.maj_at_k(rs, equal=lambda a, b: False) == 0.0          # A, b, B: three 1-vote answers
    assert ev.maj_at_k(rs, equal=lambda a, b: a.lower() == b.lower()) == 1.0   # b, B together


@pytest.mark.timeout(60)
def test_maj_at_k_groups_votes_as_the_grader_does():
    """70.0 and 70 are both right for gold 70: one answer with 2 votes, tied
    with 5's 2 votes; the tie goes to the earliest first vote (tests/faults.md A9; before, grouped by
    normalised string, 5 won with 2 votes against 1 + 1 and maj@4 was 0)."""
    first = [rec("p", 0, True, "70.0"), rec("p", 1, True, "70"),
             rec("p", 2, False, "5"), rec("p", 3, False, "5")]
    assert ev.maj_at_k(first, k=4) == 1.0
    assert ev.majority_answer(first)["pred"] == "70.0"   # the group's first vote
    later = [rec("q", 0, False, "5"), rec("q", 1, True, "70.0"),
             rec("q", 2, True, "70"), rec("q", 3, False, "5")]
    assert ev.maj_at_k(later, k=4) == 0.0                            # 5 voted first
    half = "\\frac{1}{2}"                                           # non-integer: Math-Verify's equivalence
    halves = [rec("h", 0, False, "0.3", answer=half), rec("h", 1, True, "0.5", answer=half),
              rec("h", 2, True, half, answer=half), rec("h", 3, True, "\\frac{2}{4}", answer=half)]
    assert ev.maj_at_k(halves) == 1.0                                # 3 votes against 0.3's 1


# --- code grounding ---------------------------------------------------------------------------

@pytest.mark.timeout(10)
@pytest.mark.parametrize("pred,output,hit", [
    ("70", "answer = 70\n", True),
    ("70", "170\n", False),
    ("70", "x70 = 3\n", False),
    ("70", "1.70\n", False),
    ("70", "70.5\n", False),
    ("70", "70.0\n", True),
    ("70", "The count is 70.\n", True),
    ("70", "[68, 69, 70]\n", True),
    ("70", "-70\n", False),
    ("-70", "-70\n", True),
    ("1000", "1,000\n", True),
    ("1000", "[1,000]\n", True),
    ("70", "140/2\n", True),
    ("004", "4\n", True),
    ("\\frac{1}{2}", "0.5\n", True),
    ("\\frac{1}{2}", "1/2\n", True),
    ("\\frac{1}{2}", "1/20\n", False),
    ("\\frac{\\sqrt{3}}{2}", "sqrt(3)/2\n", True),
    ("\\frac{\\sqrt{3}}{2}", "3*sqrt(3)/2\n", False),
    ("\\frac{1+\\sqrt{5}}{2}", "(1 + sqrt(5))/2\n", True),
    ("2\\pi", "2*pi\n", True),
    ("(1,2)", "(1, 2)\n", True),
    ("x^2+1", "x**2 + 1\n", True),
    ("\\text{Evelyn}", "winner: Evelyn\n", True),
    # A18: Python's error text is not output; what a block printed before it is
    ("2", 'Traceback (most recent call last):\n  File "<code>", line 2, in <module>\nNameError: x\n', False),
    ("3", '  File "<code>", line 3\n    x = = 2\n        ^\nSyntaxError: invalid syntax\n', False),
    ("12", '12\nTraceback (most recent call last):\n  File "<code>", line 5, in <module>\nKeyError: 7\n', True),
    ("7", '12\nTraceback (most recent call last):\n  File "<code>", line 5, in <module>\nKeyError: 7\n', False),
])
def test_answer_in_output(pred, output, hit):
    assert ev.answer_in_output(pred, [output]) is hit


@pytest.mark.timeout(10)
def test_code_grounded_rate():
    # p1/0 "70" printed -> yes; p1/1 "71" no blocks -> no; p2/0 "0.5" only a traceback
    # (whose "line 1" is not 0.5) and a timeout -> no; p2/1 has no answer: not counted
    rate, count = ev.code_grounded_rate(toy_records())
    assert (rate, count) == (pytest.approx(1 / 3), 3)
    assert ev.code_grounded_rate([rec("a", 0, False, None)]) == (None, 0)


# --- Recovery@k ---------------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_recovery_at_k():
    rs = [
        rec("A", 0, True, "1", [block(status=ERR), block(status=ERR), block()]),
        rec("B", 0, False, "1", [block(status=TIMEOUT)]),
        rec("C", 0, True, "1", [block(), block(status=ERR)]),
        rec("D", 0, False, "1", []),                         # no code: never counted
        rec("E", 0, False, None, [block(status=ERR), block(status=MEM)] + [block(status=ERR)] * 3),
    ]
    assert ev.recovery_at_k(rs, 1) == (pytest.approx(1 / 3), 3)   # A, B, E
    assert ev.recovery_at_k(rs, 2) == (pytest.approx(1 / 2), 2)   # A, E
    assert ev.recovery_at_k(rs, 3) == (0.0, 1)                    # E (A's third block ran)
    assert ev.recovery_at_k(rs, 5) == (0.0, 1)
    assert ev.recovery_at_k(rs, 6) == (None, 0)


# --- Per-trajectory diagnostics ------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_prose_after_plan():
    text = ("Plan: enumerate.\n```python\nprint(70)\n```\n```output\n70\n```\n"
            "Hmm wait, let me check.\n```python\nprint(70)\n```\n```output\n70\n```\n"
            "So the answer is\n\\boxed{70}")
    assert ev.prose_after_plan(text) == "Hmm wait, let me check.\nSo the answer is"
    assert len(ev.prose_after_plan(text).split()) == 9
    assert ev.prose_after_plan("Just text \\boxed{5}") == ""          # no code: all plan
    assert ev.prose_after_plan(P1_0) == ""
    assert ev.prose_after_plan(P2_0) == "Both failed, so by hand"
    assert ev.prose_after_plan(P2_1) == "Now let me think about whether"


@pytest.mark.timeout(10)
def test_trajectory_stats_by_hand():
    s = ev.trajectory_stats(toy_records())
    assert s["code_lines"] == pytest.approx((6 + 0 + 3 + 1) / 4)
    assert s["code_blocks"] == pytest.approx((2 + 0 + 2 + 1) / 4)
    assert s["tool_calls"] == pytest.approx(5 / 4)
    assert s["exec_errors"] == pytest.approx(2 / 4)
    assert s["model_tokens"] == pytest.approx((100 + 20 + 50 + 200) / 4)
    assert s["completion_tokens"] == pytest.approx((130 + 20 + 80 + 250) / 4)
    assert s["plan_tokens"] == pytest.approx((10 + 20 + 5 + 0) / 4)
    assert s["plan_share"] == pytest.approx((0.1 + 1.0 + 0.1 + 0.0) / 4)
    assert s["prose_words_after_plan"] == pytest.approx((0 + 0 + 5 + 6) / 4)
    assert s["prose_after_plan_share"] == pytest.approx(2 / 4)
    assert s["no_code_share"] == pytest.approx(1 / 4)
    assert s["no_answer_share"] == pytest.approx(1 / 4)
    assert s["finish_reasons"] == {"length": pytest.approx(0.25), "stop": pytest.approx(0.75)}


# --- summarize, tables, files ---------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_summarize_per_benchmark():
    rs = toy_records("b1") + [r for r in toy_records("b2") if r["id"] == "p1"]
    m = ev.summarize(rs)
    assert list(m) == ["b1", "b2"]
    b1 = m["b1"]
    assert (b1["n_problems"], b1["n_samples"], b1["k"], b1["k_max"]) == (2, 4, 2, 2)
    assert b1["avg_at_k"] == pytest.approx(0.5) and b1["avg_at_k_std"] == pytest.approx(0.5)
    assert b1["pass_at_k"] == {"1": pytest.approx(0.5), "2": pytest.approx(1.0)}
    assert b1["maj_at_k"] == pytest.approx(1.0)
    assert b1["code_grounded"] == {"rate": pytest.approx(1 / 3), "count": 3}
    assert b1["recovery"]["1"] == {"value": 1.0, "count": 1}          # p2/0 only
    assert b1["recovery"]["2"] == {"value": 1.0, "count": 1}
    assert b1["recovery"]["3"] == {"value": None, "count": 0}
    assert b1["tool_calls"] == pytest.approx(5 / 4)
    b2 = m["b2"]                                                       # p1 alone
    assert (b2["n_problems"], b2["avg_at_k"], b2["avg_at_k_std"]) == (1, 0.5, 0.5)
    json.dumps(m)                                                      # JSON-serialisable
    with pytest.raises(ValueError):
        ev.summarize([])


@pytest.mark.timeout(10)
def test_markdown_table():
    m = ev.summarize(toy_records("b1") + toy_records("b2"))
    table = ev.markdown_table(m)
    lines = table.splitlines()
    assert lines[0].startswith("| benchmark | problems | k | avg@k")
    assert "| b1 | 2 | 2 | 50.0 ± 50.0 | 100.0 | 100.0 (k=2) |" in lines
    assert "| mean | | | 50.0 | | |" in lines
    diag = [ln for ln in lines if ln.startswith("| b1 | 1.2")]
    assert diag and "| 33.3 |" in diag[0] and "| 100.0 (1) | 100.0 (1) | - (0) |" in diag[0]
    assert diag[0].endswith("| 75.0 / 25.0 / 0.0 |")
    widths = {ln.count("|") for ln in lines if ln.startswith("|")}
    assert len(widths) == 2                                            # two well-formed tables


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


@pytest.mark.timeout(10)
def test_load_samples_errors_name_file_and_line(tmp_path):
    rows = toy_records()
    p = tmp_path / "samples.jsonl"
    _write(p, rows, tail='{"id": "torn", "sam')                       # killed mid-write
    assert ev.load_samples(str(p), torn_tail_ok=True) == rows         # a rank's appended file
    with pytest.raises(ValueError, match=r"samples.jsonl:%d: not valid JSON" % (len(rows) + 1)):
        ev.load_samples(str(p))                                       # samples.jsonl is atomic
    for field, value in (("correct", "false"), ("sample_idx", "1"), ("sample_idx", True), ("model_tokens", 1.5)):
        _write(p, [rows[0], dict(rows[1], **{field: value})])
        with pytest.raises(ValueError, match=rf"samples.jsonl:2: field '{field}' must be"):
            ev.load_samples(str(p))
    _write(p, rows[:1], tail="not json\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match=r"samples.jsonl:2: not valid JSON"):
        ev.load_samples(str(p))
    bad = dict(rows[1])
    del bad["correct"]
    _write(p, [rows[0], bad])
    with pytest.raises(ValueError, match=r"samples.jsonl:2: missing field\(s\) correct"):
        ev.load_samples(str(p))
    _write(p, [rows[0], rows[1], rows[0]])
    with pytest.raises(ValueError, match=r"samples.jsonl:3: duplicate of line 1"):
        ev.load_samples(str(p))
    with pytest.raises(FileNotFoundError):
        ev.load_samples(str(tmp_path / "missing.jsonl"))


@pytest.mark.timeout(30)
def test_from_samples_cli(tmp_path, capsys):
    rows = toy_records("b1") + toy_records("b2")
    _write(tmp_path / "samples.jsonl", rows)
    ev.main(["--from-samples", str(tmp_path)])
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["benchmarks"] == json.loads(json.dumps(ev.summarize(rows)))
    assert saved["args"] == {"from_samples": str(tmp_path)}
    table = (tmp_path / "metrics.md").read_text()
    assert table == ev.markdown_table(ev.summarize(rows))
    assert table.strip() in capsys.readouterr().out


def test_the_budget_warning_names_every_budget_flag(tmp_path, capsys):
    """Both samples of a benchmark ended on --max-new-tokens ('length'): the warning named
    only --max-context and --max-tool-calls, never the flag that ended them."""
    row = {"id": "p1", "problem": "q", "benchmark": "b", "answer": "6", "pred": None, "correct": False,
           "sample_idx": 0, "finish_reason": "length", "completion": "", "blocks": [], "n_code_blocks": 0,
           "n_exec_errors": 0, "completion_tokens": 8, "model_tokens": 8, "plan_tokens": 0}
    rows = [row, dict(row, id="p2")]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ev.write_report(str(tmp_path), {})
    assert capsys.readouterr().err == ("WARNING: b: 100% of samples ended on a budget (length 100%, tool_budget 0%): "
                                       "raise --max-new-tokens / --max-context / --max-tool-calls\n")
