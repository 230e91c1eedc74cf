"""evaluate.py as a command: a tiny model end to end (3 problems, k = 2), --from-samples,
a killed run resumed, 2 ranks (torchrun, gloo) against 1, and clean input errors.

The model runs in subprocesses (the real CLI); one single-process run is shared by the
tests of this module. Sampling is at temperature 1.0: per-sample seeds, not greedy
decoding, are what make 1 rank and 2 ranks (or any --max-num-seqs) agree.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

import evaluate as ev
import executor as ex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "evaluate.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")   # same kernels (and threads) in every run
# 3 problems in 2 benchmarks, k = 2: 6 samples through 3 rows (places refilled as samples finish)
B1 = [{"id": "p1", "problem": "What is 1 + 1?", "answer": "2"},
      {"id": "p2", "problem": "How many integers up to 100 are divisible by 3 or 5?", "answer": "47"}]
B2 = [{"id": "q1", "problem": "Compute 1 + 2 + ... + 10.", "answer": "55"}]
SAMPLING = ["--k", "2", "--temperature", "1.0", "--max-context", "600", "--max-new-tokens", "24",
            "--max-tool-calls", "2", "--max-num-seqs", "3", "--exec-workers", "1"]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cli(data, out, model, launcher=(sys.executable,), timeout=120, extra=()):
    cmd = [*launcher, SCRIPT, "--model", model, "--data", *data, *SAMPLING, *extra, "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)


def _benchmarks(out):
    return json.loads((out / "metrics.json").read_text())["benchmarks"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_dir):
    """One single-process run; returns (data paths, out dir, tiny model dir, stdout)."""
    d = tmp_path_factory.mktemp("eval_data")
    data = [_write_jsonl(d / "b1.jsonl", B1), _write_jsonl(d / "b2.jsonl", B2)]
    out = tmp_path_factory.mktemp("eval_single")
    r = _cli(data, out, tiny_dir)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return data, out, tiny_dir, r.stdout


@pytest.mark.timeout(120)
def test_end_to_end_then_from_samples_gives_identical_metrics(single, tmp_path):
    data, out, _, stdout = single
    assert sorted(os.listdir(out)) == ["args.json", "metrics.json", "metrics.md", "samples.jsonl"]
    rows = ev.load_samples(str(out / "samples.jsonl"))   # checks fields, no duplicate key
    assert [(r["benchmark"], r["id"], r["sample_idx"]) for r in rows] == [
        ("b1", "p1", 0), ("b1", "p1", 1), ("b1", "p2", 0), ("b1", "p2", 1), ("b2", "q1", 0), ("b2", "q1", 1)]
    # each row's seed is its own generator's: from --seed, the benchmark, the problem id and j alone
    assert [r["seed"] for r in rows] == [ev.sample_seed(0, r["benchmark"], r["id"], r["sample_idx"]) for r in rows]
    assert len({r["seed"] for r in rows}) == 6 and "rollout_ids" not in rows[0]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["args"]["k"] == 2 and metrics["args"]["data"] == data
    assert json.loads((out / "args.json").read_text()) == metrics["args"]
    assert set(metrics["benchmarks"]) == {"b1", "b2"}
    assert metrics["benchmarks"]["b1"]["n_samples"] == 4 and metrics["benchmarks"]["b2"]["k"] == 2
    assert (out / "metrics.md").read_text().strip() in stdout
    # recompute from the samples alone, in a copy
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "metrics.json").unlink()
    assert ex.cli(ev.main, ["--from-samples", str(copy)]) == 0
    assert _benchmarks(copy) == metrics["benchmarks"]
    assert (copy / "metrics.md").read_text() == (out / "metrics.md").read_text()


@pytest.mark.timeout(120)
def test_from_samples_regrades_with_todays_grader_A19(single, tmp_path, capsys):
    """A sample graded right by an older grader for restating the question (`1 + 1` against
    gold 2) is regraded wrong, the file rewritten, the metrics computed from the new verdict."""
    _, out, _, _ = single
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    rows = ev.load_samples(str(copy / "samples.jsonl"))
    rows[0].update(pred="1 + 1", correct=True)    # b1 p1, gold 2
    rows[1].update(pred="2.0", correct=False)     # b1 p1: one number, right
    (copy / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ex.cli(ev.main, ["--from-samples", str(copy)]) == 0
    assert "2 of 6 verdicts changed by regrading" in capsys.readouterr().out
    regraded = ev.load_samples(str(copy / "samples.jsonl"))
    assert [r["correct"] for r in regraded[:2]] == [False, True]
    assert regraded[2:] == rows[2:]
    assert _benchmarks(copy)["b1"]["avg_at_k"] == sum(r["correct"] for r in regraded[:4]) / 4


@pytest.mark.timeout(120)
def test_regrading_writes_no_file_it_should_not_B49(single, tmp_path, capsys):
    """tests/faults.md B49: a read-only samples.jsonl is refused before any change; a symlinked
    one has its target rewritten (the link stays a link) with the target's mode kept; a GSM8K
    gold kept whole by an older reader is graded by its `####` answer; a multiple-choice row
    of an older run (`choices`) is one line (before: a 0444 file replaced as 0644, the link
    replaced by a file, `48+24` right against a worked solution, a TypeError traceback on
    `"choices": 5`)."""
    _, out, _, _ = single
    rows = ev.load_samples(str(out / "samples.jsonl"))
    rows[0].update(pred="1 + 1", correct=True)    # b1 p1, gold 2: regraded wrong
    text = "".join(json.dumps(r) + "\n" for r in rows)
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "samples.jsonl").write_text(text)
    (ro / "samples.jsonl").chmod(0o444)
    assert ex.cli(ev.main, ["--from-samples", str(ro)]) == 2
    assert "samples.jsonl: read-only, so its 1 changed verdicts cannot be written: regrade a copy" in \
        capsys.readouterr().err
    assert (ro / "samples.jsonl").read_text() == text
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "target.jsonl").write_text(text)
    (tmp_path / "target.jsonl").chmod(0o640)
    (linked / "samples.jsonl").symlink_to(tmp_path / "target.jsonl")
    assert ex.cli(ev.main, ["--from-samples", str(linked)]) == 0
    assert (linked / "samples.jsonl").is_symlink() and (tmp_path / "target.jsonl").stat().st_mode & 0o777 == 0o640
    assert ev.load_samples(str(tmp_path / "target.jsonl"))[0]["correct"] is False
    gsm = tmp_path / "gsm"
    gsm.mkdir()
    rows[0].update(answer="48/2 = 24 clips in May, 48+24 = 72 in all.\n#### 72", pred="48+24", correct=True)
    rows[1].update(answer=rows[0]["answer"], pred="72", correct=False)
    rows[2].update(choices=5)
    (gsm / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert ex.cli(ev.main, ["--from-samples", str(gsm)]) == 0
    assert [r["correct"] for r in ev.load_samples(str(gsm / "samples.jsonl"))] == [False, True]
    (gsm / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ex.cli(ev.main, ["--from-samples", str(gsm)]) == 2
    assert "samples.jsonl:3: field 'choices': multiple-choice samples are not supported" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_exemplars_are_prior_turns_of_every_prompt(single, tmp_path):
    """--exemplars puts its turns before each problem (the prompting baseline): a 300-word
    exemplar leaves no room under --max-context 600, and a resume with other exemplars is refused."""
    data, out, model, _ = single
    shot = {"id": "e1", "problem": "What is 2 + 2? " + "Think. " * 300, "answer": "4",
            "completion": "Add.\n```python\nprint(2 + 2)\n```\n```output\n4\n```\nSo \\boxed{4}."}
    shots = _write_jsonl(tmp_path / "shots.jsonl", [shot])
    r = _cli(data, tmp_path / "long", model, extra=("--exemplars", shots))
    assert r.returncode == 2 and "prompts leave no room under --max-context 600" in r.stderr, r.stderr[-2000:]
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    r = _cli(data, copy, model, extra=("--exemplars", shots))
    assert r.returncode == 2 and "were made with --exemplars None, this run has" in r.stderr, r.stderr[-2000:]


@pytest.mark.timeout(120)
def test_killed_run_resumes_with_each_sample_once_and_identical(single, tmp_path):
    """The folder a killed run leaves: this rank's file with a torn last line, a file from
    an earlier 2-rank attempt, and a row already merged into samples.jsonl (a crash after
    the merge). Each problem that lacks a sample is sampled whole again (its seeds
    reproduce the saved ones), and only what is missing is kept: the result equals the
    uninterrupted run byte for byte."""
    data, out, model, _ = single
    full = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    res = tmp_path / "resumed"
    res.mkdir()
    shutil.copy(out / "args.json", res / "args.json")
    (res / "samples.rank0.jsonl").write_text(full[0] + full[1] + full[2] + full[4][:40])
    (res / "samples.rank1.jsonl").write_text(full[5])
    (res / "samples.jsonl").write_text(full[0])
    r = _cli(data, res, model)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 samples already" in r.stdout
    assert sorted(os.listdir(res)) == ["args.json", "metrics.json", "metrics.md", "samples.jsonl"]
    assert (res / "samples.jsonl").read_text() == "".join(full)
    assert _benchmarks(res) == _benchmarks(out)
    # a rerun of a finished run samples nothing and changes nothing
    r = _cli(data, res, model)
    assert r.returncode == 0 and "6 samples already" in r.stdout and "] sampled " not in r.stdout
    assert (res / "samples.jsonl").read_text() == "".join(full)


@pytest.mark.timeout(150)
def test_two_ranks_gather_the_same_samples_and_metrics(single, tmp_path):
    data, out, model, _ = single
    launcher = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    r = _cli(data, tmp_path, model, launcher=launcher, timeout=140)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # rank 0 samples two of the three problems (rank_share's order), rank 1 the third
    assert "[rank 0] sampled 2 problems x 2" in r.stdout and "[rank 1] sampled 1 problems x 2" in r.stdout
    assert not [n for n in os.listdir(tmp_path) if n.startswith("samples.rank")]
    assert (tmp_path / "samples.jsonl").read_text() == (out / "samples.jsonl").read_text()
    assert _benchmarks(tmp_path) == _benchmarks(out)


def test_ranks_share_what_is_left_whatever_order_the_kinds_come_in():
    """Twelve problems of six kinds in turn, two ranks: each rank holds five of the kinds (every
    other problem held three each: one rank got only the long kinds of a held-out row, 13 min
    against 48); with rank 0's six done, a resume splits the other six three and three (before:
    all six on rank 1, rank 0 idle)."""
    probs = [("exact", {"id": f"k{i % 6}-{i}"}) for i in range(12)]
    shares = [[q["id"] for _, q in ev.rank_share(probs, set(), 1, r, 2)] for r in range(2)]
    assert shares == [["k2-8", "k1-1", "k3-3", "k3-9", "k0-6", "k4-10"],
                      ["k1-7", "k2-2", "k5-11", "k4-4", "k5-5", "k0-0"]]
    assert [len({i.split("-")[0] for i in share}) for share in shares] == [5, 5]
    done = {("exact", i, 0) for i in shares[0]}
    left = [[q["id"] for _, q in ev.rank_share(probs, done, 1, r, 2)] for r in range(2)]
    assert left == [["k1-7", "k5-11", "k5-5"], ["k2-2", "k4-4", "k0-0"]]
    k2 = [ev.rank_share(probs, done | {("exact", "k1-7", 0)}, 2, r, 2) for r in range(2)]  # k = 2: sample 1 lacks
    assert [len(share) for share in k2] == [6, 6] and k2[0][0][1]["id"] == "k2-8"


def test_sample_seeds_depend_on_the_sample_alone():
    seeds = {(b, i, j): ev.sample_seed(7, b, i, j) for b in ("a", "b") for i in ("0", "1") for j in range(3)}
    assert len(set(seeds.values())) == 12 and all(0 <= s < 2 ** 60 for s in seeds.values())
    assert ev.sample_seed(7, "a", "1", 2) == seeds["a", "1", 2] != ev.sample_seed(8, "a", "1", 2)


@pytest.mark.timeout(150)
def test_a_resume_across_a_change_of_batching(single, tmp_path):
    """A run killed after 3 samples, resumed with another --max-num-seqs (1: one sample at a
    time, each group's samples placed one by one): the same samples as the uninterrupted run
    (3 rows), byte for byte. A folder whose samples were drawn in waves of --batch-size (rows
    with rollout_ids) is refused in one line: its seeds are not this version's."""
    data, out, model, _ = single
    full = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    res = tmp_path / "resumed"
    res.mkdir()
    shutil.copy(out / "args.json", res / "args.json")
    (res / "samples.rank0.jsonl").write_text(full[0] + full[3] + full[4])
    r = _cli(data, res, model, extra=("--max-num-seqs", "1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "3 samples already" in r.stdout and "<= 1 at once" in r.stdout
    assert (res / "samples.jsonl").read_text() == "".join(full)
    waves = tmp_path / "waves"
    waves.mkdir()
    args = json.loads((out / "args.json").read_text())
    del args["max_num_seqs"]
    (waves / "args.json").write_text(json.dumps({**args, "batch_size": 2}))
    old = [dict(json.loads(line), rollout_ids=["p1", "p2"], rollout_n=2) for line in full[:2]]
    (waves / "samples.rank0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in old))
    r = _cli(data, waves, model)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"evaluate.py: error: {waves}: sample ('b1', 'p1', 0) was drawn in waves, with other seeds: use another --out"]


@pytest.mark.timeout(30)
def test_bad_data_line_is_a_clean_one_line_error(tmp_path):
    bad = tmp_path / "bench.jsonl"
    bad.write_text(json.dumps(B1[0]) + "\n{not json\n")
    (tmp_path / "config.json").write_text("{}")  # a model folder, never loaded
    r = subprocess.run([sys.executable, SCRIPT, "--model", str(tmp_path), "--data", str(bad),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=25,
                       env=ENV, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"evaluate.py: error: {bad}:2: not valid JSON "
                                             "(Expecting property name enclosed in double quotes)"]


@pytest.mark.timeout(30)
def test_input_and_resume_errors_exit_2_before_any_model(single, tmp_path, capsys):
    data, out, _, _ = single

    def error(*argv):
        assert ex.cli(ev.main, list(argv)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("evaluate.py: error: ")
        return err[0]

    (tmp_path / "config.json").write_text("{}")
    base = ["--model", str(tmp_path), "--out", str(tmp_path / "o")]   # any model folder: never loaded
    assert f"{tmp_path / 'missing.jsonl'}: no such file" in error(*base, "--data", str(tmp_path / "missing.jsonl"))
    no_answer = _write_jsonl(tmp_path / "x.jsonl", [{"id": "1", "problem": "?"}])
    assert f"{no_answer}:1: missing field 'answer'" in error(*base, "--data", no_answer)
    dup = _write_jsonl(tmp_path / "d.jsonl", [B1[0], B1[0]])
    assert f"{dup}:2: field 'id': 'p1' already on line 1" in error(*base, "--data", dup)
    assert "no/such/model: no such model" in error("--model", "no/such/model", "--data", data[0])
    # a run folder is resumed only by a compatible command
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    run = ["--model", single[2], "--data", *data, *SAMPLING, "--out", str(copy)]
    assert "--temperature 1.0, this run has 0.5" in error(*run, "--temperature", "0.5")
    assert "sample ('b1', 'p2', 0) was not made from this run's problems" in error(*run, "--limit", "1")
    with open(copy / "samples.jsonl", "a") as f:
        f.write("{bad\n")
    assert f"{copy / 'samples.jsonl'}:7: not valid JSON" in error(*run)
    assert f"{tmp_path}/none/samples.jsonl: no such file" in error("--from-samples", str(tmp_path / "none"))
