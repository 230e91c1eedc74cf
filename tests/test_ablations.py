"""Forking for an ablation (tests/faults.md L10-L14): each common ablation is a change in
one named place, made here exactly as a forker makes it (a flag, or a replaced function),
and shown to take effect in a value computed by hand (the gradient, or a logged metric).
Each test fails when the step goes around the seam (hard-codes the reward, the
advantage, the loss or the bounds).

| ablation | the one place | test |
|---|---|---|
| another reward | `--reward FILE.py:FUNCTION` | test_another_reward_from_a_file_L10_L11 |
| token-level advantages | `grpo.compute_advantages` returning (N, T) | test_token_level_advantages |
| a batch-mean baseline | `grpo.compute_advantages` | test_batch_mean_baseline_keeps_constant_groups_L12 |
| an added entropy (or KL) term | `grpo.policy_loss` | test_entropy_bonus_in_the_loss_is_trained_and_logged_L13 |
| other clip bounds | `--eps-low/--eps-high` with `--updates-per-step` >= 2 | test_clip_bounds_with_two_updates_L14 |
| stateful blocks | `--stateful` | test_stateful_blocks |
"""
import copy
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import executor as ex  # noqa: E402
import grpo  # noqa: E402
import sft  # noqa: E402
import tiny  # noqa: E402
from executor import ROLE_MODEL  # noqa: E402
from test_grpo import GradCatcher, ScriptedPolicy, _cli, _write_problems, fake_sample, make_args  # noqa: E402

LENGTHS = [4, 6, 5, 3]  # model tokens of 4 fixed samples: 2 groups of G = 2
N_TOKENS = sum(LENGTHS)


def same_prompt_problems(n):
    """n problems with one text (their prompts are equally long, so a rollout wave keeps
    their order) and different ids."""
    return [{"id": f"p{i}", "problem": "What is 6 times 7?", "answer": "42"} for i in range(n)]


def replay_step(lm, tokenizer, samples, reward, opt=None, flags=()):
    """One grpo_step over `samples` (the rollout replays them), G = 2 over 2 problems,
    under grpo's command-line `flags`. Returns (metrics, the gradient of the first update,
    or the optimizer when one is given)."""
    args = make_args(*flags, prompts_per_step=2, group_size=2, micro_batch=8, grad_clip=0.0)
    opt = opt or GradCatcher(lm.parameters())
    replay = lambda *a, **k: [copy.deepcopy(s) for s in samples]  # noqa: E731
    m, _, _ = grpo.grpo_step(lm.train(), lm, tokenizer, opt, None, same_prompt_problems(2), args, grpo.Dist(), 1,
                             reward_fn=reward, rollout_fn=replay)
    return m, (opt.grads[0] if isinstance(opt, GradCatcher) and opt.grads else opt)


def reference_grad(lm, samples, token_advantages, entropy_coef=0.0):
    """The gradient of the loss at ratio 1, from each sample alone (no padding):
    -(1/N) sum_i sum_{t: model token} (A_it dlogp_it + entropy_coef dH_it), N the model
    tokens of all samples. token_advantages[i]: (len(samples[i].ids),)."""
    lm.zero_grad()
    total = 0.0
    for s, a in zip(samples, token_advantages):
        ids = torch.tensor([s.ids])
        logprobs, entropy = sft.token_logprobs(lm, ids, torch.ones_like(ids), return_entropy=True)  # (1, T) each
        mask = torch.tensor(s.roles) == ROLE_MODEL  # (T,)
        total = total - ((a * logprobs[0])[mask].sum() + entropy_coef * entropy[0][mask].sum()) / N_TOKENS
    total.backward()
    grad = torch.cat([p.grad.flatten() for p in lm.parameters()])
    lm.zero_grad()
    return grad


def fixed_samples(tokenizer):
    return [fake_sample(3, n, i, len(tokenizer)) for i, n in enumerate(LENGTHS)]


def per_sample(values):
    """A batch reward giving samples[i] values[i]."""
    return lambda samples, problems: list(values)


# -----------------------------------------------------------------------------
# Another reward: --reward FILE.py:FUNCTION


REWARD_FILE = '''
import json, os


def by_problem(samples, problems):
    """1 for every sample of problem p0, else 0; logs the ids it was called with."""
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps([p["id"] for p in problems]) + "\\n")
    return [1.0 if p["id"] == "p0" else 0.0 for p in problems]


def not_finite(samples, problems):
    return [float("nan") if p["id"] == "p1" else 1.0 for p in problems]
'''


@pytest.mark.timeout(120)
def test_another_reward_from_a_file_L10_L11(tiny_dir, tmp_path, capsys):
    """The flag's function decides every reward of the step (nothing in 3 tokens is boxed,
    so the built-in reward would give 0): p0's 4 samples score 1 and p1's 0, so the logged
    mean is 4 / 8 and both groups are constant (no signal)."""
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    data = str(tmp_path / "probs.jsonl")
    _write_problems(data, 2)
    out = str(tmp_path / "o")
    grpo.main(_cli(tiny_dir, data, out, "--steps", "1", "--reward", f"{tmp_path / 'my_reward.py'}:by_problem"))
    [m] = ex.read_jsonl_tolerant(os.path.join(out, "metrics.jsonl"))
    assert (m["reward_mean"], m["accuracy"], m["zero_var_share"], m["loss_tokens"]) == (0.5, 0.0, 1.0, 0)
    rates = {r["id"]: r["reward"] for r in ex.read_jsonl_tolerant(os.path.join(out, "pass_rates.jsonl"))}
    assert rates == {"p0": 4.0, "p1": 0.0}
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert len(calls) == 2 and sorted(calls[0]) == ["p0"] * 4 + ["p1"] * 4  # the step's batch, then the summary's
    capsys.readouterr()
    # a NaN reward stops the run with one line naming the problem, before any step is logged
    bad = str(tmp_path / "bad")
    assert ex.cli(grpo.main, _cli(tiny_dir, data, bad, "--steps", "1", "--reward",
                                  f"{tmp_path / 'my_reward.py'}:not_finite")) == 2
    err = capsys.readouterr().err
    assert err == "grpo.py: error: reward nan for a sample of problem 'p1': rewards must be finite\n"
    assert not os.path.exists(os.path.join(bad, "metrics.jsonl"))
    # a missing file or function is refused before the model loads
    assert ex.cli(grpo.main, _cli(tiny_dir, data, bad, "--reward", f"{tmp_path / 'my_reward.py'}:nope")) == 2
    assert "--reward" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# Another advantage: grpo.compute_advantages


@pytest.mark.timeout(60)
def test_token_level_advantages(tokenizer, monkeypatch):
    """A (N, T) advantage of +1 / -1 on the first model token of each sample only (rewards
    constant, so the paper's advantage would train on nothing): every sample is kept and
    the gradient is -(1/N) sum_i A_i dlogp of that token."""
    samples = fixed_samples(tokenizer)

    def first_token(samples, rewards, group_size):
        adv = torch.zeros(len(samples), max(len(s.ids) for s in samples))  # (N, T)
        for i, s in enumerate(samples):
            adv[i, len(s.prompt_ids)] = 1.0 if i % 2 == 0 else -1.0
        return adv

    monkeypatch.setattr(grpo, "compute_advantages", first_token)
    lm = tiny.make_model(tokenizer)
    m, grad = replay_step(lm, tokenizer, samples, per_sample([0.0] * 4))
    assert m["loss_tokens"] == N_TOKENS and m["zero_var_share"] == 0.0
    want = []
    for i, s in enumerate(samples):
        a = torch.zeros(len(s.ids))
        a[len(s.prompt_ids)] = 1.0 if i % 2 == 0 else -1.0
        want.append(a)
    ref = reference_grad(lm, samples, want)
    assert ref.abs().max() > 0 and torch.allclose(grad, ref, atol=1e-6, rtol=0)


@pytest.mark.timeout(60)
def test_batch_mean_baseline_keeps_constant_groups_L12(tokenizer, monkeypatch):
    """Rewards [1, 1] and [0, 0]: the paper's group advantage drops both groups (nothing to
    train); A = r - mean over the batch gives +0.5, +0.5, -0.5, -0.5, keeps every group and
    trains with exactly that gradient."""
    samples, reward = fixed_samples(tokenizer), per_sample([1.0, 1.0, 0.0, 0.0])
    m, _ = replay_step(tiny.make_model(tokenizer), tokenizer, samples, reward)
    assert m["loss_tokens"] == 0 and m["zero_var_share"] == 1.0
    monkeypatch.setattr(grpo, "compute_advantages", lambda samples, rewards, group_size: rewards - rewards.mean())
    lm = tiny.make_model(tokenizer)
    m, grad = replay_step(lm, tokenizer, samples, reward)
    assert m["loss_tokens"] == N_TOKENS and m["zero_var_share"] == 0.0 and m["reward_mean"] == 0.5
    ref = reference_grad(lm, samples, [torch.full((len(s.ids),), a) for s, a in zip(samples, [.5, .5, -.5, -.5])])
    assert torch.allclose(grad, ref, atol=1e-6, rtol=0)


# -----------------------------------------------------------------------------
# Another loss: grpo.policy_loss (update_policy logs whatever metrics it returns)


@pytest.mark.timeout(60)
def test_entropy_bonus_in_the_loss_is_trained_and_logged_L13(tokenizer, monkeypatch):
    """policy_loss minus 0.1 x the token-mean entropy: the gradient gains exactly
    -0.1 dH / N, and the new metric is logged as 0.1 x the logged entropy."""
    coef, paper_loss = 0.1, grpo.policy_loss

    def with_entropy_bonus(logprobs, old_logprobs, advantages, loss_mask, eps_low=0.20, eps_high=0.28,
                           normalizer=None, entropy=None):
        loss, metrics = paper_loss(logprobs, old_logprobs, advantages, loss_mask, eps_low, eps_high, normalizer,
                                   entropy)
        entropy_sum = torch.where(loss_mask, entropy, 0.0).sum()
        metrics["entropy_bonus"] = coef * entropy_sum.detach() / metrics["tokens"].clamp(min=1)
        return loss - coef * entropy_sum / normalizer, metrics

    monkeypatch.setattr(grpo, "policy_loss", with_entropy_bonus)
    samples = fixed_samples(tokenizer)
    lm = tiny.make_model(tokenizer)
    m, grad = replay_step(lm, tokenizer, samples, per_sample([1.0, 0.0, 0.0, 1.0]))
    assert m["loss_tokens"] == N_TOKENS
    assert m["entropy_bonus"] == pytest.approx(coef * m["entropy"], rel=1e-6) and m["entropy"] > 0
    a = 2 ** -0.5  # (r - mean) / unbiased std of [1, 0] and [0, 1]
    adv = [torch.full((len(s.ids),), x) for s, x in zip(samples, [a, -a, -a, a])]
    ref, without = reference_grad(lm, samples, adv, coef), reference_grad(lm, samples, adv)
    assert (ref - without).abs().max() > 1e-4  # the bonus moves the gradient measurably
    assert torch.allclose(grad, ref, atol=1e-6, rtol=0)


# -----------------------------------------------------------------------------
# Other clip bounds: --eps-low / --eps-high, which act only with --updates-per-step >= 2


class SnapshotSGD(torch.optim.SGD):
    """SGD that keeps a copy of the weights after each step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.weights = []

    def step(self, closure=None):
        super().step(closure)
        self.weights.append([p.detach().clone() for g in self.param_groups for p in g["params"]])


def clip_counts(before, after, samples, adv, eps_low, eps_high):
    """(low, high) clipped-token counts of `samples` between two policies, by hand."""
    low = high = 0
    for s, a in zip(samples, adv):
        ids = torch.tensor([s.ids])
        with torch.no_grad():
            r = torch.exp(sft.token_logprobs(after, ids, torch.ones_like(ids))[0]
                          - sft.token_logprobs(before, ids, torch.ones_like(ids))[0])  # (T,)
        mask = torch.tensor(s.roles) == ROLE_MODEL
        low += int((mask & (r < 1 - eps_low)).sum()) if a < 0 else 0
        high += int((mask & (r > 1 + eps_high)).sum()) if a > 0 else 0
    return low, high


@pytest.mark.timeout(120)
def test_clip_bounds_with_two_updates_L14(tokenizer, tiny_dir, tmp_path, capsys):
    """With 2 updates a step, mini-batch 2 (samples 3 and 4) sees the policy after update
    1: the logged clip fractions are its tokens outside [1 - eps_low, 1 + eps_high] (in the
    advantage's direction) over all loss tokens, counted by hand, and they move with the
    flags. With 1 update (the default) a run with other bounds says that they do nothing."""
    samples, reward = fixed_samples(tokenizer), per_sample([1.0, 0.0, 0.0, 1.0])
    a = 2 ** -0.5
    start = tiny.make_model(tokenizer)
    logged, by_hand = {}, {}
    for eps in ((0.20, 0.28), (0.02, 0.02)):
        lm = copy.deepcopy(start)
        m, opt = replay_step(lm, tokenizer, samples, reward, SnapshotSGD(lm.parameters(), lr=1.0),
                             ("--updates-per-step", "2", "--eps-low", str(eps[0]), "--eps-high", str(eps[1])))
        after = copy.deepcopy(start)
        for p, w in zip(after.parameters(), opt.weights[0]):
            p.data.copy_(w)
        assert m["optimizer_steps"] == 2 and m["loss_tokens"] == N_TOKENS
        low, high = clip_counts(start, after, samples[2:], [-a, a], *eps)
        logged[eps], by_hand[eps] = (m["clip_frac_low"], m["clip_frac_high"]), (low / N_TOKENS, high / N_TOKENS)
        assert logged[eps] == pytest.approx(by_hand[eps], abs=1e-6)
    assert by_hand[0.02, 0.02] != by_hand[0.20, 0.28] and sum(by_hand[0.02, 0.02]) > 0
    data = str(tmp_path / "probs.jsonl")
    _write_problems(data, 2)
    warning = "--eps-low / --eps-high change nothing with --updates-per-step 1"
    grpo.main(_cli(tiny_dir, data, str(tmp_path / "k1"), "--steps", "0", "--eps-high", "0.5"))
    assert warning in capsys.readouterr().out
    grpo.main(_cli(tiny_dir, data, str(tmp_path / "k2"), "--steps", "0", "--eps-high", "0.5",
                   "--updates-per-step", "2"))
    grpo.main(_cli(tiny_dir, data, str(tmp_path / "k0"), "--steps", "0"))
    assert warning not in capsys.readouterr().out


# -----------------------------------------------------------------------------
# Stateful blocks: --stateful


@pytest.fixture(scope="module")
def sandbox():
    with ex.Sandbox(workers=2, timeout=5) as sb:
        yield sb


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stateful", [True, False])
def test_stateful_blocks(tokenizer, model, sandbox, stateful):
    """A policy that defines x in block 1 and prints it in block 2: with --stateful the
    step's prompt is the stateful one and block 2 prints 42 (0 errors a sample); without,
    block 2 raises NameError (1 error a sample)."""
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    policy = ScriptedPolicy(model.config, [enc("Plan: define x, then print it.\n```python\nx = 6 * 7\n```"),
                                           enc("\n```python\nprint(x)\n```"),
                                           enc("\n\\boxed{42}") + [tokenizer.eos_token_id]])
    args = make_args(*(["--stateful"] if stateful else []), prompts_per_step=1, group_size=2, max_new_tokens=200)
    prob = {"id": "s0", "problem": "What is 6 times 7?", "answer": "42"}
    lm = copy.deepcopy(model).train()
    m, _, samples = grpo.grpo_step(lm, policy, tokenizer, torch.optim.SGD(lm.parameters(), lr=0.0), sandbox, [prob],
                                   args, grpo.Dist(), 1)
    assert samples[0].prompt_ids == ex.stage_prompt_ids(tokenizer, prob["problem"], stateful=stateful)
    assert (ex.SYSTEM_PROMPT_STATEFUL in tokenizer.decode(samples[0].prompt_ids)) == stateful
    assert [len(s.blocks) for s in samples] == [2, 2] and m["tool_calls_per_sample"] == 2.0
    assert m["exec_errors_per_sample"] == (0.0 if stateful else 1.0)
    assert (samples[0].blocks[1]["output"].strip() == "42") == stateful


@pytest.mark.timeout(120)
def test_another_prompt_reaches_every_stage(tokenizer, model, sandbox, monkeypatch):
    """A prompt ablation replaces `executor.stage_prompt_ids`, the one function every stage
    builds its prompt with: the GRPO step's rollouts and SFT's examples then both start with
    the new prompt's ids, and the SFT example is the new prompt followed by the same
    completion ids as before."""
    original = ex.stage_prompt_ids
    marker = "Answer in code only, please."

    def my_prompt(tokenizer, problem, stateful=False, exemplars=(), **kw):
        return original(tokenizer, marker + "\n" + problem, stateful, exemplars, **kw)

    completion = "Plan: add.\n```python\nprint(2 + 2)\n```\n```output\n4\n```\n\\boxed{4}"
    before = sft.build_example(tokenizer, "What is 2 + 2?", completion, ["4"])
    monkeypatch.setattr(ex, "stage_prompt_ids", my_prompt)
    after = sft.build_example(tokenizer, "What is 2 + 2?", completion, ["4"])
    new_prompt = my_prompt(tokenizer, "What is 2 + 2?")
    n_old = len(original(tokenizer, "What is 2 + 2?"))
    assert after["ids"][:len(new_prompt)] == new_prompt
    assert after["ids"][len(new_prompt):] == before["ids"][n_old:]
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    policy = ScriptedPolicy(model.config, [enc("\\boxed{4}") + [tokenizer.eos_token_id]])
    args = make_args(prompts_per_step=1, group_size=2, max_new_tokens=50)
    prob = {"id": "q0", "problem": "What is 2 + 2?", "answer": "4"}
    lm = copy.deepcopy(model).train()
    _, _, samples = grpo.grpo_step(lm, policy, tokenizer, torch.optim.SGD(lm.parameters(), lr=0.0), sandbox, [prob],
                                   args, grpo.Dist(), 1)
    assert [s.prompt_ids for s in samples] == [new_prompt, new_prompt]
    assert marker in tokenizer.decode(samples[0].prompt_ids)
