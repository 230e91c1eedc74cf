"""The problem sets in data/: the demo set and the "Does it learn?" sets, every answer
recomputed here by code; and the scripts beside them (compare.py, permuted_reward.py,
recipe.sh), their figures computed by hand."""
import argparse
import gzip
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import sympy

import executor as ex

ANSWERS = {
    "demo-01": lambda: sum(n for n in range(1, 200) if n % 7 == 0),
    "demo-02": lambda: sympy.divisor_count(3600),
    "demo-03": lambda: 3**100 % 13,
    "demo-04": lambda: len([n for n in range(1, 501) if (n % 3 == 0 or n % 7 == 0) and n % 5 != 0]),
    "demo-05": lambda: sum(int(c) for c in str(2**50)),
    "demo-06": lambda: len(sympy.divisors(720)),
    "demo-07": lambda: max(sympy.factorint(9991)),
    "demo-08": lambda: sum(1 for d in itertools.product(range(10), repeat=4) if d[0] and sum(d) == 10),
    "demo-09": lambda: 12 * 11 * 10 // 6,
    "demo-10": lambda: min(n for n in range(1, 50) if math.factorial(n) % 1000 == 0),
    "demo-11": lambda: sum(n for n in range(1, 101) if pow(n, 2, 5) == 4),
    "demo-12": lambda: len([(x, y) for x in range(-6, 7) for y in range(-6, 7) if x * x + y * y <= 25]),
    "demo-13": lambda: sympy.fibonacci(20),
    "demo-14": lambda: 2**math.gcd(24, 18) - 1,
    "demo-15": lambda: sum(1 for m in range(1 << 10) if sum(i + 1 for i in range(10) if m >> i & 1) % 5 == 0),
    "demo-16": lambda: sum(r**2 for r in sympy.solve(sympy.Symbol("x")**2 - 7 * sympy.Symbol("x") + 3)).expand(),
}


@pytest.mark.timeout(60)
def test_demo_answers_are_what_code_computes():
    rows = ex.read_problems(f"{__file__.rsplit('/tests/', 1)[0]}/data/demo_problems.jsonl")
    assert [r["id"] for r in rows] == sorted(ANSWERS)
    for r in rows:
        assert r["answer"] == str(int(ANSWERS[r["id"]]())), r["id"]


# data/make_exact.py: the "Does it learn?" problems, each answer recomputed
# another way than the generator's (sympy, or Python written differently).
ROOT = __file__.rsplit("/tests/", 1)[0]
sys.path.insert(0, f"{ROOT}/data")
import make_exact  # noqa: E402


def long_product(a: str, b: str) -> int:
    """a * b by schoolbook multiplication, one digit of b at a time."""
    return sum(int(a) * int(d) * 10**i for i, d in enumerate(reversed(b)))


def digit_sum(n: int) -> int:
    """The sum of n's decimal digits, by repeated division."""
    total = 0
    while n:
        n, d = divmod(n, 10)
        total += d
    return total


PATTERNS = [
    (r"What is (\d+) \\times (\d+)\?", long_product),
    (r"What is the remainder when \$(\d+)\^\{(\d+)\}\$ is divided by (\d+)\?",
     lambda a, e, m: int(a) ** int(e) % int(m)),
    (r"What is the sum of the digits of \$2\^\{(\d+)\}\$\?", lambda n: digit_sum(1 << int(n))),
    (r"What is the sum of all prime numbers less than (\d+)\?", lambda n: sum(sympy.primerange(2, int(n)))),
    (r"How many positive divisors does (\d+) have\?", lambda n: sympy.divisor_count(int(n))),
    (r"How many integers from 1 to (\d+) are divisible by (\d+) or (\d+) but not by (\d+)\?",
     lambda n, a, b, c: len((set(range(int(a), int(n) + 1, int(a))) | set(range(int(b), int(n) + 1, int(b))))
                           - set(range(int(c), int(n) + 1, int(c))))),
]


def recompute(problem: str) -> int:
    for pattern, answer in PATTERNS:
        m = re.fullmatch(pattern, problem)
        if m:
            return int(answer(*m.groups()))
    raise AssertionError(f"no family matches {problem!r}")


def read_jsonl(name: str) -> list[dict]:
    return [row for _, row in ex.read_jsonl(f"{ROOT}/data/{name}")]


@pytest.mark.timeout(120)
def test_exact_problems_in_the_repo_answers_recomputed_and_held_out_disjoint():
    train, test = read_jsonl("exact_train.jsonl"), read_jsonl("exact_test.jsonl")
    assert (len(train), len(test)) == (400, 100)
    for r in train + test:
        assert r["answer"] == str(recompute(r["problem"])), r["problem"]
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}


def test_exact_problems_files_in_the_repo_are_what_the_script_writes():
    train = read_jsonl("exact_train.jsonl")
    assert train == make_exact.make(1, 400, set())
    assert read_jsonl("exact_test.jsonl") == make_exact.make(2, 100, {r["problem"] for r in train})


@pytest.mark.timeout(30)
def test_exact_problems_beyond_what_the_families_hold_are_refused():
    """The digit sum of 2^n has 161 problems (n in 40..200), so 6 x 161 + 2 = 968 rows is the
    most: more is refused (before, make() drew forever)."""
    with pytest.raises(ValueError, match="only 968 of 1000 distinct problems after 100000 draws"):
        make_exact.make(1, 1000, set())


def inclusion_exclusion_triples(rows: list) -> list:
    """(a, b, c) of every "divisible by a or b but not by c" problem in rows."""
    matches = [re.fullmatch(PATTERNS[5][0], r["problem"]) for r in rows]
    return [tuple(int(x) for x in m.groups()[1:]) for m in matches if m]


def degenerate(a: int, b: int, c: int) -> bool:
    """Two of a, b, c equal, or one divides another (written apart from make_exact's test)."""
    return len({a, b, c}) < 3 or any(x % y == 0 for x in (a, b, c) for y in (a, b, c) if x != y)


@pytest.mark.timeout(60)
def test_inclusion_exclusion_triples_are_distinct_and_none_divides_another():
    """tests/faults.md P1. Before, make_exact drew a, b, c independently: 40 of the 66 training
    and 12 of the 16 held-out problems had two equal ("by 8 or 12 but not by 8") or one
    dividing another."""
    train = read_jsonl("exact_train.jsonl")
    drawn = make_exact.make(3, 600, set())
    for rows, n in ((train, 66), (read_jsonl("exact_test.jsonl"), 16), (drawn, 100)):
        triples = inclusion_exclusion_triples(rows)
        assert len(triples) == n and not [t for t in triples if degenerate(*t)], triples


@pytest.mark.timeout(60)
def test_inclusion_exclusion_redraw_leaves_the_other_families_as_they_were(monkeypatch):
    """A degenerate triple is redrawn from its own RNG, so only those problems changed when the
    files were regenerated: with the check off (the old generator), the rows differ exactly
    at the 40 degenerate draws of seed 1."""
    new = make_exact.make(1, 400, set())
    monkeypatch.setattr(make_exact, "proper_triple", lambda a, b, c: True)
    old = make_exact.make(1, 400, set())
    changed = [i for i, (x, y) in enumerate(zip(old, new)) if x != y]
    assert len(changed) == 40 and all(i % 6 == 5 for i in changed)
    assert [degenerate(*t) for t in inclusion_exclusion_triples([old[i] for i in changed])] == [True] * 40
    assert sum(degenerate(*t) for t in inclusion_exclusion_triples(old)) == 40


def test_proper_triple_by_hand():
    assert make_exact.proper_triple(2, 3, 5) and make_exact.proper_triple(4, 6, 9)
    assert make_exact.proper_triple(6, 4, 9)  # 4 and 6 share a factor but neither divides the other
    assert not make_exact.proper_triple(8, 12, 8)  # c = a
    assert not make_exact.proper_triple(2, 2, 3)  # a = b
    assert not make_exact.proper_triple(2, 4, 3)  # 2 | 4
    assert not make_exact.proper_triple(3, 5, 9)  # 3 | 9


def test_exact_helpers_by_hand():
    assert long_product("1234", "5678") == 7006652 and digit_sum(2**15) == 3 + 2 + 7 + 6 + 8
    assert make_exact.primes_below(20) == [2, 3, 5, 7, 11, 13, 17, 19]
    assert make_exact.primes_below(2) == []
    assert [make_exact.divisor_count(n) for n in (1, 12, 36, 97)] == [1, 6, 9, 2]


def sample_row(problem_id: str, problem: str, sample_idx: int, correct: bool, **fields) -> dict:
    """A row as evaluate.py writes it (the fields evaluate.load_samples checks), `fields` replaced."""
    return {"id": problem_id, "problem": problem, "benchmark": "b", "answer": "6", "pred": "6", "correct": correct,
            "sample_idx": sample_idx, "finish_reason": "stop", "completion": "", "blocks": [], "n_code_blocks": 0,
            "n_exec_errors": 0, "completion_tokens": 1, "model_tokens": 1, "plan_tokens": 0} | fields


def test_compare_pairs_problems_and_bootstraps_the_gain(tmp_path):
    import compare
    import numpy as np

    rows = [sample_row("p1", "What is 2 \\times 3?", 0, True), sample_row("p1", "What is 2 \\times 3?", 1, False),
            sample_row("p2", "What is 4 \\times 5?", 0, True), sample_row("p2", "What is 4 \\times 5?", 1, True)]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compare.per_problem(str(path)) == {("b", "p1"): ("What is 2 \\times 3?", "6", [1.0, 0.0], [1.0, 1.0]),
                                              ("b", "p2"): ("What is 4 \\times 5?", "6", [1.0, 1.0], [1.0, 1.0])}
    before = np.array([0.0, 0.25, 0.5])
    assert compare.paired_bootstrap(before, before + 0.25, 1000, 0) == (0.25, 0.25)  # every resample gains 0.25
    # gains 0, 0, 1: a resample's mean is 0 with probability (2/3)^3 = 0.30 and 1 with
    # (1/3)^3 = 0.037, so both percentiles (2.5 and 97.5) fall on those two values
    assert compare.paired_bootstrap(before, np.array([0.0, 0.25, 1.5]), 1000, 0) == (0.0, 1.0)


def test_compare_bad_input_is_one_line_naming_the_file(tmp_path, capsys):
    import compare

    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(sample_row("p1", "q", 0, True)) + "\n")
    (tmp_path / "other.jsonl").write_text(json.dumps(sample_row("p2", "q", 0, True)) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps(sample_row("p1", "q2", 0, True)) + "\n")
    (tmp_path / "more.jsonl").write_text("".join(json.dumps(sample_row("p1", "q", j, True)) + "\n" for j in (0, 1)))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"id": "p1"}\n')
    cases = [("empty.jsonl", "empty.jsonl: no samples"), ("bad.jsonl", "bad.jsonl:1: missing field(s) benchmark"),
             ("other.jsonl", "hold different problems (1 and 1 ids)"),
             ("text.jsonl", "differ on problem ('b', 'p1'): its text or its number of samples (1 and 1)"),
             ("more.jsonl", "differ on problem ('b', 'p1'): its text or its number of samples (1 and 2)")]
    for name, message in cases:
        assert ex.cli(compare.main, [str(good), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("compare.py: error: ") and message in err and err.count("\n") == 1, err


def test_compare_mcnemar_and_constant_baseline_by_hand():
    import compare

    # b + c = 6 discordant problems split 1 / 5: p = 2 (C(6,0) + C(6,1)) / 2^6 = 14 / 64
    assert compare.mcnemar_exact(1, 5) == compare.mcnemar_exact(5, 1) == 14 / 64
    assert compare.mcnemar_exact(0, 6) == 2 / 64
    assert compare.mcnemar_exact(3, 3) == 1.0  # 2 (1 + 6 + 15 + 20) / 64 > 1, capped
    assert compare.mcnemar_exact(0, 0) == 1.0
    assert compare.constant_baseline(["4", "8", "4", "6"]) == ("4", 0.5)
    assert compare.constant_baseline(["9", "10"]) == ("10", 0.5)  # a tie: the smallest string
    assert compare.constant_baseline([]) == ("", 0.0)
    assert compare.budget_list("384,768") == [384, 768]


def recipe_rows(correct: list, finish: list, tokens: list) -> list:
    """Four problems of two families, one sample each (k = 1)."""
    problems = [("p1", "What is 2 \\times 3?", "6"), ("p2", "What is 4 \\times 5?", "20"),
                ("p3", "How many positive divisors does 6 have?", "4"),
                ("p4", "How many positive divisors does 10 have?", "4")]
    return [sample_row(i, q, 0, c, answer=a, finish_reason=f, model_tokens=t)
            for (i, q, a), c, f, t in zip(problems, correct, finish, tokens)]


@pytest.fixture(autouse=True)
def public_sets(tmp_path_factory, monkeypatch):
    """The public sets data/recipe.sh checks for, as files of this test's own (never ../shared)."""
    d = tmp_path_factory.mktemp("public")
    for name in ("math500_int.jsonl", "gsm8k_test.jsonl"):
        (d / name).write_text('{"id": "q", "problem": "1 + 1?", "answer": "2"}\n')
        monkeypatch.setenv("MATH500" if "math" in name else "GSM8K", str(d / name))


# data/recipe.sh's parts (BUDGET given: no part 1), and the evaluations among them
TRAINED = ["distill", "sft", "grpo", "sft_grpo", "control", "grpo_seed1", "sft_grpo_seed1", "control_group",
           "grpo_seed2", "sft_grpo_seed2"]
EVALS = ([f"{b}_{r}" for b in ("math500", "gsm8k") for r in ("start", "sft_grpo")]
         + [f"heldout_{r}" for r in ("start", "sft", "grpo", "sft_grpo", "control", "start_3shot", "grpo_seed1",
                                     "sft_grpo_seed1", "control_group", "grpo_seed2", "sft_grpo_seed2")]
         + [f"{b}_all_{r}" for b in ("math500", "gsm8k") for r in ("start", "sft_grpo_seed2")])


def mark_done(runs, parts, samples=None):
    """runs/done.txt naming `parts`; each evaluation among them keeps `samples` (rows; default
    recipe_rows of a start model) as its output, which a done part must still have."""
    rows = samples or recipe_rows([True, False, False, False], ["stop", "length", "stop", "length"],
                                  [100, 768, 500, 768])
    for name in set(parts) & set(EVALS):
        (runs / name).mkdir(parents=True, exist_ok=True)
        if not (runs / name / "samples.jsonl").exists():
            (runs / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if "distill" in parts:
        (runs / "distill").mkdir(parents=True, exist_ok=True)
        (runs / "distill" / "traj.jsonl").write_text("{}\n")
    (runs / "done.txt").write_text("".join(p + "\n" for p in parts))


def no_torchrun(tmp_path):
    """A PATH whose `torchrun` says which script it was asked to run, and fails."""
    fake_bin = tmp_path / "nobin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text("#!/bin/sh\necho \"torchrun $3\" >&2\nexit 1\n")
    (fake_bin / "torchrun").chmod(0o755)
    return f"{fake_bin}:{os.environ['PATH']}"


def test_compare_table_gain_mcnemar_families_and_gzip(tmp_path, capsys):
    """tests/faults.md P2, every figure by hand. start: right on p1 only, p2 and p4 cut by the budget; grpo: right
    on p1-p3, p4 cut. Bootstrap over 4 problems: start's mean is 0 in (3/4)^4 = 32% of the
    resamples and >= 0.75 in 13/256 = 5.1%, 1 in 1/256 = 0.4%, so its interval is [0, 75];
    grpo's (scores 1, 1, 1, 0) is [25, 100]; the gains (0, 1, 1, 0) are 0 and 1 in 1/16 each,
    so [+0, +100]. McNemar: b = 2 (p2, p3), c = 0, p = 2 / 4. Tool calls: start none, grpo
    (1 + 2 + 1 + 0) / 4 = 1.00; code-grounded: every sample answers 6, printed by grpo's p1 and p2
    only (2 of 4)."""
    import compare

    start = recipe_rows([True, False, False, False], ["stop", "length", "stop", "length"], [100, 768, 500, 768])
    grpo = recipe_rows([True, True, True, False], ["stop", "stop", "stop", "length"], [90, 80, 70, 768])
    outputs = [["6\n"], ["x", "answer = 6\n"], ["7\n"], []]  # the answer 6 printed in p1 and p2 only
    for row, outs in zip(grpo, outputs):
        row.update(n_code_blocks=len(outs), blocks=[{"status": "ok", "output": o} for o in outs])
    (tmp_path / "start.samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in start))
    with gzip.open(tmp_path / "grpo.samples.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in grpo))
    compare.main(["--families", str(tmp_path / "start.samples.jsonl"), str(tmp_path / "grpo.samples.jsonl.gz")])
    assert capsys.readouterr().out.splitlines() == [
        "4 problems, k = 1; gains are over start", "",
        "| policy | accuracy [95% CI] | among finished | finished | tool calls | code-grounded | "
        "gain [95% paired CI] | McNemar p (b, c) |",
        "|---|---|---|---|---|---|---|---|",
        "| start | 25.0 [4.6, 69.9] | 50.0 (1 of 2) | 50.0 | 0.00 | 0.0 (of 4) | - | - |",
        "| grpo | 75.0 [30.1, 95.4] | 100.0 (3 of 3) | 75.0 | 1.00 | 50.0 (of 4) | +50.0 [+0.0, +100.0] | 0.5 (2, 0) |",
        "",
        "constant answer '4': 50.0% of the 4 problems",
        "the question restated (`echo_answer`): 0.0% of the 4 problems", "",
        "| family | problems | constant answer | start | grpo |", "|---|---|---|---|---|",
        "| How many positive divisors does N have? | 2 | 100.0% (4) | 0 of 2 | 1 of 2 |",
        "| What is N \\times N? | 2 | 50.0% (20) | 1 of 2 | 2 of 2 |"]


def test_compare_budgets_give_the_smallest_whose_double_adds_under_the_gain(tmp_path, capsys):
    """Finished within B: ended by EOS after <= B model tokens. Of 100, 300, 700, 2000 tokens
    (stop, stop, stop, length): 1, 2, 3, 3 of 4 within 200, 400, 800, 1,600. Doubling adds 25
    points at 200 and 400 and 0 at 800: B = 800 by the default 3-point rule, 200 by a 30-point
    one; of 200 and 400 alone, none passes the 3-point rule."""
    import compare

    path = tmp_path / "budget.jsonl"
    rows = recipe_rows([True] * 4, ["stop", "stop", "stop", "length"], [100, 300, 700, 2000])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    compare.main(["--budgets", "400,200,800,1600", str(path)])
    assert capsys.readouterr().out.splitlines() == ["budget 200: 25.0% of 4 samples finished",
                                                    "budget 400: 50.0% of 4 samples finished",
                                                    "budget 800: 75.0% of 4 samples finished",
                                                    "budget 1600: 75.0% of 4 samples finished", "800"]
    compare.main(["--budgets", "400,200,800,1600", "--max-gain", "30", str(path)])
    assert capsys.readouterr().out.splitlines()[-1] == "200"
    assert ex.cli(compare.main, ["--budgets", "200,400", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.endswith("budget.jsonl: no budget of [200, 400] whose double (also listed) finishes "
                        "fewer than 3.0 points more of the samples\n") and err.count("\n") == 1
    assert ex.cli(compare.main, ["--budgets", "1000,4000", str(path)]) == 2  # drawn at 2,000 (the cut sample's)
    assert capsys.readouterr().err.endswith("budget.jsonl: sampled at 2000 model tokens (its samples cut by the "
                                            "budget ran that many): --budgets 4000 is beyond it\n")
    with pytest.raises(SystemExit):
        compare.main(["--budgets", "200,400", str(path), str(path)])  # one file only
    assert "--budgets reads one samples file, got 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main(["--budgets", "200,400", "--max-gain", "-1", str(path)])
    assert "--max-gain must be in (0, 100] points, got -1.0" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"id": "p1"}\n')
    assert ex.cli(compare.main, [str(bad)]) == 2
    assert capsys.readouterr().err == f"compare.py: error: {bad}:1: missing field(s) benchmark, answer, pred, " \
        "correct, sample_idx, finish_reason, completion, blocks, n_code_blocks, n_exec_errors, completion_tokens, " \
        "model_tokens, plan_tokens\n"


def test_wilson_interval_bootstrap_and_sign_flip_by_hand():
    """Wilson's interval by hand: 0 of 100 is [0, z^2 / (100 + z^2)] = [0.0, 3.7]; 1 of 4 is
    [4.6, 69.9]. Per-problem means over two seeds, a: 1, .5, 0, 0 and b: 1, 1, .5, .5:
    differences 0, .5, .5, .5 (mean +37.5); the bootstrap mean of 4 resampled is 0.125 or less
    in 5.1% and 0.5 in 31.6% of draws, so [+12.5, +50.0]; sign flips of the three .5s (2 each
    at the scale 2 x 2) reach |sum| 1.5 in 2 of 8 patterns: p = 0.25. The sign-flip test is
    exact at any count (it sampled 10,000 patterns past 16 nonzero differences and printed
    '<= 1e-4' under that floor): 20 differences of +1 give 2 / 2^20, 16 give 2 / 2^16 = 3.05e-05,
    printed as it is. The seed-level permutation test by hand: seeds 73, 59 against 79, 67 split
    6 ways with |gaps| 7, 13, 1, 1, 13, 7: p = 4/6, at least 2/6; 1, 2, 3 against 4, 5, 6: 2 of
    20 splits reach 3."""
    import compare

    assert [round(100 * x, 1) for x in compare.wilson(0, 100)] == [0.0, 3.7]
    assert [round(100 * x, 1) for x in compare.wilson(1, 4)] == [4.6, 69.9]
    a, b = np.array([1, 0.5, 0, 0]), np.array([1, 1, 0.5, 0.5])
    assert compare.paired_bootstrap(a, b, 10000, 0) == (0.125, 0.5)
    assert compare.sign_flip_p((b - a) * 4) == 0.25
    assert compare.paired_test(a, b, 2, 2) == "0.25 (sign-flip)"
    # +-3 +-1 +-2 (observed 3 - 1 + 2 = 4): sums 6, 2, 4, 0, 0, -4, -2, -6 reach |4| in 4 of 8
    assert compare.sign_flip_p(np.array([3, -1, 0, 2])) == 0.5
    assert compare.sign_flip_p(np.ones(20)) == 2 / 2**20
    assert compare.sign_flip_p(np.zeros(3)) == 1.0  # no difference at all
    with pytest.raises(ValueError, match="integer differences"):
        compare.sign_flip_p(b - a)  # halves would be truncated to 0
    assert compare.paired_test(np.zeros(16), np.ones(16) / 2, 2, 2) == "3.05e-05 (sign-flip)"
    assert compare.paired_test(np.zeros(3), np.ones(3) * 2 / 3, 3, 3) == "0.25 (sign-flip)"  # 6, 6, 6 at 3 x 3
    with pytest.raises(ValueError, match="means over 2 and 2 seeds"):
        compare.paired_test(a, b + 1 / 3, 2, 2)  # thirds are not means over two seeds: rounding hid it
    assert compare.seed_permutation_p([0.73, 0.59], [0.79, 0.67]) == (4 / 6, 2 / 6)
    assert compare.seed_permutation_p([1, 2, 3], [4, 5, 6]) == (0.1, 0.1)


def test_the_echo_floor_is_zero_under_the_strict_rule_A19():
    """compare.echo_answer restates the two families a box of the question answers, and the
    grader pays for neither (the old grader paid for both: 34 of the 100 held-out problems)."""
    import compare

    product, power = "What is 8412 \\times 2500?", "What is the remainder when $4^{142}$ is divided by 101?"
    assert compare.echo_answer(product) == "8412 \\times 2500"
    assert compare.echo_answer(power) == "4^{142} \\mod 101"
    divisors = "How many positive divisors does 360 have?"
    assert compare.echo_answer(divisors) == divisors
    assert not ex.grade(compare.echo_answer(product), "21030000") and not ex.grade(compare.echo_answer(power), "31")


def test_group_permuted_reward_keeps_each_groups_rewards():
    """Two groups of G = 3 as grpo.py passes them (one problem a sample): answer rewards
    1, 0, 0 | 1, 1, 0; the fair control returns each group's own three values, in a seeded
    order, so group 1 keeps one 1 and group 2 two 1s under every seed."""
    import permuted_reward as pr

    samples = [ex.Sample(prompt_ids=[], ids=[], roles=[], logprobs=[], pred=x)
               for x in ("4", "5", None, "10", "10", "3")]
    problems = [{"id": "q1", "answer": "4"}] * 3 + [{"id": "q2", "answer": "10"}] * 3
    orders = [pr.group_permuted_reward(samples, problems, seed=seed) for seed in range(20)]
    assert all(sum(o[:3]) == 1.0 and sum(o[3:]) == 2.0 and len(o) == 6 for o in orders)
    assert orders[0] == pr.group_permuted_reward(samples, problems, seed=0)
    assert len({tuple(o) for o in orders}) > 1   # the order does change
    assert pr.group_permuted_reward(samples, problems[::3]) in orders   # one problem per group: the same groups
    # grpo.py passes --group-size: one problem drawn twice in a step is two groups of 3, not one of 6
    twice = [{"id": "q1", "answer": "4"}] * 6
    split = [pr.group_permuted_reward(samples, twice, args=argparse.Namespace(group_size=3), seed=s) for s in range(20)]
    assert all(sum(o[:3]) == 1.0 and sum(o[3:]) == 0.0 for o in split)   # rewards 1, 0, 0 | 0, 0, 0 against 4


def test_permuted_reward_is_a_seeded_permutation_of_the_answer_rewards():
    """Two problems, G = 3: preds 4, 5, none against 4, then 10, 10, 3 against 10 give answer
    rewards 1, 0, 0, 1, 1, 0; the control returns those six values (three 1s, three 0s) in a
    seeded order: the same for the same seed and problems."""
    import permuted_reward as pr

    samples = [ex.Sample(prompt_ids=[], ids=[], roles=[], logprobs=[], pred=x)
               for x in ("4", "5", None, "10", "10", "3")]
    problems = [{"id": "q1", "answer": "4"}, {"id": "q2", "answer": "10"}]
    assert pr.answer_rewards(samples, problems) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert pr.answer_rewards(samples[:2], [problems[0], problems[0]]) == [1.0, 0.0]  # one problem per sample
    orders = [pr.permuted_reward(samples, problems, seed) for seed in range(10)]
    assert all(sorted(o) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0] for o in orders)
    assert orders[0] == pr.permuted_reward(samples, problems) == pr.permuted_reward(samples, problems, 0)
    assert any(o != [1.0, 0.0, 0.0, 1.0, 1.0, 0.0] for o in orders)  # the order does change
    other_step = [{"id": "q3", "answer": "4"}, {"id": "q4", "answer": "10"}]
    assert sorted(pr.permuted_reward(samples, other_step)) == sorted(orders[0])
    assert pr.permuted_reward(samples[:3], problems[:1]) in ([1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0])


@pytest.mark.timeout(60)
def test_recipe_script_skips_done_parts_and_tables_come_from_the_exported_files(tmp_path):
    """data/recipe.sh with every part marked done (BUDGET given, so no model is needed): it runs
    nothing, gzips each evaluation's samples into OUT_DIR (the same bytes on a rerun: gzip -n)
    and writes tables.md from those files, with the figures of the test above."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    start = recipe_rows([True, False, False, False], ["stop", "length", "stop", "length"], [100, 768, 500, 768])
    grpo = recipe_rows([True, True, True, False], ["stop", "stop", "stop", "length"], [90, 80, 70, 768])
    outputs = [["6\n"], ["x", "answer = 6\n"], ["7\n"], []]  # the answer 6 printed in p1 and p2 only
    for row, outs in zip(grpo, outputs):
        row.update(n_code_blocks=len(outs), blocks=[{"status": "ok", "output": o} for o in outs])
    for name, rows in (("heldout_start", start), ("heldout_grpo", grpo)):
        (runs / name).mkdir(parents=True)
        (runs / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parts = TRAINED + EVALS
    mark_done(runs, parts)
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768", "PATH": no_torchrun(tmp_path)}
    outputs = []
    for _ in range(2):
        run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert run.stdout.count("done before") == len(parts)
        outputs.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert outputs[0] == outputs[1]
    assert sorted(outputs[0]) == sorted([f"{p}.samples.jsonl.gz" for p in EVALS] + ["settings.txt", "tables.md",
                                                                                   "times.tsv"])
    assert (gzip.decompress(outputs[0]["heldout_grpo.samples.jsonl.gz"])
            == (runs / "heldout_grpo/samples.jsonl").read_bytes())
    tables = outputs[0]["tables.md"].decode().splitlines()
    assert tables[0] == "# data/recipe.sh at B = 768 model tokens"
    assert ("| heldout_grpo | 75.0 [30.1, 95.4] | 100.0 (3 of 3) | 75.0 | 1.00 | 50.0 (of 4) | +50.0 [+0.0, +100.0] "
            "| 0.5 (2, 0) |") in tables
    # columns: start, start_3shot, sft, grpo (2 of 2), then the other seven rows, the start model's samples
    assert "| What is N \\times N? | 2 | 50.0% (20) | 1 of 2 | 1 of 2 | 1 of 2 | 2 of 2 |" + " 1 of 2 |" * 7 in tables
    assert "## Held out (data/exact_test.jsonl, k = 1); gains over heldout_start" in tables
    # three files a policy: grpo's per-problem means 1, 1/3, 1/3, 0 (its seed 0 right on p1-p3, the others on p1),
    # sft_grpo's 1, 0, 0, 0: differences 0, -1/3, -1/3, 0; sign flips reach |sum| 2/3 in 2 of 4 patterns. Four
    # problems resampled: a mean of 1/12 or less (four 0s, or three and one 1/3) in 1/256 + 4 / 128 = 3.5% of
    # draws, 5/6 or more (the mirror) in 3.5%: grpo's interval [8.3, 83.3]
    lead = tables.index("## The README's lead: each policy over its seeds, sft_grpo against grpo, the public sets")
    assert "| GRPO from start (no SFT) | 0, 1, 2 | 41.7 [8.3, 83.3]; seeds 0: 75.0, 1: 25.0, 2: 25.0 | " \
        "+16.7 [+0.0, +33.3] | 0.5 (sign-flip) |" in tables[lead:]
    assert "SFT + GRPO against GRPO alone, per-problem accuracy over seeds 0, 1, 2 of each: -16.7 [-33.3, +0.0], " \
        "p = 0.5 (sign-flip)" in tables[lead:]


@pytest.mark.timeout(60)
def test_recipe_script_keeps_each_sft_runs_log(tmp_path):
    """A new machine trains SFT again (a model is not committed): its log is exported under the
    time its part ended, beside the earlier run's, which stays as it was (it was one file,
    sft.log.jsonl, that each run overwrote)."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    (runs / "sft").mkdir(parents=True)
    (runs / "sft" / "log.jsonl").write_text('{"step": 1, "loss": 0.25}\n')
    (runs / "times.tsv").write_text("sft\tend\t2026-12-01T08:00:00Z\t60 s\tabc1234\n"
                                    "sft\tend\t2026-12-02T17:01:02Z\t60 s\tdef5678\n")
    out.mkdir()
    (out / "sft.2026-12-01T08-00-00Z.log.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    mark_done(runs, TRAINED + EVALS)
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768", "PATH": no_torchrun(tmp_path)}
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (out / "sft.2026-12-02T17-01-02Z.log.jsonl").read_text() == '{"step": 1, "loss": 0.25}\n'
    assert (out / "sft.2026-12-01T08-00-00Z.log.jsonl").read_text() == '{"step": 1, "loss": 0.5}\n'
    assert not (out / "sft.log.jsonl").exists()
    (runs / "times.tsv").write_text("sft\tstart\t2026-12-02T18:00:00Z\tdef5678\n")  # done.txt says sft: no end line
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (out / "sft.unknown.log.jsonl").read_text() == '{"step": 1, "loss": 0.25}\n'


def stand_in_torchrun(tmp_path, runs, part, samples=None):
    """A `torchrun` earlier on PATH whose evaluate.py copies prepared samples (`samples`, else
    tmp_path/samples.jsonl) into runs/PART; any other script fails."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text(f"#!/bin/sh\n[ \"$3\" = evaluate.py ] || exit 1\nmkdir -p {runs}/{part}\n"
                                       f"cp {samples or tmp_path / 'samples.jsonl'} {runs}/{part}/samples.jsonl\n")
    (fake_bin / "torchrun").chmod(0o755)
    return f"{fake_bin}:{os.environ['PATH']}"


def test_recipe_script_restores_committed_parts_on_a_new_machine(tmp_path):
    """A new machine: runs/ is empty, data/recipe/ holds heldout_start's samples and an end line
    for it in times.tsv (heldout_grpo's samples too, but no end line: it was killed). The
    script restores heldout_start into runs/ and skips it; heldout_grpo is not restored, and with
    every other part marked done the run is over; its start line in times.tsv names the commit."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    rows = recipe_rows([True, False, False, False], ["stop", "length", "stop", "length"], [100, 768, 500, 768])
    text = "".join(json.dumps(r) + "\n" for r in rows)
    for name in ("heldout_start", "heldout_grpo"):
        (out / f"{name}.samples.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    (out / "times.tsv").write_text("heldout_start\tstart\t2026-12-02T00:00:00Z\tabc1234\n"
                                   "heldout_start\tend\t2026-12-02T00:10:00Z\t600 s\tabc1234\n"
                                   "heldout_grpo\tstart\t2026-12-02T01:00:00Z\tabc1234\n")
    runs.mkdir()
    mark_done(runs, [p for p in TRAINED + EVALS if p not in ("heldout_start", "heldout_grpo")])
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768"}
    # heldout_grpo is not restored: its evaluation runs, here a stand-in
    env["PATH"] = stand_in_torchrun(tmp_path, runs, "heldout_grpo", runs / "heldout_start/samples.jsonl")
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "== heldout_start: done before" in run.stdout and "== heldout_grpo: 20" in run.stdout
    assert (runs / "heldout_start/samples.jsonl").read_text() == text
    times = (out / "times.tsv").read_text().splitlines()
    assert times[:3] == ["heldout_start\tstart\t2026-12-02T00:00:00Z\tabc1234",
                         "heldout_start\tend\t2026-12-02T00:10:00Z\t600 s\tabc1234",
                         "heldout_grpo\tstart\t2026-12-02T01:00:00Z\tabc1234"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert times[3].startswith("heldout_grpo\tstart\t") and times[3].split("\t")[3].startswith(commit.strip())
    assert times[4].startswith("heldout_grpo\tend\t") and len(times) == 5


def test_recipe_script_retrains_no_model_that_no_part_still_needs(tmp_path):
    """A new machine where data/recipe/ holds every part (samples, training metrics, end lines):
    nothing runs, not even a training part, whose model no part still to run reads (tests/faults.md
    P6). Before, sft, grpo, sft_grpo and control were trained again. With gsm8k_sft_grpo's end line
    gone, sft is trained again (sft_grpo, then that evaluation, need its model)."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()
    rows = recipe_rows([True, False, False, False], ["stop", "length", "stop", "length"], [100, 768, 500, 768])
    samples = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    for name in EVALS:
        (out / f"{name}.samples.jsonl.gz").write_bytes(samples)
    for name in set(TRAINED) - {"distill", "sft"}:
        (out / f"{name}.metrics.jsonl").write_text('{"step": 1}\n')
    (out / "distill.kept.jsonl.gz").write_bytes(gzip.compress(b""))
    (out / "distill.rejected.jsonl.gz").write_bytes(gzip.compress(b""))
    (out / "distill.summary.json").write_text("{}")
    parts = EVALS + TRAINED
    (out / "times.tsv").write_text("".join(f"{p}\tend\t2026-12-02T00:10:00Z\t600 s\tabc1234\n" for p in parts))
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text("#!/bin/sh\necho \"torchrun $3\" >&2\nexit 1\n")
    (fake_bin / "torchrun").chmod(0o755)
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768",
           "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "torchrun" not in run.stderr, run.stderr
    assert all(f"== {p}: done before" in run.stdout for p in parts)
    times = (out / "times.tsv").read_text()
    (out / "times.tsv").write_text(times.replace("gsm8k_sft_grpo\tend", "gsm8k_sft_grpo\tstart"))
    shutil.rmtree(runs)
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "torchrun sft.py" in run.stderr
    assert "== distill: done before" in run.stdout and "== sft: 20" in run.stdout


@pytest.mark.timeout(60)
def test_recipe_script_runs_only_its_parts_and_exports_only_finished_ones(tmp_path):
    """Two recipe processes over one runs/ folder: this one has PARTS="heldout_start" (done), so
    it runs nothing else, however much is left; heldout_grpo's samples file is another
    process's part in flight (not in done.txt): it is not exported, nor is the distillation
    that has a summary but no end (tests/faults.md P3). Before, every samples file in runs/ was exported."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    rows = recipe_rows([True, False, False, False], ["stop", "length", "stop", "length"], [100, 768, 500, 768])
    for name in ("heldout_start", "heldout_grpo"):
        (runs / name).mkdir(parents=True)
        (runs / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3 if "grpo" in name
                                                                                           else 4]))
    (runs / "distill").mkdir()
    (runs / "distill" / "traj.summary.json").write_text("{}")
    (runs / "done.txt").write_text("heldout_start\n")
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768", "PARTS": "heldout_start"}
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "== heldout_start: done before" in run.stdout
    assert run.stdout.count("not in PARTS") == len(TRAINED + EVALS) - 1   # every part but heldout_start
    assert sorted(p.name for p in out.iterdir()) == ["heldout_start.samples.jsonl.gz", "settings.txt", "tables.md",
                                                     "times.tsv"]


def hold_lock(path, text=None):
    """A stand-in for another recipe process: `flock` holds `path` (its PARTS file, or a part's
    lock) until killed; returns once the lock is taken (it prints a line then: no sleep)."""
    if text is not None:
        path.write_text(text)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys\nf = open(sys.argv[1], 'a')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\nsys.stdin.read()",
                               str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    return holder


@pytest.mark.timeout(60)
def test_recipe_script_part_waits_for_its_input_from_another_process(tmp_path):
    """PARTS="heldout_sft" while sft is not done and a live process (its PARTS file locked) has
    sft in its PARTS: the evaluation waits, saying so, and starts once sft is in done.txt (the
    test writes it when it reads the wait line: no sleep decides the outcome); then it runs (a
    stand-in evaluate.py) and is exported."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    rows = recipe_rows([True, False, False, False], ["stop", "length", "stop", "length"], [100, 768, 500, 768])
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (runs / "done.txt").write_text("heldout_start\n")
    trainer = hold_lock(runs / "parts.1", "distill sft grpo")
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768", "PARTS": "heldout_sft",
           "POLL": "0.05", "PATH": stand_in_torchrun(tmp_path, runs, "heldout_sft")}
    try:
        proc = subprocess.Popen(["bash", "data/recipe.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("== heldout_sft: waiting for sft"):
                assert not (runs / "heldout_sft").exists()
                with open(runs / "done.txt", "a") as f:
                    f.write("sft\n")
        assert proc.wait() == 0
    finally:
        trainer.kill()
    assert any(line.startswith("== heldout_sft: waiting for sft") for line in lines)
    assert any(line.startswith("== heldout_sft: 20") for line in lines)  # it ran, after the wait
    assert (runs / "done.txt").read_text().splitlines() == ["heldout_start", "sft", "heldout_sft"]
    assert (out / "heldout_sft.samples.jsonl.gz").exists()


@pytest.mark.timeout(60)
def test_recipe_script_refuses_what_would_wait_forever_or_run_twice(tmp_path):
    """A part whose input no live process will make (its process failed, was killed, or never
    named it) ends the run with an error instead of waiting forever; a part another process is
    running is not run again beside it; a PARTS word that names no part is an error, not a
    silent run of nothing (tests/faults.md P4)."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir()
    (runs / "done.txt").write_text("heldout_start\n")
    (runs / "parts.1").write_text("sft")  # a dead process's PARTS file: nobody holds its lock
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768", "POLL": "0.05",
           "PATH": stand_in_torchrun(tmp_path, runs, "math500_start")}

    def recipe(parts):
        return subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env={**env, "PARTS": parts}, capture_output=True,
                              text=True, timeout=50)

    run = recipe("heldout_sft")
    assert (run.returncode == 1
            and "heldout_sft needs sft, which is not done and no running recipe process" in run.stderr)
    other = hold_lock(runs / "lock.math500_start")
    try:
        run = recipe("math500_start")
    finally:
        other.kill()
    assert run.returncode == 1 and "math500_start is running in another recipe process" in run.stderr
    assert not (runs / "math500_start").exists()
    run = recipe("heldout_sft_gpro")
    assert run.returncode == 2 and "PARTS: no part 'heldout_sft_gpro'" in run.stderr


@pytest.mark.timeout(60)
def test_recipe_state_files_and_numbers_are_checked_P7(tmp_path):
    """data/recipe.sh's state (tests/faults.md P7): a torn last line of done.txt is not glued
    to the next part's name; a CRLF done.txt reads as the same list; a done part whose samples
    are gone runs again, saying so; parts made with other settings are refused, not restored;
    PARTS of blanks and a RANKS or K that is no positive integer end in one line, exit 2."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768", "PATH": no_torchrun(tmp_path)}

    def recipe(**extra):
        return subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env={**env, **extra}, capture_output=True,
                              text=True, timeout=50)

    mark_done(runs, TRAINED + EVALS)
    done = (runs / "done.txt").read_text().replace("heldout_start\n", "")
    (runs / "done.txt").write_text(done.replace("\n", "\r\n") + "heldout_gr")   # CRLF, and a torn last line
    (tmp_path / "samples.jsonl").write_text((runs / "heldout_grpo" / "samples.jsonl").read_text())
    run = recipe(PATH=stand_in_torchrun(tmp_path, runs, "heldout_start"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("done before") == len(TRAINED + EVALS) - 1 and "== heldout_start: 20" in run.stdout
    assert (runs / "done.txt").read_text().splitlines()[-2:] == ["heldout_gr", "heldout_start"]
    (runs / "heldout_sft" / "samples.jsonl").unlink()   # listed done, its samples gone: it runs again
    run = recipe()
    assert run.returncode == 1 and "== heldout_sft: listed in" in run.stdout and "torchrun evaluate.py" in run.stderr
    run = recipe(BUDGET="512")
    assert run.returncode == 2 and run.stderr.endswith(f"its parts were made with B=768 K=1 TOOLS=6 "
                                                       "TEACHER=qwen2.5-coder-1.5b DISTILL_N=96 SFT_BATCH=8 "
                                                       "SFT_EPOCHS=3 STEPS=6 PROMPTS=8 G=4 LR=1e-5 PUBLIC_N=100 "
                                                       "PUBLIC_ALL_N=500 MATH500=math500_int.jsonl "
                                                       "GSM8K=gsm8k_test.jsonl, this run has B=512 K=1 TOOLS=6 "
                                                       "TEACHER=qwen2.5-coder-1.5b DISTILL_N=96 SFT_BATCH=8 "
                                                       "SFT_EPOCHS=3 STEPS=6 PROMPTS=8 G=4 LR=1e-5 PUBLIC_N=100 "
                                                       "PUBLIC_ALL_N=500 MATH500=math500_int.jsonl "
                                                       "GSM8K=gsm8k_test.jsonl: use another R and OUT_DIR\n")
    assert run.stderr.startswith(f"{runs}/settings.txt: ")
    for extra, line in (({"PARTS": "   "}, "PARTS holds only blanks: name parts, or unset it for every part\n"),
                        ({"RANKS": "0"}, "RANKS must be a positive integer, got '0'\n"),
                        ({"RANKS": "two"}, "RANKS must be a positive integer, got 'two'\n"),
                        ({"K": "-1"}, "K must be a positive integer, got '-1'\n"),
                        ({"LR": "0"}, "LR must be a positive number, got '0'\n"),
                        ({"BUDGET": "1e3"}, "BUDGET must be a positive integer, got '1e3'\n"),
                        ({"G": "1"}, "G must be at least 2 and LR in (0, 1], got G=1 LR=1e-5\n"),
                        ({"LR": "2"}, "G must be at least 2 and LR in (0, 1], got G=4 LR=2\n"),
                        ({"MATH500": "no/such.jsonl"}, "no file 'no/such.jsonl' (MATH500 / GSM8K): the public parts "
                                                       "read it\n"),
                        ({"ALL_ROWS": "start sft_grop"}, "PUBLIC / ALL_ROWS: no row 'sft_grop'\n")):
        run = recipe(**extra)
        assert (run.returncode, run.stderr) == (2, line)


def test_recipe_script_carries_the_start_models_unfinished_full_sets_to_a_new_machine(tmp_path):
    """tests/faults.md P9. A machine stops inside math500_all_start (rank 0 wrote two rows and half a third,
    rank 1 one row): the export keeps the three whole rows, sorted, and no torn line. A new machine
    (runs/ empty) puts them where evaluate.py resumes from (samples.rank0.jsonl, beside the first
    PUBLIC_N's samples.jsonl); once the part is done, the partial file is removed. A trained row
    keeps no partial file: its model is retrained on a new machine. Before, the rows were lost."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    rows = [json.dumps(r) for r in recipe_rows([True, False, True, False], ["stop", "length", "stop", "stop"],
                                               [100, 768, 500, 300])]
    part = runs / "math500_all_start"
    part.mkdir(parents=True)
    (part / "samples.rank0.jsonl").write_text(rows[2] + "\n" + rows[0] + "\n" + rows[3][:9])
    (part / "samples.rank1.jsonl").write_text(rows[1] + "\n")
    (runs / "math500_all_sft_grpo_seed2").mkdir()
    (runs / "math500_all_sft_grpo_seed2" / "samples.rank0.jsonl").write_text(rows[0] + "\n")
    (runs / "done.txt").write_text("heldout_start\n")
    mark_done(runs, ["heldout_start"])
    env = {**os.environ, "R": str(runs), "OUT_DIR": str(out), "BUDGET": "768", "PARTS": "heldout_start"}
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    partial = out / "math500_all_start.partial.samples.jsonl.gz"
    assert gzip.decompress(partial.read_bytes()).decode() == "".join(sorted(r + "\n" for r in rows[:3]))
    assert not (out / "math500_all_sft_grpo_seed2.partial.samples.jsonl.gz").exists()
    assert not (out / "gsm8k_all_start.partial.samples.jsonl.gz").exists()

    shutil.rmtree(runs)  # a new machine: every part done but math500_all_start, which runs (a stand-in)
    runs.mkdir()
    math500_start = "".join(r + "\n" for r in rows)  # the first PUBLIC_N (here every problem)
    (out / "math500_start.samples.jsonl.gz").write_bytes(gzip.compress(math500_start.encode()))
    (out / "times.tsv").write_text("math500_start\tend\t2026-12-02T00:10:00Z\t600 s\tabc1234\n")
    mark_done(runs, [p for p in TRAINED + EVALS if p not in ("math500_all_start", "math500_start")])
    (tmp_path / "all.jsonl").write_text("".join(r + "\n" for r in rows))
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text(f"#!/bin/sh\n[ \"$3\" = evaluate.py ] || exit 1\n"
                                       f"cat {part}/samples.jsonl {part}/samples.rank0.jsonl > {tmp_path}/seen\n"
                                       f"cp {tmp_path}/all.jsonl {part}/samples.jsonl\n")  # the rest sampled
    (fake_bin / "torchrun").chmod(0o755)
    env.update(PARTS="math500_all_start", PATH=f"{fake_bin}:{os.environ['PATH']}")
    run = subprocess.run(["bash", "data/recipe.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "seen").read_text() == math500_start + "".join(sorted(r + "\n" for r in rows[:3]))
    assert not partial.exists() and (out / "math500_all_start.samples.jsonl.gz").exists()


def test_lead_tables_average_seeds_and_adjust_the_public_sets(tmp_path, capsys):
    import compare

    def write(name, scores, k=1, golds=()):
        rows = [sample_row(f"p{i}", f"What is {i}?", j, bool(x), answer=(golds or ["6"] * len(scores))[i])
                for i, x in enumerate(scores) for j in range(k)]
        with gzip.open(tmp_path / f"{name}.samples.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    write("heldout_start", [1, 0, 0, 0])
    write("heldout_grpo", [1, 1, 0, 0])
    write("heldout_grpo_seed1", [1, 1, 1, 0])
    write("heldout_grpo_seed2", [1, 0, 1, 0])
    write("heldout_sft_grpo", [1, 1, 1, 1])
    write("heldout_sft_grpo_seed2", [1, 1, 1, 1])  # no seed 1 (yet): the comparison takes seeds 0 and 2
    write("heldout_control_group", [0, 0, 0, 0])
    write("math500_start", [0, 0, 0, 0, 1, 1], golds=["1", "6", "6", "6", "6", "6"])
    write("math500_sft_grpo", [1, 1, 1, 1, 1, 0], golds=["1", "6", "6", "6", "6", "6"])
    write("gsm8k_start", [0, 0, 0, 0])
    write("gsm8k_sft_grpo", [1, 1, 0, 0])
    write("math500_all_start", [0, 1])  # a full pair for one set only: both tables stay on the first 100
    write("math500_all_sft_grpo_seed2", [1, 1])
    compare.main(["--lead", str(tmp_path), "--draws", "200"])
    out = capsys.readouterr().out
    # grpo: per-problem means over seeds 0-2 [1, 2/3, 2/3, 0] = 58.3; gains over start [0, 2/3, 2/3, 0]: +33.3,
    # and the sign-flip test's 4 patterns give |sums| 4/3, 0, 0, 4/3: p = 2/4
    assert "| GRPO from start (no SFT) | 0, 1, 2 | 58.3 [" in out
    assert "]; seeds 0: 50.0, 1: 75.0, 2: 50.0 | +33.3 [" in out and "| 0.5 (sign-flip) |" in out
    assert "| start (packaged 0.5B) | 0 | 25.0 [" in out and "| SFT + GRPO | 0, 2 | 100.0 [" in out
    # one seed, 0/1 scores: Wilson's interval (0 of 4: [0, 49.0]) and McNemar (0 gained, 1 lost: p = 1)
    assert "| control: rewards shuffled within each group | 0 | 0.0 [0.0, 49.0] | -25.0 [" in out
    assert "| 1 (0, 1) |" in out and "| SFT | " not in out  # no row without its samples
    # seeds 0 and 2 of each: grpo [1, 0.5, 0.5, 0], sft_grpo all 1: +50.0; |sums| of (0.5, 0.5, 1): p = 2/8
    assert "per-problem accuracy over seeds 0, 2 of each: +50.0 [" in out and "], p = 0.25 (sign-flip)\n" in out
    # seeds as the unit: 50, 50 against 100, 100; of the 6 splits, the observed and its mirror reach |50|
    assert "GRPO 50.0 (50.0, 50.0), SFT + GRPO 100.0 (100.0, 100.0); exact permutation p = 0.333 over the 6 " \
        "splits (no split gives less than 0.333)\n" in out
    # math500: 4 gained, 1 lost: McNemar 2 (1 + 5) / 32 = 0.375; gsm8k 2, 0: 2 / 4 = 0.5; Holm: 0.75, then 0.75
    assert "(k = 1; SFT + GRPO's seed 0; p adjusted by Holm's method for the two sets)" in out
    assert "| MATH-500, integer answers | 6 | 33.3 [9.7, 70.0] | 83.3 [43.6, 97.0] | +50.0 [" in out
    assert "| 0.375 (4, 1) | 0.75 |\n" in out and "| 0.5 (2, 0) | 0.75 |\n" in out
    # without p0 (gold 1, a hit of SFT + GRPO's only): [0, 0, 0, 1, 1] against [1, 1, 1, 1, 0], 3 gained, 1 lost:
    # +2 / 5 = +40.0, McNemar 2 (1 + 4) / 16 = 0.625; GSM8K (every gold 6) as in its row
    assert out.endswith("(a sensitivity check; gain in points, p unadjusted): MATH-500, integer answers: 5 problems "
                        "(of the 1 left out, start solved 0, SFT + GRPO 1), gain +40.0, McNemar p = 0.625 (3, 1); "
                        "GSM8K test: 4 problems (of the 0 left out, start solved 0, SFT + GRPO 0), gain +50.0, "
                        "McNemar p = 0.5 (2, 0)\n")
    # guessable follows per_problem's sorted order, not the file's: p10 sorts before p9
    run = {("b", "p9"): ("What is 9?", "1", [1.0], [1.0]), ("b", "p10"): ("What is 10?", "7", [0.0], [1.0])}
    assert compare.guessable(run).tolist() == [False, True]
    # Holm by hand: the smaller p times 2, the larger at least that
    assert compare.holm([0.04, 0.03]) == [0.06, 0.06]
    assert compare.holm([0.01, 0.5]) == [0.02, 0.5]
    assert compare.holm([0.6, 0.7]) == [1.0, 1.0]
    # both full pairs: the table takes them (seed 2), MATH-500's 2 problems 1 gained: McNemar p = 1, Holm 1
    write("gsm8k_all_start", [0, 0, 0], golds=["2", "0", "1"])  # every gold 0, 1 or 2: none left for the check
    write("gsm8k_all_sft_grpo_seed2", [1, 1, 1], golds=["2", "0", "1"])  # 3 gained: 2 / 8 = 0.25; Holm 0.5, then 1
    compare.main(["--lead", str(tmp_path), "--draws", "200"])
    out = capsys.readouterr().out
    assert "(k = 1; SFT + GRPO's seed 2; p adjusted by Holm's method for the two sets)" in out
    assert "| MATH-500, integer answers | 2 | 50.0 [" in out and "| 1 (1, 0) | 1 |\n" in out
    assert "| GSM8K test | 3 | 0.0 [0.0, 56.1] | 100.0 [43.9, 100.0] | +100.0 [+100.0, +100.0] | " \
        "0.25 (3, 0) | 0.5 |\n" in out
    assert out.endswith("MATH-500, integer answers: 2 problems (of the 0 left out, start solved 0, SFT + GRPO 0), "
                        "gain +50.0, McNemar p = 1 (1, 0); GSM8K test: no problem left\n")
    # k = 2 is refused (McNemar and Wilson are for one sample a problem)
    write("heldout_start", [1, 0, 0, 0], k=2)
    with pytest.raises(ex.InputError, match=r"heldout_start.samples.jsonl.gz: more than one sample a problem"):
        compare.main(["--lead", str(tmp_path), "--draws", "200"])


def test_readme_lead_is_computed_from_the_committed_samples(capsys):
    """The README's lead tables are compare.py --lead's output over data/recipe/, the block from
    its first line to its last, exactly."""
    import compare

    compare.main(["--lead", os.path.join(ROOT, "data", "recipe")])
    lead = capsys.readouterr().out.strip()
    readme = open(os.path.join(ROOT, "README.md")).read()
    first, last = lead.splitlines()[0], lead.splitlines()[-1]
    assert first in readme and last in readme
    assert readme[readme.index(first):readme.index(last) + len(last)] == lead
