"""Bad input in every stage (tests/faults.md B1-B7): one line `stage.py: error: ...`, exit 2, before any
model loads, and no file outside a new --out created or changed. One table per stage,
then the faults that used to give a silent wrong result: numbers in problem files, a
stage writing over another stage's run, resume mixing settings, prompts longer than the
context budget, Ctrl-C and a full disk."""
import errno
import json
import os
import shutil
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
                       "surrogate": '{"problem": "x \\ud800", "answer": "1"}\n'}.items():
        (d / f"{name}.jsonl").write_text(good[0] + line)
        f[name] = str(d / f"{name}.jsonl")
    (d / "latin1.jsonl").write_bytes(good[0].encode() + b'{"problem": "caf\xe9", "answer": "1"}\n')
    f["latin1"] = str(d / "latin1.jsonl")
    good = json.dumps(TRAJ[0]) + "\n"
    for name, line in {"t_notjson": b"{oops\n", "t_latin1": b'{"problem": "caf\xe9", "completion": "1"}\n',
                       "t_nocomp": b'{"problem": "x"}\n', "t_type": b'{"problem": "x", "completion": 5}\n',
                       "t_surrogate": b'{"problem": "x", "completion": "\\udc80"}\n'}.items():
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
                          "corrupt_ckpt": {"config.json": "{}", "trainer_state_rank0.pt": "", "args.json": "{"}}.items():
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
    (["--max-context", "0"], "argument --max-context: expected an integer in [1, inf), got '0'"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: expected an integer in [0, inf), got '-1'"),
    (["--max-tool-calls", "-2"], "argument --max-tool-calls: expected an integer in [0, inf), got '-2'"),
    (["--exec-timeout", "0"], "argument --exec-timeout: expected a number in (0, inf), got '0'"),
    (["--exec-timeout", "nan"], "argument --exec-timeout: expected a number in (0, inf), got 'nan'"),
    (["--data", "{surrogate}"], "{surrogate}:2: not UTF-8 text (surrogates not allowed)"),
]


def common_cases(model="--model", out=""):
    """Cases of every stage: seeds numpy refuses, a folder or file that is no model, and
    --out folders that must not be written (`out`: distill's file name in them)."""
    seed = "argument --seed: expected an integer in [0, 2147483647], got"
    return [(["--seed", "-1"], f"{seed} '-1'"), (["--seed", str(2**32)], f"{seed} '4294967296'"),
            ([model, "{empty_dir}"], f"argument {model}: {{empty_dir}}: not a model (a folder with config.json"),
            ([model, "{problems}"], f"argument {model}: {{problems}}: not a model (a folder with config.json"),
            (["--out", "{model_dir}" + out], "--out {model_dir} is a model or checkpoint folder ({model_dir}/config.json)"),
            (["--out", "{marked}" + out], "--out {marked} is a model or checkpoint folder ({marked}/args.json)"),
            (["--out", "{corrupt_run}" + out], "{corrupt_run}/args.json: not a JSON object (a damaged file?)")]


RESUME_CASES = [  # sft and grpo
    (["--resume", "{model_dir}"], "--resume {model_dir}: not a checkpoint directory (no trainer_state_rank0.pt; "),
    (["--resume", "{corrupt_ckpt}"], "{corrupt_ckpt}/args.json: not a JSON object"),
    (["--out", ""], "--out '': give a folder"),
    (["--out", "/dev/null"], "--out /dev/null: a file, not a folder"),
]
SAMPLER_CASES = [  # distill and evaluate
    (["--limit", "-1"], "argument --limit: expected an integer in [0, inf), got '-1'"),
    (["--temperature", "-1"], "argument --temperature: expected a number in [0, inf), got '-1'"),
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
    (["--batch-size", "0"], "argument --batch-size: expected an integer in [1, inf), got '0'"),
    (["--batch-size", "-2"], "argument --batch-size: expected an integer in [1, inf), got '-2'"),
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
    (["--max-num-seqs", "0"], "argument --max-num-seqs: expected an integer in [1, inf), got '0'"),
    (["--model", "no/such/model"], "argument --model: no/such/model: no such model folder or file"),
    (["--out", "{sft_run}"], "--out {sft_run} holds a run of sft.py ({sft_run}/args.json)"),
    (["--out", "{plain}"], "--out {plain}: a file, not a folder"),
    (["--out", ""], "--out '': give a folder"),
    (["--out", "/dev/null"], "--out /dev/null: a file, not a folder"),
    (["--k", "10000000"], "argument --k: expected an integer in [1, 65536], got '10000000'"),
] + common_cases(), ids=lambda c: " ".join(c[0]))
def test_evaluate_bad_input(case, files, tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "new")
    argv, msg = _argv(["--model", tiny_dir, "--data", files["problems"], "--out", out], case, files)
    assert msg in _refused(ev, argv, tmp_path, capsys, out)


@pytest.mark.parametrize("case", PROBLEM_CASES + [
    (["--prompts-per-step", "0"], "argument --prompts-per-step: expected an integer in [1, 65536], got '0'"),
    (["--max-num-seqs", "-1"], "argument --max-num-seqs: expected an integer in [0, inf), got '-1'"),
    (["--micro-batch", "0"], "argument --micro-batch: expected an integer in [1, inf), got '0'"),
    (["--updates-per-step", "0"], "argument --updates-per-step: expected an integer in [1, inf), got '0'"),
    (["--chunk-size", "0"], "argument --chunk-size: expected an integer in [1, inf), got '0'"),
    (["--group-size", "1"], "argument --group-size: expected an integer in [2, inf), got '1'"),
    (["--temperature", "0"], "argument --temperature: expected a number in (0, inf), got '0'"),
    (["--top-p", "0.9"], "--top-p 0.9: GRPO samples at top-p 1.0 (the paper's value): its loss takes each token's "
     "logprob over the whole vocabulary"),  # tests/faults.md G18
    (["--lr", "inf"], "argument --lr: expected a number in (0, inf), got 'inf'"),
    (["--model", "no/such/model"], "argument --model: no/such/model: no such model folder or file"),
    (["--out", "{sft_run}"], "--out {sft_run} holds a run of sft.py ({sft_run}/args.json)"),
    (["--out", "{plain}"], "--out {plain}: a file, not a folder"),
    (["--lr", "-1e-6"], "argument --lr: expected a number in (0, inf), got '-1e-6'"),
    (["--prompts-per-step", "100000000"], "argument --prompts-per-step: expected an integer in [1, 65536], got"),
    (["--drop-solved", "{all_solved}"], "--drop-solved {all_solved}: every problem of {problems} was solved"),
    (["--drop-solved", "{bad_rate}"], "{bad_rate}:1: not a pass-rate record (id, integers n and correct): {{'id'"),
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
    (["--epochs", "0"], "argument --epochs: expected an integer in [1, inf), got '0'"),
    (["--micro-batch", "0"], "argument --micro-batch: expected an integer in [1, inf), got '0'"),
    (["--global-batch", "0"], "argument --global-batch: expected an integer in [1, inf), got '0'"),
    (["--global-batch", "3", "--micro-batch", "2"], "--global-batch 3 is not a multiple of --micro-batch 2 x 1 ranks"),
    (["--chunk-size", "0"], "argument --chunk-size: expected an integer in [1, inf), got '0'"),
    (["--warmup", "1.5"], "argument --warmup: expected a number in [0, 1], got '1.5'"),
    (["--max-len", "0"], "argument --max-len: expected an integer in [1, inf), got '0'"),
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
    assert ex.grade("10^{23}", rows[0]["answer"])  # was graded wrong against "99999999999999991611392"
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


def test_evaluate_resume_refuses_another_k_or_limit(tiny_dir, tmp_path):
    data = _jsonl(tmp_path / "b.jsonl", PROBLEMS[:2])
    args = ev.parse_args(["--model", tiny_dir, "--data", data, "--out", str(tmp_path), "--k", "2",
                          "--max-num-seqs", "2"])
    benches = ev.read_benchmarks(args.data, args.limit)
    done = {("b", "q0", 0): {**PROBLEMS[0], "benchmark": "b", "sample_idx": 0}}
    (tmp_path / "args.json").write_text(json.dumps({"stage": "evaluate", **vars(args)}))
    ev.check_resume(args, str(tmp_path), done, benches)  # the same command resumes
    args.max_num_seqs = 5
    ev.check_resume(args, str(tmp_path), done, benches)  # and with more rows at once (changes no sample)
    for flag, value, saved in (("k", 3, 2), ("limit", 1, 0)):
        other = ev.parse_args(["--model", tiny_dir, "--data", data, "--out", str(tmp_path), "--k", "2",
                               f"--{flag.replace('_', '-')}", str(value)])
        with pytest.raises(ex.InputError, match=rf"made with --{flag.replace('_', '-')} {saved}, this run has {value}"):
            ev.check_resume(other, str(tmp_path), done, ev.read_benchmarks(other.data, other.limit))



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
    for module, folder in ((ev, final), (grpo, final), (sft, final), (ev, tiny_dir), (grpo, os.path.join(run, "step_000001"))):
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
    for flags, msg in ((["--data", other], "--data (sha256 of the file) '"), (["--mask-outputs"], "--mask-outputs False"),
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
    # a new --lr applies from the resumed step: step 2 at 5e-3 x cosine(1 of 2 steps) = 2.5e-3
    assert ex.cli(sft.main, resume + ["--lr", "5e-3"]) == 0
    assert [r["lr"] for r in ex.read_jsonl_tolerant(os.path.join(b, "log.jsonl"))] == [2.5e-3]


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
# 10) flags that would be ignored, --plot on a log without its fields, a full disk in torch.save


def test_evaluate_refuses_flags_it_would_ignore(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    for argv, msg in ((["--from-samples", str(tmp_path), "--k", "3"], "--k has no effect with --from-samples"),
                      (["--from-samples", str(tmp_path), "--out", "x"], "--out has no effect with --from-samples"),
                      (["--plot", str(tmp_path), "--from-samples", "x"], "--from-samples has no effect with --plot"),
                      (["--plot", str(tmp_path)], f"{tmp_path}/metrics.jsonl: a row without the field 'reward_mean'")):
        assert ex.cli(ev.main, argv) == 2
        assert capsys.readouterr().err == f"evaluate.py: error: {msg}" + ("\n" if "row" not in msg else
                                                                            " (not a grpo.py metrics log?)\n")
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


def test_a_utf8_bom_is_accepted(files, tmp_path, capsys):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + open(files["problems"], "rb").read())
    assert [p["id"] for p in ex.read_problems(str(bom))] == ["q0", "q1", "q2"]
    bom.write_bytes(b"\xef\xbb\xbf" + open(files["traj"], "rb").read())
    assert [row[1] for row in sft.read_trajectories(str(bom))] == [t["problem"] for t in TRAJ]
    code = tmp_path / "bom.py"
    code.write_bytes(b"\xef\xbb\xbfprint(6 * 7)\n")
    assert ex.cli(ex.main, [str(code)]) == 0
    assert capsys.readouterr().out == "42\n\n"  # (what the block printed, then print's newline)


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
