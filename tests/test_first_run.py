"""A newcomer's first run: the packaged model's tied head, live progress, the end-of-run
summary and `evaluate.py --show`. Tiny models and hand-made run folders only."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import evaluate as ev
import executor as ex
import grpo
import tiny
from test_engine import Scripted

pytestmark = pytest.mark.timeout(120)


def _untied(tok):
    """A tiny Qwen3 with separate embedding and head matrices, as the packaged GGUFs load."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    assert not torch.equal(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return model


# -----------------------------------------------------------------------------
# The tied head


def test_tie_output_head_keeps_the_head_copy_and_survives_a_checkpoint(tokenizer, tmp_path):
    model = _untied(tokenizer)
    head = model.get_output_embeddings().weight.detach().clone()
    n0 = sum(p.numel() for p in model.parameters())
    ex.tie_output_head(model)
    assert sum(p.numel() for p in model.parameters()) == n0 - head.numel()  # one (V, H) matrix fewer
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert torch.equal(model.get_input_embeddings().weight, head)
    ids = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.tie_word_embeddings
    assert back.get_input_embeddings().weight is back.get_output_embeddings().weight
    assert torch.equal(back.get_input_embeddings().weight, head)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, logits)


def test_load_model_ties_a_packaged_model_marked_tied_head(tokenizer, tmp_path, monkeypatch):
    _untied(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setitem(ex.PACKAGED_MODELS, "tiny-untied", dict(ex.PACKAGED_MODELS["qwen2.5-coder-0.5b"]))
    monkeypatch.setattr(ex, "packaged_model_path", lambda name: str(tmp_path))
    tied, _ = ex.load_model("tiny-untied")
    plain, _ = ex.load_model(str(tmp_path))  # a model directory is loaded as it is
    assert tied.get_input_embeddings().weight is tied.get_output_embeddings().weight
    assert torch.equal(tied.get_input_embeddings().weight, plain.get_output_embeddings().weight)
    assert plain.get_input_embeddings().weight is not plain.get_output_embeddings().weight
    assert (ex.PACKAGED_MODELS["qwen2.5-coder-0.5b"]["tied_head"]
            and ex.PACKAGED_MODELS["qwen2.5-coder-1.5b"]["tied_head"])


# -----------------------------------------------------------------------------
# Progress


def test_rollout_progress_counts_tokens_samples_blocks_and_errors(tokenizer):
    tok = tokenizer
    eos = tok.eos_token_id
    prompt = ex.build_prompt_ids(tok, "Divide, then add.")
    seg1 = tok.encode("Plan: try.\n```python\nprint(1 / 0)\n```", add_special_tokens=False)
    model = Scripted(tiny.make_model(tok), [prompt + seg1], eos)
    calls = []
    with ex.Sandbox(workers=1, timeout=5) as sb:
        s = ex.rollout(model, tok, [prompt], sb, temperature=0.0, progress=lambda t, d: calls.append((t, d)))[0]
        bar = ex.RolloutProgress(total=2, disable=True)
        ex.rollout(model, tok, [prompt, prompt], sb, temperature=0.0, progress=bar)
    assert [b["status"] for b in s.blocks] == ["error"]
    # one token per decode step, then EOS after the output block; the finished row last
    assert [t for t, d in calls if d is None] == [1] * (len(seg1) + 1)
    done = [d for t, d in calls if d is not None]
    assert len(done) == 1 and done[0].blocks == s.blocks
    assert (bar.done, bar.tokens, bar.blocks, bar.errors) == (2, 2 * (len(seg1) + 1), 2, 2)


def test_training_bar_counts_the_micro_batches_of_the_update(monkeypatch):
    bars, make_bar = [], ex.progress_bar
    monkeypatch.setattr(ex, "progress_bar", lambda **kw: bars.append(make_bar(**kw)) or bars[-1])
    tok = tiny.make_tokenizer()
    lm = tiny.make_model(tok).train()
    samples = [ex.Sample(prompt_ids=[5, 6], ids=[5, 6, 7 + i], roles=[ex.ROLE_PROMPT] * 2 + [ex.ROLE_MODEL],
                         logprobs=[float("nan")] * 2 + [-1.0]) for i in range(3)]
    grpo.update_policy(lm, torch.optim.SGD(lm.parameters(), lr=0.0), samples, torch.tensor([1.0, -1.0, 0.5]),
                       grpo.Dist(), micro_batch=1, progress="training")
    assert [(bar.desc, bar.n, bar.total) for bar in bars] == [("training", 3, 3)]


# -----------------------------------------------------------------------------
# The trajectory as text; the GRPO run's summary


RECORD = {"id": "p1", "problem": "How many integers up to 10 are even?", "answer": "5",
          "completion": "Count them.\n```python\nprint(len([n for n in range(1, 11) if n % 2 == 0]))\n```\n"
                        "```output\n5\n```\n\\boxed{5}",
          "blocks": [{"code": "print(len([n for n in range(1, 11) if n % 2 == 0]))\n", "output": "5\n",
                      "status": "ok"}],
          "pred": "5", "correct": True, "finish_reason": "stop", "model_tokens": 31, "reward": 1.0}


def test_format_trajectory_shows_plan_blocks_outputs_answer_and_reward():
    rule = "-" * 80
    assert ex.format_trajectory(RECORD) == "\n".join([
        "=" * 80, "problem p1: How many integers up to 10 are even?", rule, "plan:", "Count them.", rule,
        "block 1 (ok):", "print(len([n for n in range(1, 11) if n % 2 == 0]))", "output 1:", "5", rule,
        "after the last output:", "\\boxed{5}", rule,
        "answer '5' vs reference '5': correct, reward 1; 1 blocks, 31 model tokens, finish stop"])
    prose = dict(RECORD, completion="It is 5. \\boxed{5}", blocks=[], correct=False, pred=None)
    del prose["reward"]
    text = ex.format_trajectory(prose)
    assert "plan:\nIt is 5. \\boxed{5}\n" in text and "after the plan:\n(nothing)" in text
    assert text.endswith("answer None vs reference '5': wrong; 0 blocks, 31 model tokens, finish stop")


def test_format_trajectory_parses_with_split_completion_L31():
    """A plan that names a fence inside a line (no block starts there) is shown whole, as
    every stage's parser (`split_completion`) reads it; its own split at the first three
    backticks cut it to "Use " before."""
    comp = "Use ```python blocks.\n```python\nprint(5)\n```\n```output\n5\n```\n\\boxed{5}"
    text = ex.format_trajectory(dict(RECORD, completion=comp, blocks=[{"code": "print(5)\n", "output": "5\n",
                                                                       "status": "ok"}]))
    assert "plan:\nUse ```python blocks.\n" in text and "after the last output:\n\\boxed{5}\n" in text


def test_grpo_run_ends_with_a_trajectory_the_step_table_and_the_files(tiny_dir, tmp_path, capsys):
    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(2)))
    out = str(tmp_path / "run")
    grpo.main(["--model", tiny_dir, "--data", str(data), "--out", out, "--prompts-per-step", "2",
               "--group-size", "2", "--max-new-tokens", "3", "--exec-workers", "1", "--steps", "2",
               "--no-progress", "--no-save-optimizer"], reward_fn=lambda ss, ps: [float(s.ids[-1] % 2) for s in ss])
    text = capsys.readouterr().out
    assert "One trajectory of the last step (rank 0):" in text and "problem p" in text
    assert "| step | reward | accuracy | groups with signal |" in text
    assert "\n| 1 | " in text and "\n| 2 | " in text
    assert f"Files in {os.path.abspath(out)}:" in text
    state = torch.load(os.path.join(out, "latest", "trainer_state_rank0.pt"), weights_only=False)
    assert state["step"] == 2 and "optimizer" not in state and "optimizer_shard" not in state
    grpo.main(["--model", tiny_dir, "--data", str(data), "--out", out, "--prompts-per-step", "2",
               "--group-size", "2", "--max-new-tokens", "3", "--exec-workers", "1", "--steps", "3",
               "--no-progress", "--resume", os.path.join(out, "latest")], reward_fn=lambda ss, ps: [0.0] * len(ss))
    assert "holds no optimizer state (--no-save-optimizer): AdamW starts fresh" in capsys.readouterr().out
    assert [m["step"] for m in ex.read_jsonl_tolerant(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3]


# -----------------------------------------------------------------------------
# evaluate.py --show


def _sample_row(i, bench, correct, statuses):
    blocks = [{"code": f"x = {i}\nprint(x)\n\n# check\n", "output": f"{i}\n" if s == "ok" else "Error", "status": s}
              for s in statuses]
    comp = "Plan.\n" + "".join(f"```python\n{b['code']}```\n```output\n{b['output']}\n```\n" for b in blocks)
    return {"id": f"q{i}", "problem": f"Problem {i}?", "answer": str(i), "benchmark": bench, "sample_idx": 0,
            "completion": comp + f"\\boxed{{{i if correct else 0}}}", "pred": str(i if correct else 0),
            "correct": correct, "finish_reason": "stop", "blocks": blocks, "n_code_blocks": len(blocks),
            "n_exec_errors": sum(s != "ok" for s in statuses), "completion_tokens": 50, "model_tokens": 40,
            "plan_tokens": 2}


def _eval_folder(path):
    rows = [_sample_row(1, "b1", True, ["ok"]), _sample_row(2, "b1", True, ["error", "ok"]),
            _sample_row(3, "b1", False, ["error", "error"]), _sample_row(4, "b2", True, ["ok", "ok", "ok"])]
    path.mkdir()
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_show_prints_trajectories_with_blocks_and_outputs(tmp_path, capsys):
    rows = _eval_folder(tmp_path / "e")
    assert ex.cli(ev.main, ["--from-samples", str(tmp_path / "e"), "--show", "2"]) == 0
    text = capsys.readouterr().out
    shown = text[text.index("=" * 80):]
    assert shown == ex.format_trajectory(rows[0]) + "\n\n" + ex.format_trajectory(rows[1]) + "\n\n"
    assert "block 2 (ok):\nx = 2\nprint(x)\n\n# check\noutput 2:\n2\n" in shown
    assert "block 1 (error):" in shown and "problem q3" not in shown
