"""Multiple-choice problems (the paper's out-of-domain check on GPQA-Diamond): the prompt
built from a row, the options' shuffle keyed on the problem id (tests/faults.md A15), the
letter read back from an answer and graded without Math-Verify (A16), votes by letter (A17),
best@k and the per-subject split, data/choice_demo.jsonl recomputed, and evaluate.py end
to end on a multiple-choice file."""
import json
import math
import os
import subprocess
import sys
from collections import Counter

import pytest

import evaluate as ev
import executor as ex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPQA_ROW = {"Record ID": "rec-fixed", "Question": "Which gas makes up most of Earth's atmosphere?",
            "Correct Answer": "Nitrogen", "Incorrect Answer 1": "Oxygen", "Incorrect Answer 2": "Argon",
            "Incorrect Answer 3": "Carbon dioxide", "High-level domain": "Chemistry"}
CHOICES = ["3", "4", "22", "5"]   # letter order; gold B (4)


def _read(tmp_path, rows):
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ex.read_problems(str(path))


# --- A15: the prompt and the shuffle ----------------------------------------------------------

@pytest.mark.timeout(10)
def test_prompt_text_of_a_fixed_question_A15(tmp_path):
    """choice_order("rec-fixed", 4) is [2, 0, 1, 3]: options [Nitrogen, Oxygen, Argon, Carbon
    dioxide] are shown as Argon, Nitrogen, Oxygen, Carbon dioxide, so the gold is B. The
    plain form with the same id and options in that order (the correct one first, answer A)
    gives the same prompt and gold; in another file order the gold follows Nitrogen."""
    gpqa, plain = _read(tmp_path, [GPQA_ROW, {"id": "rec-fixed2", "problem": "?", "choices": ["x", "y"],
                                              "answer": "A"}])
    assert ex.choice_order("rec-fixed", 4) == [2, 0, 1, 3]
    assert gpqa["problem"] == ("Which gas makes up most of Earth's atmosphere?\n\n(A) Argon\n(B) Nitrogen\n"
                               "(C) Oxygen\n(D) Carbon dioxide\n\n"
                               "Give the letter of the correct option as the final answer, e.g. \\boxed{A}.")
    assert (gpqa["id"], gpqa["answer"], gpqa["choices"]) == ("rec-fixed", "B", ["Argon", "Nitrogen", "Oxygen",
                                                                                  "Carbon dioxide"])
    as_plain = {"id": "rec-fixed", "question": GPQA_ROW["Question"], "answer": "A",
                "choices": ["Nitrogen", "Oxygen", "Argon", "Carbon dioxide"]}
    same = _read(tmp_path, [as_plain])[0]
    assert (same["problem"], same["answer"], same["choices"]) == (gpqa["problem"], "B", gpqa["choices"])
    other = _read(tmp_path, [dict(as_plain, answer="D", choices=["Oxygen", "Argon", "Carbon dioxide", "Nitrogen"])])[0]
    assert other["choices"] == ["Carbon dioxide", "Oxygen", "Argon", "Nitrogen"] and other["answer"] == "D"
    assert plain["choices"] in (["x", "y"], ["y", "x"]) and plain["choices"][ord(plain["answer"]) - 65] == "x"


@pytest.mark.timeout(60)
def test_shuffle_depends_on_the_id_alone_A15():
    """Python's hash() is salted per process: two interpreters with different PYTHONHASHSEED
    must draw the same orders (sha256 of the id)."""
    code = "import executor; print([executor.choice_order(f'q{i}', 4) for i in range(50)])"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=50,
                           env=dict(os.environ, PYTHONHASHSEED=seed)).stdout for seed in ("1", "2")}
    assert outs == {str([ex.choice_order(f"q{i}", 4) for i in range(50)]) + "\n"}
    assert len({tuple(ex.choice_order(f"q{i}", 4)) for i in range(50)}) > 1          # not one fixed order


@pytest.mark.timeout(10)
def test_gold_letters_are_balanced_over_400_ids_A15():
    """The gold (option 0) lands on each letter ~ Binomial(400, 1/4): mean 100, sd
    sqrt(400 * 1/4 * 3/4) = 8.66; +-35 is 4 sd, which a fair shuffle misses with probability
    < 4 * 2 * 3.2e-5 = 2.6e-4. (These 400 ids give A 100, B 99, C 111, D 90.)"""
    counts = Counter(ex.LETTERS[ex.choice_order(f"gpqa-{i}", 4).index(0)] for i in range(400))
    assert sorted(counts) == list("ABCD") and all(abs(c - 100) <= 35 for c in counts.values()), counts
    assert math.sqrt(400 * 0.25 * 0.75) * 4 <= 35


@pytest.mark.timeout(10)
@pytest.mark.parametrize("row,what", [
    ({"id": "a", "problem": "?", "choices": "ABCD", "answer": "A"}, "field 'choices' must be a list of 2 to 10"),
    ({"id": "a", "problem": "?", "choices": ["x"], "answer": "A"}, "field 'choices' must be a list of 2 to 10"),
    ({"id": "a", "problem": "?", "choices": ["x", "y"], "answer": "C"}, "field 'answer' must be a letter A to B"),
    ({"id": "a", "problem": "?", "choices": ["x", "y"], "answer": "x"}, "field 'answer' must be a letter A to B"),
    ({"id": "a", "problem": "?", "choices": ["x", "y"], "answer": "AB"}, "field 'answer' must be a letter A to B"),
    ({"id": "a", "problem": "?", "choices": ["x", None], "answer": "A"}, "field 'choices\\[1\\]' must be"),
    ({"id": "a", "problem": "?", "choices": ["x", " x "], "answer": "A"}, "options .* are the same answer"),
    ({"id": "a", "choices": ["x", "y"], "answer": "A"}, "field 'question' must be a string"),
    (dict(GPQA_ROW, Question=""), "field 'Question' is blank"),
    ({k: v for k, v in GPQA_ROW.items() if k != "Question"}, "field 'Question' must be a string"),
    ({k: v for k, v in GPQA_ROW.items() if k != "Incorrect Answer 3"}, "field 'Incorrect Answer 3' must be a string"),
    (dict(GPQA_ROW, **{"Incorrect Answer 2": "Nitrogen "}), "options .* are the same answer to the grader"),
])
def test_bad_multiple_choice_rows_are_refused_A15(tmp_path, row, what):
    with pytest.raises(ex.InputError, match=r"mc.jsonl:2: " + what):
        _read(tmp_path, [{"id": "ok", "problem": "1+1", "answer": "2"}, row])


# --- A16: the letter an answer names; graded by letter, never by Math-Verify ------------------------

@pytest.mark.timeout(10)
@pytest.mark.parametrize("text,letter", [
    (r"\boxed{B}", "B"), (r"\boxed{(B)}", "B"), (r"\boxed{\text{B}}", "B"), (r"\boxed{\textbf{(B)}}", "B"),
    (r"\boxed{B.}", "B"), (r"\boxed{b}", "B"), (r"\boxed B", "B"), (r"\boxed{4}", "B"), (r"\boxed{$4$}", "B"),
    (r"\boxed{(B) 4}", "B"), (r"\boxed{(B) four}", "B"), (r"\boxed{22}", "C"), (r"\boxed{A}", "A"),
    (r"\boxed{A}, \boxed{B}", None), (r"\boxed{AB}", None), (r"\boxed{A or B}", None),
    (r"\boxed{(A) or (B)}", None), (r"\boxed{(B)(C)}", None), (r"\boxed{E}", None), (r"\boxed{4.0}", None),
    (r"\boxed{}", None), ("no box", None),
])
def test_every_answer_spelling_A16(monkeypatch, text, letter):
    """Gold B of CHOICES = [3, 4, 22, 5]: a letter, the option's text or `(B) ...` name B; two
    letters, a letter past D or another text name none. Math-Verify is never asked."""
    def no_math_verify(*args):
        raise AssertionError("Math-Verify called on a multiple-choice row")
    monkeypatch.setattr(ex._GRADER, "verify", no_math_verify)
    pred = ex.extract_answer(text)
    assert ex.choice_letter(pred, CHOICES) == letter
    assert ex.grade(pred, "B", choices=CHOICES) is (letter == "B")


@pytest.mark.timeout(60)
def test_a_free_answer_row_is_unaffected_A16(tmp_path):
    rows = _read(tmp_path, [{"id": "f", "problem": "What is 140/2?", "answer": 70, "subject": "x"}])
    assert rows == [{"id": "f", "problem": "What is 140/2?", "answer": "70", "subject": "x"}]   # no choices
    assert ex.grade("70.0", "70") and not ex.grade("B", "70") and ex.grade("x+1", "1+x", timeout=30)


@pytest.mark.timeout(60)
def test_the_control_rewards_every_spelling_as_grpo_does_A20():
    """The permuted-reward control grades through grpo's own verdict (`executor.correct`): the
    answers `B`, `(B)`, `b`, the option's text, `C` and `B.` against gold B earn 1, 1, 1, 1, 0, 1
    from both (before, the control graded without `choices`: 1, 1, 1, 0, 0, 0)."""
    import grpo
    sys.path.insert(0, os.path.join(ROOT, "data"))
    import permuted_reward as pr
    problem = {"id": "q", "problem": "?", "answer": "B", "choices": CHOICES}
    preds = ("B", "(B)", "b", "4", "C", "B.")
    samples = [ex.Sample(prompt_ids=[], ids=[], roles=[], logprobs=[], pred=x) for x in preds]
    assert pr.answer_rewards(samples, [problem]) == grpo.answer_reward(samples, [problem] * 6) == [1, 1, 1, 1, 0, 1]


# --- A17: votes by letter; best@k; the per-subject split -------------------------------------------

def _record(pid, j, pred, subject, choices=CHOICES, gold="B"):
    return {"benchmark": "mc", "id": pid, "sample_idx": j, "pred": pred, "choices": choices, "answer": gold,
            "correct": ex.grade(pred, gold, choices=choices), "subject": subject, "blocks": [], "completion": "",
            "finish_reason": "stop", "n_code_blocks": 0, "n_exec_errors": 0, "completion_tokens": 1,
            "model_tokens": 1, "plan_tokens": 0}


@pytest.mark.timeout(10)
def test_votes_and_split_by_subject_A17():
    """p1 (math): B, (B) 4, A, A -> B has 2 votes, A 2; ties go to the first vote: B, right.
    p2 (math): A, 4, 22, 22 -> C (22) wins 2 to 1 to 1: wrong; 1 of 4 right.
    p3 (bio): nothing right. avg@4: runs j=0..3 right p1/p2/p3: j0 1/3, j1 2/3, j2 0, j3 0 ->
    1/4; best@4 = pass@4 = 2/3 (p1, p2 have a right sample); maj@4 = 1/3. Math: avg 3/8
    (runs 1/2, 1, 0, 0), best 1, maj 1/2; bio: 0, 0, 0."""
    preds = {"p1": ["B", "(B) 4", "A", "A"], "p2": ["A", "4", "22", "22"], "p3": ["A", "A", None, "5"]}
    rs = [_record(p, j, x, "bio" if p == "p3" else "math") for p, xs in preds.items() for j, x in enumerate(xs)]
    assert [ev.majority_answer([r for r in rs if r["id"] == p])["pred"] for p in preds] == ["B", "22", "A"]
    m = ev.summarize(rs)["mc"]
    assert (m["avg_at_k"], m["best_at_k"], m["pass_at_k"]["4"], m["maj_at_k"]) == (0.25, 2 / 3, 2 / 3, 1 / 3)
    assert m["by_subject"] == {
        "bio": {"n_problems": 1, "k": 4, "avg_at_k": 0.0, "avg_at_k_std": 0.0, "maj_at_k": 0.0, "best_at_k": 0.0},
        "math": {"n_problems": 2, "k": 4, "avg_at_k": 0.375, "avg_at_k_std": pytest.approx(math.sqrt(0.171875)),
                 "maj_at_k": 0.5, "best_at_k": 1.0}}   # runs 1/2, 1, 0, 0: var = 0.5 - 0.375^2
    table = ev.markdown_table(ev.summarize(rs))
    assert "| mc: math | 2 | 4 | 37.5 ± 41.5 | 50.0 | 100.0 (k=4) |" in table
    assert "| mc: bio | 1 | 4 | 0.0 ± 0.0 | 0.0 | 0.0 (k=4) |" in table
    assert ev.summarize([dict(r, subject=None) for r in rs])["mc"]["by_subject"] == {}


# --- data/choice_demo.jsonl -----------------------------------------------------------------------

CHOICE_DEMO = {
    "mc-01": 17 * 23, "mc-02": sum(all(n % d for d in range(2, n)) for n in range(2, 50)),
    "mc-03": (6 - 2) * 180, "mc-04": 2**10 % 7, "mc-05": sum(360 % d == 0 for d in range(1, 361)),
    "mc-06": math.gcd(84, 126), "mc-07": 3 * 2**2, "mc-08": math.factorial(5),
    "mc-09": 10 * 3**2 // 2, "mc-10": 36 // (2 * 1 + 16),
}


@pytest.mark.timeout(10)
def test_choice_demo_answers_are_what_code_computes():
    path = os.path.join(ROOT, "data", "choice_demo.jsonl")
    raw = [json.loads(line) for line in open(path)]
    assert len(raw) == 10 and all(len(r["choices"]) == 4 for r in raw)
    for r, q in zip(raw, ex.read_problems(path)):
        assert r["choices"][ord(r["answer"]) - 65] == str(CHOICE_DEMO[r["id"]]), r["id"]   # the file's order
        assert q["choices"][ord(q["answer"]) - 65] == str(CHOICE_DEMO[q["id"]]), q["id"]   # after the shuffle
        assert sorted(q["choices"]) == sorted(r["choices"])


# --- evaluate.py end to end ---------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_evaluate_runs_a_multiple_choice_file_end_to_end(tiny_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", tiny_dir, "--data",
           os.path.join(ROOT, "data", "choice_demo.jsonl"), "--k", "2", "--temperature", "1.0", "--max-context",
           "1000", "--max-new-tokens", "16", "--max-tool-calls", "1", "--exec-workers", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = ev.load_samples(str(out / "samples.jsonl"))
    assert len(rows) == 20 and all(len(x["choices"]) == 4 and x["answer"] in "ABCD" for x in rows)
    assert all(x["correct"] == ex.grade(x["pred"], x["answer"], choices=x["choices"]) for x in rows)
    m = json.loads((out / "metrics.json").read_text())["benchmarks"]["choice_demo"]
    assert m["best_at_k"] == m["pass_at_k"]["2"] and m["k"] == 2
    assert {s: a["n_problems"] for s, a in m["by_subject"].items()} == {"math": 8, "science": 2}
    assert "pass@k = best@k" in r.stdout and "| choice_demo: science | 2 | 2 |" in r.stdout
