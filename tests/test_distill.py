"""distill.py: the four-rule filter at its boundaries, the exemplars (re-executed and
replayed through the engine), the 3-shot prompt, and the CLI with resume after a kill."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import distill
import executor as ex
import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXEMPLARS = os.path.join(ROOT, "data", "exemplars.jsonl")


@pytest.fixture(scope="module")
def exemplars():
    return distill.load_exemplars(EXEMPLARS)


@pytest.fixture(scope="module")
def sandbox():
    with ex.Sandbox(workers=2, timeout=10) as sb:
        yield sb


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def good_record(**kw):
    """A hand-built row that passes every rule; kw overrides fields."""
    row = dict(id="p1", problem="q", answer="42", pred="42", finish_reason="stop",
               completion="Plan.\n```python\nprint(42)\n```\n```output\n42\n```\n\\boxed{42}",
               blocks=[{"code": "print(42)\n", "output": "42\n", "status": "ok"}] * 3,
               n_code_blocks=3, plan_tokens=10, completion_tokens=100)
    row.update(kw)
    return row


# -----------------------------------------------------------------------------
# Filter rules at their boundaries (hand-built rows)

@pytest.mark.timeout(20)
def test_rule_boundaries():
    f = distill.filter_reasons
    assert f(good_record()) == []
    # (iii) 2 blocks rejected, 3 kept
    two = [{"code": "1\n", "output": "", "status": "ok"}] * 2
    assert f(good_record(blocks=two, n_code_blocks=2)) == ["few_blocks"]
    # (iv) plan share exactly 0.5 rejected, just below kept
    assert f(good_record(plan_tokens=50, completion_tokens=100)) == ["long_plan"]
    assert f(good_record(plan_tokens=49, completion_tokens=100)) == []
    assert f(good_record(plan_tokens=0, completion_tokens=0)) == ["long_plan"]
    # (ii) an error only in the last block; every non-ok status counts
    for status in ("error", "timeout", "memory", "killed"):
        blocks = ([{"code": "1\n", "output": "", "status": "ok"}] * 3
                  + [{"code": "1/0\n", "output": "E", "status": status}])
        assert f(good_record(blocks=blocks, n_code_blocks=4)) == ["exec_error"], status
    # (i) the answer only in an output block: the model's own pred is None
    only_out = ("Plan.\n```python\nprint('\\\\boxed{42}')\n```\n```output\n\\boxed{42}\n```\n"
                "The code printed the answer.")
    assert f(good_record(completion=only_out, pred=None)) == ["incorrect"]
    assert f(good_record(pred="41")) == ["incorrect"]
    # departure 1: a budget ending is rejected unless allowed; reasons come in RULES order
    assert f(good_record(finish_reason="length")) == ["unfinished"]
    assert f(good_record(finish_reason="tool_budget"), require_stop=False) == []
    bad = good_record(pred=None, blocks=two[:1], n_code_blocks=1, plan_tokens=60, finish_reason="length")
    assert f(bad) == ["incorrect", "few_blocks", "long_plan", "unfinished"]


@pytest.mark.timeout(20)
def test_summary_counts_and_shares():
    kept = [dict(good_record(), sample_idx=0)]
    rej = [dict(good_record(pred=None), reasons=["incorrect"]),
           dict(good_record(pred=None, n_code_blocks=1), reasons=["incorrect", "few_blocks"])]
    s = distill.summarize(kept, rej)
    assert s["trajectories"] == 3 and s["kept"] == 1 and s["acceptance_rate"] == pytest.approx(1 / 3)
    assert s["failed"]["incorrect"] == {"count": 2, "share": pytest.approx(2 / 3)}
    assert s["failed"]["few_blocks"]["count"] == 1 and s["failed"]["exec_error"]["count"] == 0
    assert s["only_failed"]["incorrect"] == 1
    assert s["mean_blocks"] == pytest.approx(7 / 3) and s["mean_plan_share"] == pytest.approx(0.1)


# -----------------------------------------------------------------------------
# Engine-level: scripted model, real sandbox

class Scripted(torch.nn.Module):
    """Forces one scripted id sequence (one row): at position p it puts all mass on
    script[p + 1] (EOS past the end). No network runs (the KV cache stays empty): these
    tests check what the engine writes around the model's text, and stay fast."""

    def __init__(self, base, script, eos_id):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the engine reads the device from here
        self.script, self.eos_id = script, eos_id
        self.config, self.generation_config = base.config, base.generation_config

    def forward(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep):
        logits = torch.zeros(input_ids.shape[0], 1, self.config.vocab_size)
        for b in range(input_ids.shape[0]):
            p = int(position_ids[b, -1])
            logits[b, 0, self.script[p + 1] if p + 1 < len(self.script) else self.eos_id] = 100.0
        return types.SimpleNamespace(logits=logits)


def script_ids(tok, prompt, completion):
    """Prompt + the ids the engine produces for an exemplar-format completion: each model
    segment (ending at a closing fence) encoded alone, then the environment's output chunk."""
    plan, blocks, final = distill.split_completion(completion)
    ids, lead = list(prompt), plan
    for code, out in blocks:
        ids += enc(tok, f"{lead}```python\n{code}```") + enc(tok, f"\n```output\n{out}\n```\n")
        lead = ""
    return ids + enc(tok, final) + [tok.eos_token_id]


@pytest.mark.timeout(30)
def test_answer_printed_only_by_code_is_not_the_models(tokenizer, sandbox):
    base = tiny.make_model(tokenizer)
    problem = {"id": "p", "problem": "What is 6 times 7?", "answer": "42"}
    prompt = ex.build_prompt_ids(tokenizer, problem["problem"])
    code = 'print("\\\\boxed{42}")\n'
    for final, want in (("Done.", ["incorrect"]), ("\\boxed{42}", [])):
        comp = "M.\n" + "".join(f"```python\n{code}```\n```output\n\\boxed{{42}}\n```\n" for _ in range(3)) + final
        model = Scripted(base, script_ids(tokenizer, prompt, comp), tokenizer.eos_token_id)
        s = ex.rollout(model, tokenizer, [prompt], sandbox, temperature=0.0, max_context=2000)[0]
        assert s.text == comp and [b["output"] for b in s.blocks] == ["\\boxed{42}\n"] * 3
        row = ex.sample_record(problem, s)
        assert distill.filter_reasons(row) == want, (final, row["pred"])


@pytest.mark.timeout(40)
def test_exemplars_replay_through_engine(tokenizer, exemplars, sandbox):
    """A model that writes exactly an exemplar's model text gets exactly the exemplar back
    from the engine: same fences, same output blocks (from the real sandbox), same answer,
    and the trajectory passes the filter."""
    base = tiny.make_model(tokenizer)
    for e in exemplars:
        prompt = ex.build_prompt_ids(tokenizer, e["problem"])
        script = script_ids(tokenizer, prompt, e["completion"])
        model = Scripted(base, script, tokenizer.eos_token_id)
        s = ex.rollout(model, tokenizer, [prompt], sandbox, temperature=0.0, max_context=len(script) + 10)[0]
        assert s.text == e["completion"], e["id"]
        assert s.ids == script and s.pred == e["answer"] and s.finish_reason == "stop"
        row = ex.sample_record(e, s)
        assert distill.filter_reasons(row) == [], e["id"]


# -----------------------------------------------------------------------------
# Exemplars and the teacher prompt

@pytest.mark.timeout(20)
def test_exemplars_well_formed(tokenizer, exemplars):
    assert len(exemplars) == 3 and len({e["problem"] for e in exemplars}) == 3
    for e in exemplars:
        plan, blocks, final = distill.split_completion(e["completion"])
        # joined back in the engine's exact format, the parts give the exemplar back
        joined = "".join(f"```python\n{code}```\n```output\n{out}\n```\n" for code, out in blocks)
        assert plan + joined + final == e["completion"]
        assert e["answer"].isdigit() and final == f"\\boxed{{{e['answer']}}}"
        assert len(blocks) >= 3 and any("assert " in code for code, _ in blocks)
        assert plan.strip() and "```" not in plan
        assert ex.extract_answer(e["completion"]) == e["answer"]
        # the final answer was printed by a block before it was written (code-grounded)
        assert any(e["answer"] in out for _, out in blocks)
        assert len(enc(tokenizer, plan)) / len(enc(tokenizer, e["completion"])) < 0.5
    with pytest.raises(ValueError):
        distill.split_completion("Plan.\n```python\n1\n```\n```output\n\n```\nprose\n```python\n2\n```\n")


@pytest.mark.timeout(30)
def test_exemplar_outputs_are_what_the_sandbox_prints(exemplars, sandbox):
    for e in exemplars:
        _, blocks, _ = distill.split_completion(e["completion"])
        results = sandbox.run_many([code for code, _ in blocks])
        for i, ((code, recorded), res) in enumerate(zip(blocks, results)):
            assert res.status == "ok", (e["id"], i, res.output)
            assert res.output.rstrip("\n") == recorded, (e["id"], i)


@pytest.mark.timeout(20)
def test_prompt_round_trips_through_chat_template(tokenizer, exemplars):
    problem = "How many primes are below 30?"
    ids = ex.stage_prompt_ids(tokenizer, problem, exemplars=exemplars)
    msgs = [{"role": "system", "content": ex.SYSTEM_PROMPT}]
    for e in exemplars:
        msgs += [{"role": "user", "content": e["problem"]}, {"role": "assistant", "content": e["completion"]}]
    msgs.append({"role": "user", "content": problem})
    rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    text = tokenizer.decode(ids)
    assert text == rendered and ids == enc(tokenizer, rendered)
    assert text.count(ex.SYSTEM_PROMPT) == 1
    for e in exemplars:
        assert text.count(e["completion"]) == 1 and text.count(e["problem"]) == 1
        assert f"<|im_start|>assistant\n{e['completion']}<|im_end|>" in text
    assert text.endswith(f"<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n")


# -----------------------------------------------------------------------------
# CLI: tiny model, three problems, a kill (simulated) and a resume

def cli(tiny_dir, data, out, *extra):
    return ([sys.executable, os.path.join(ROOT, "distill.py"), "--teacher", tiny_dir, "--data", data,
             "--out", out, "--samples-per-problem", "2", "--max-new-tokens", "24", "--max-context", "8000",
             "--max-tool-calls", "2", "--exec-workers", "1", *extra],
            dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))


def strict_rows(path):
    """Every line of a JSONL parsed strictly (no torn line tolerated); [] if no file."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.endswith("\n") or not text  # (an empty file: the run holds its lock on it, tests/faults.md B16)
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.timeout(55)
def test_cli_tiny_model_resume_after_kill(tiny_dir, tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(3)))
    out = str(tmp_path / "traj.jsonl")
    rej, summ = str(tmp_path / "traj.rejected.jsonl"), str(tmp_path / "traj.summary.json")
    teacher = str(tmp_path / "teacher")  # a copy of the tiny model, deleted before step 3
    shutil.copytree(tiny_dir, teacher)
    # 1) a run killed (SIGKILL) as soon as its first batch is on disk, then a torn line as
    # a kill in the middle of a write would leave it
    cmd, env = cli(teacher, str(data), out, "--batch-size", "1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None and not (strict_rows(out) or strict_rows(rej)):
            time.sleep(0.05)
    finally:
        proc.kill()
        err = proc.communicate()[1]
    assert proc.returncode in (0, -signal.SIGKILL), err[-3000:]
    before = {p: open(p).read() if os.path.exists(p) else "" for p in (out, rej)}
    assert 0 < sum(len(strict_rows(p)) for p in before) <= 6
    with open(rej, "a") as f:
        f.write('{"id": "q2", "sample_idx": 0, "complet')
    # 2) resume on all three problems: nothing repeated, nothing missing, no torn line
    cmd, env = cli(teacher, str(data), out, "--batch-size", "2")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=45)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torn" in r.stderr
    for p, text in before.items():  # earlier lines are kept as they were
        assert open(p).read().startswith(text) if os.path.exists(p) else text == ""
    kept, rejected = strict_rows(out), strict_rows(rej)
    keys = sorted((row["id"], row["sample_idx"]) for row in kept + rejected)
    assert keys == [(f"q{i}", j) for i in range(3) for j in range(2)]
    fields = {"id", "problem", "answer", "completion", "pred", "correct", "finish_reason", "n_code_blocks",
              "n_exec_errors", "completion_tokens", "plan_tokens", "blocks", "seed", "sample_idx", "plan_share"}
    for row in kept + rejected:
        assert fields <= row.keys()
        assert row["finish_reason"] in ("stop", "length", "tool_budget")
    assert all(distill.filter_reasons(row) == [] for row in kept)
    assert all(row["reasons"] and row["reasons"] == distill.filter_reasons(row) for row in rejected)
    s = json.load(open(summ))
    assert s["trajectories"] == 6 and s["kept"] == len(kept) and s["rejected"] == len(rejected)
    assert s["args"]["samples_per_problem"] == 2
    assert set(s["failed"]) == set(distill.RULES)
    # 3) a run with nothing left to sample only rewrites the summary: the teacher is not
    # even loaded (a folder with only a config.json would fail to load; a missing or empty one
    # is refused at parse time)
    os.remove(summ)
    shutil.rmtree(teacher)
    os.makedirs(teacher)
    with open(os.path.join(teacher, "config.json"), "w") as f:
        f.write("{}")
    cmd, env = cli(teacher, str(data), out)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=45)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(summ))["trajectories"] == 6 and strict_rows(out) == kept
    # 4) other sampling settings would mix two distributions in one file: refused
    cmd, env = cli(teacher, str(data), out, "--temperature", "0.01")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=45)
    assert r.returncode != 0 and "traj.args.json: the trajectories" in r.stderr
    assert "--temperature 0.6, this run has 0.01" in r.stderr


@pytest.mark.timeout(60)
def test_plan_share_under_a_thinking_template(sandbox):
    """Qwen3-Thinking-like template: the generation prompt opens a think block and the
    trajectory is written inside it, so prose reasoning there before the first block is
    plan (rule iv rejects a long one), while `</think>` before the answer is neither plan
    nor prose after the plan. The rows come from the engine (a scripted policy)."""
    import evaluate
    import sft
    from test_engine import Scripted
    tok, _ = tiny.make_family_tokenizer("qwen3_thinking")
    problem = {"id": "p", "problem": "What is 6 times 7?", "answer": "42"}
    prompt = ex.build_prompt_ids(tok, problem["problem"])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    blocks = "```python\nprint(6 * 7)\n```\n```output\n42\n```\n" * 3
    for plan, want in (("Multiply.\n", []), ("Let me reason in words. " * 30 + "\n", ["long_plan"])):
        completion = plan + blocks + "</think>\n\n\\boxed{42}"
        script = sft.build_example(tok, problem["problem"], completion, outputs=["42\n"] * 3)["ids"]
        s = ex.rollout(Scripted(tiny.make_model(tok), [script], tok.eos_token_id), tok, [prompt], sandbox,
                       temperature=0.0, max_context=4000)[0]
        row = ex.sample_record(problem, s)
        assert s.text == completion and row["plan_tokens"] == len(enc(tok, plan))
        assert distill.filter_reasons(row) == want, distill.plan_share(row)
        assert evaluate.prose_after_plan(completion) == ""
