"""Forking for an ablation (tests/faults.md L10-L14, L20-L32): each common ablation is a
change in one named place, made here exactly as a forker makes it (a flag, or a replaced
function), and shown to take effect in a value computed by hand (the gradient, or a logged
metric). Each test fails when the step goes around the seam (hard-codes the reward, the
advantage, the loss, its normaliser, the samples in it or the bounds).

| ablation | the one place | test |
|---|---|---|
| another reward | `--reward FILE.py:FUNCTION` | test_another_reward_from_a_file_L10_L11 |
| token-level advantages | `grpo.compute_advantages` returning (N, T), `grpo.has_signal` | test_token_level_advantages |
| a batch-mean baseline | `grpo.compute_advantages`, `has_signal` | test_batch_mean_baseline_keeps_constant_groups_L12 |
| an added entropy term | `grpo.policy_loss` | test_entropy_bonus_in_the_loss_is_trained_and_logged_L13 |
| Dr. GRPO | `grpo.compute_advantages`, `grpo.loss_normalizer` | test_dr_grpo_L28 |
| KL to a reference policy | `grpo.policy_loss` (`ref_logprobs`, from `--model`) | test_kl_to_a_reference_policy_L29 |
| TIS | `--tis-cap` | test_tis_weights_each_token_L20 |
| DAPO overlong masking | `grpo.in_loss` | test_overlong_masking_keeps_zero_var_share_L21 |
| DAPO soft length penalty | `--reward` with `args` | test_soft_length_penalty_reads_the_run_flags_L23 |
| a TIR prompt, exemplars | `executor.SYSTEM_PROMPT`, `--exemplars` | test_tir_prompt_through_distill_and_sft_L30_L32 |
| other clip bounds | `--eps-low/--eps-high` with `--updates-per-step` >= 2 | test_clip_bounds_with_two_updates_L14 |
| stateful blocks | `--stateful` | test_stateful_blocks |
"""
import copy
import importlib.util
import json
import math
import os
import re
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import distill  # noqa: E402
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


def replay_step(lm, tokenizer, samples, reward, opt=None, flags=(), reference=None):
    """One grpo_step over `samples` (the rollout replays them), G = 2 over 2 problems,
    under grpo's command-line `flags`. Returns (metrics, the gradient of the first update,
    or the optimizer when one is given)."""
    args = make_args(*flags, prompts_per_step=2, group_size=2, micro_batch=8, grad_clip=0.0)
    opt = opt or GradCatcher(lm.parameters())
    replay = lambda *a, **k: [copy.deepcopy(s) for s in samples]  # noqa: E731
    m, _, _ = grpo.grpo_step(lm.train(), lm, tokenizer, opt, None, same_prompt_problems(2), args, grpo.Dist(), 1,
                             reward_fn=reward, rollout_fn=replay, reference=reference)
    return m, (opt.grads[0] if isinstance(opt, GradCatcher) and opt.grads else opt)


def alone(lm, s):
    """(T,) logprobs of sample s under lm, the sample alone (no padding), with grad."""
    ids = torch.tensor([s.ids])
    return sft.token_logprobs(lm, ids, torch.ones_like(ids))[0]


def reference_grad(lm, samples, token_advantages, entropy_coef=0.0, norm=N_TOKENS, extra=None):
    """The gradient of the loss at ratio 1, from each sample alone (no padding):
    -(1/norm) sum_i sum_{t: model token} (A_it dlogp_it + entropy_coef dH_it) plus
    extra(i, logprobs, mask) if given; norm by default the model tokens of all samples.
    token_advantages[i]: (len(samples[i].ids),)."""
    lm.zero_grad()
    total = 0.0
    for i, (s, a) in enumerate(zip(samples, token_advantages)):
        ids = torch.tensor([s.ids])
        logprobs, entropy = sft.token_logprobs(lm, ids, torch.ones_like(ids), return_entropy=True)  # (1, T) each
        mask = torch.tensor(s.roles) == ROLE_MODEL  # (T,)
        total = total - ((a * logprobs[0])[mask].sum() + entropy_coef * entropy[0][mask].sum()) / norm
        total = total + (extra(i, logprobs[0], mask) if extra else 0.0)
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
    # once, with the step's batch: the end-of-run summary does not call it again with one
    # sample (a reward that needs whole groups crashed there, tests/faults.md L27)
    assert len(calls) == 1 and sorted(calls[0]) == ["p0"] * 4 + ["p1"] * 4
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
    constant, so the paper's advantage would train on nothing; `has_signal` replaced to keep
    every group, as the advantage is not a function of the group's rewards): every sample is kept and
    the gradient is -(1/N) sum_i A_i dlogp of that token."""
    samples = fixed_samples(tokenizer)

    def first_token(samples, rewards, group_size):
        adv = torch.zeros(len(samples), max(len(s.ids) for s in samples))  # (N, T)
        for i, s in enumerate(samples):
            adv[i, len(s.prompt_ids)] = 1.0 if i % 2 == 0 else -1.0
        return adv

    monkeypatch.setattr(grpo, "compute_advantages", first_token)
    monkeypatch.setattr(grpo, "has_signal", lambda rewards, group_size: torch.ones(len(rewards) // group_size,
                                                                                     dtype=torch.bool))
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
    train); A = r - mean over the batch gives +0.5, +0.5, -0.5, -0.5 and, with `has_signal`
    replaced too (a constant group has signal under this baseline), trains every group with
    exactly that gradient."""
    samples, reward = fixed_samples(tokenizer), per_sample([1.0, 1.0, 0.0, 0.0])
    m, _ = replay_step(tiny.make_model(tokenizer), tokenizer, samples, reward)
    assert m["loss_tokens"] == 0 and m["zero_var_share"] == 1.0
    monkeypatch.setattr(grpo, "compute_advantages", lambda samples, rewards, group_size: rewards - rewards.mean())
    monkeypatch.setattr(grpo, "has_signal", lambda rewards, group_size: torch.ones(len(rewards) // group_size,
                                                                                     dtype=torch.bool))
    lm = tiny.make_model(tokenizer)
    m, grad = replay_step(lm, tokenizer, samples, reward)
    assert m["loss_tokens"] == N_TOKENS and m["zero_var_share"] == 0.0 and m["reward_mean"] == 0.5
    ref = reference_grad(lm, samples, [torch.full((len(s.ids),), a) for s, a in zip(samples, [.5, .5, -.5, -.5])])
    assert torch.allclose(grad, ref, atol=1e-6, rtol=0)


@pytest.mark.timeout(60)
def test_dr_grpo_drops_a_constant_group_L35(tokenizer, monkeypatch):
    """Dr. GRPO's `r - group mean` on a group of three rewards 0.1 is -1.39e-17, not 0: a
    signal test on the advantages kept that group (its 11 tokens diluted the token mean).
    `has_signal` tests the rewards: the group is dropped, zero_var_share 0.5, and the loss
    is the other group's alone, over its 9 tokens."""
    monkeypatch.setattr(grpo, "compute_advantages", lambda samples, rewards, group_size: (
        rewards.reshape(-1, group_size) - rewards.reshape(-1, group_size).mean(dim=1, keepdim=True)).reshape(-1))
    rewards = [0.1, 0.1, 0.1, 1.0, 0.0, 0.0]
    assert grpo.compute_advantages(None, torch.tensor(rewards, dtype=torch.float64), 3)[:3].ne(0).any()
    samples = [fake_sample(3, n, i, len(tokenizer)) for i, n in enumerate([4, 5, 2, 3, 2, 4])]
    args = make_args(prompts_per_step=2, group_size=3, micro_batch=8, grad_clip=0.0)
    lm = tiny.make_model(tokenizer)
    replay = lambda *a, **k: [copy.deepcopy(s) for s in samples]  # noqa: E731
    m, _, _ = grpo.grpo_step(lm.train(), lm, tokenizer, GradCatcher(lm.parameters()), None, same_prompt_problems(2),
                             args, grpo.Dist(), 1, reward_fn=per_sample(rewards), rollout_fn=replay)
    assert (m["zero_var_share"], m["loss_tokens"]) == (0.5, 9)


# -----------------------------------------------------------------------------
# Another loss: grpo.policy_loss (update_policy logs whatever metrics it returns)


@pytest.mark.timeout(60)
def test_entropy_bonus_in_the_loss_is_trained_and_logged_L13(tokenizer, monkeypatch):
    """policy_loss minus 0.1 x the token-mean entropy: the gradient gains exactly
    -0.1 dH / N, and the new metric is logged as 0.1 x the logged entropy."""
    coef, paper_loss = 0.1, grpo.policy_loss

    def with_entropy_bonus(logprobs, *, batch, normalizer, entropy, **kw):
        loss, metrics = paper_loss(logprobs, batch=batch, normalizer=normalizer, entropy=entropy, **kw)
        entropy_sum = torch.where(batch["loss_mask"], entropy, 0.0).sum()
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


# -----------------------------------------------------------------------------
# Dr. GRPO: no std in the advantage, the loss over a constant


@pytest.mark.timeout(60)
def test_dr_grpo_L28(tokenizer, monkeypatch):
    """Dr. GRPO (Liu et al. 2025) as a fork writes it: A = r - mean of the group (no std)
    and the loss summed over a constant, 100, not the 18 loss tokens. Rewards [1, 0], [0,
    1] give A = +-0.5 (the paper's would be +-1/sqrt 2): the gradient is -(1/100) sum A_i
    dlogp_i, and the logged loss, the token mean of -A at ratio 1, is -(0.5 x 4 - 0.5 x 6
    - 0.5 x 5 + 0.5 x 3) / 18 = 1/9 (the loss is logged, tests/faults.md L22)."""
    monkeypatch.setattr(grpo, "compute_advantages", lambda samples, rewards, group_size: (
        rewards.reshape(-1, group_size) - rewards.reshape(-1, group_size).mean(dim=1, keepdim=True)).reshape(-1))
    monkeypatch.setattr(grpo, "loss_normalizer", lambda tokens, world_size: 100.0 / world_size)
    samples = fixed_samples(tokenizer)
    lm = tiny.make_model(tokenizer)
    m, grad = replay_step(lm, tokenizer, samples, per_sample([1.0, 0.0, 0.0, 1.0]))
    assert m["loss_tokens"] == N_TOKENS and m["loss"] == pytest.approx(1 / 9, abs=1e-7)
    adv = [torch.full((len(s.ids),), a) for s, a in zip(samples, [0.5, -0.5, -0.5, 0.5])]
    ref = reference_grad(lm, samples, adv, norm=100.0)
    assert ref.abs().max() > 0 and torch.allclose(grad, ref, atol=1e-7, rtol=0)


# -----------------------------------------------------------------------------
# KL to a reference policy: grpo.policy_loss reads batch["ref_logprobs"]


@pytest.mark.timeout(60)
def test_kl_to_a_reference_policy_L29(tokenizer, monkeypatch):
    """A k3 KL penalty to a frozen reference policy (another random model here, so that the
    KL is not 0), added in policy_loss from the micro-batch's ref_logprobs and logged:
    kl_ref = (1/N) sum_t (exp(ref - logp) - (ref - logp) - 1) over the loss tokens, and the
    gradient gains 0.1 x the gradient of that sum / N, each computed here from each sample
    alone."""
    coef, paper_loss = 0.1, grpo.policy_loss

    def with_kl(logprobs, *, batch, normalizer, **kw):
        loss, metrics = paper_loss(logprobs, batch=batch, normalizer=normalizer, **kw)
        d = batch["ref_logprobs"] - logprobs  # (B, T)
        k3 = torch.where(batch["loss_mask"], torch.exp(d) - d - 1.0, 0.0)  # (B, T)
        metrics["kl_ref"] = k3.sum().detach() / metrics["tokens"].clamp(min=1)
        return loss + coef * k3.sum() / normalizer, metrics

    monkeypatch.setattr(grpo, "policy_loss", with_kl)
    samples, reward = fixed_samples(tokenizer), per_sample([1.0, 0.0, 0.0, 1.0])
    lm, reference = tiny.make_model(tokenizer), tiny.make_model(tokenizer, seed=1).requires_grad_(False)
    m, grad = replay_step(lm, tokenizer, samples, reward, reference=reference)
    kl = 0.0
    with torch.no_grad():
        for s in samples:
            d = alone(reference, s) - alone(lm, s)
            kl += float(torch.where(torch.tensor(s.roles) == ROLE_MODEL, d.exp() - d - 1, 0.0).sum())
    assert kl > 1e-3 and m["kl_ref"] == pytest.approx(kl / N_TOKENS, rel=1e-5)

    def k3_term(i, logprobs, mask):
        d = alone(reference, samples[i]).detach() - logprobs
        return coef * torch.where(mask, d.exp() - d - 1, 0.0).sum() / N_TOKENS

    a = 2 ** -0.5
    adv = [torch.full((len(s.ids),), x) for s, x in zip(samples, [a, -a, -a, a])]
    ref, without = reference_grad(lm, samples, adv, extra=k3_term), reference_grad(lm, samples, adv)
    assert (ref - without).abs().max() > 1e-4 and torch.allclose(grad, ref, atol=1e-6, rtol=0)


# -----------------------------------------------------------------------------
# TIS: --tis-cap


@pytest.mark.timeout(60)
def test_tis_weights_each_token_L20(tokenizer):
    """Sampler logprobs shifted by hand from the trainer's: sample 1's by +log 4 (weight
    pi_old / pi_sampler = 1/4), sample 2's by -log 3 (weight 3, capped at 2), samples 3 and
    4 unshifted (weight 1). The gradient is the paper's with each token's advantage times
    its weight; the logged mean weight is (4 x 0.25 + 6 x 2 + 5 + 3) / 18 = 21/18 and the
    capped share 6/18. With --tis-cap 0 the shifts change nothing."""
    samples = fixed_samples(tokenizer)
    lm = tiny.make_model(tokenizer)
    for s, shift in zip(samples, [math.log(4.0), -math.log(3.0), 0.0, 0.0]):
        with torch.no_grad():
            lp = (alone(lm, s) + shift).tolist()
        s.logprobs = [x if r == ROLE_MODEL else float("nan") for x, r in zip(lp, s.roles)]
    reward = per_sample([1.0, 0.0, 0.0, 1.0])
    m, grad = replay_step(lm, tokenizer, samples, reward, flags=("--tis-cap", "2"))
    assert m["tis_weight"] == pytest.approx(21 / 18, abs=1e-5) and m["tis_capped"] == pytest.approx(6 / 18, abs=1e-7)
    a = 2 ** -0.5
    adv = [torch.full((len(s.ids),), x * w) for s, x, w in zip(samples, [a, -a, -a, a], [0.25, 2.0, 1.0, 1.0])]
    assert torch.allclose(grad, reference_grad(lm, samples, adv), atol=1e-6, rtol=0)
    m0, grad0 = replay_step(lm, tokenizer, samples, reward, flags=("--tis-cap", "0"))
    plain = [torch.full((len(s.ids),), x) for s, x in zip(samples, [a, -a, -a, a])]
    assert "tis_weight" not in m0 and torch.allclose(grad0, reference_grad(lm, samples, plain), atol=1e-6, rtol=0)


# -----------------------------------------------------------------------------
# DAPO: overlong masking (grpo.in_loss) and the soft length penalty (--reward with args)


@pytest.mark.timeout(60)
def test_overlong_masking_keeps_zero_var_share_L21(tokenizer, monkeypatch):
    """DAPO's overlong filter: sample 2 (6 tokens) ended on the length budget and leaves
    the loss; its group keeps its signal. Loss tokens 18 - 6 = 12, zero_var_share 0 (both
    groups have signal; a mask folded into "group has signal" made it 0.5 or dropped the
    group), and the gradient is -(1/12) sum A_i dlogp_i over samples 1, 3 and 4."""
    monkeypatch.setattr(grpo, "in_loss", lambda samples, advantages: torch.tensor(
        [s.finish_reason != "length" for s in samples]))
    samples = fixed_samples(tokenizer)
    samples[1].finish_reason = "length"
    lm = tiny.make_model(tokenizer)
    m, grad = replay_step(lm, tokenizer, samples, per_sample([1.0, 0.0, 0.0, 1.0]))
    assert (m["loss_tokens"], m["zero_var_share"], m["groups"]) == (12, 0.0, 2)
    a = 2 ** -0.5
    kept = [samples[0], samples[2], samples[3]]
    ref = reference_grad(lm, kept, [torch.full((len(s.ids),), x) for s, x in zip(kept, [a, -a, a])], norm=12)
    assert torch.allclose(grad, ref, atol=1e-6, rtol=0)


SOFT_PENALTY = '''
def soft_overlong(samples, problems, args):
    """DAPO's soft overlong punishment, 0 up to max_new_tokens - 4 model tokens, then down
    to -1 linearly over the last 4."""
    budget, cache = args.max_new_tokens, 4
    return [min(0.0, (budget - cache - s.n_model_tokens) / cache) for s in samples]
'''


@pytest.mark.timeout(60)
def test_soft_length_penalty_reads_the_run_flags_L23(tokenizer, tmp_path):
    """A reward file whose function takes the run's `args`: with --max-new-tokens 6 and a
    cache of 4, lengths 4, 6, 5, 3 score (2 - L) / 4 = -0.5, -1, -0.75, -0.25, so the logged
    mean reward is -0.625 (exact in binary)."""
    (tmp_path / "penalty.py").write_text(SOFT_PENALTY)
    reward = grpo.load_reward(f"{tmp_path / 'penalty.py'}:soft_overlong")
    m, _ = replay_step(tiny.make_model(tokenizer), tokenizer, fixed_samples(tokenizer), reward,
                       flags=("--max-new-tokens", "6"))
    assert m["reward_mean"] == -0.625 and m["loss_tokens"] == N_TOKENS


# -----------------------------------------------------------------------------
# A TIR prompt (prose between blocks) and its exemplars: executor.SYSTEM_PROMPT, --exemplars

TIR_PROMPT = "Solve the problem. Reason in words between Python blocks.\nEnd with \\boxed{answer}."
TIR = ("Add them.\n```python\nprint(2 + 2)\n```\n```output\n4\n```\nThe sum is 4; check by counting.\n"
       "```python\nprint(len([1, 1, 1, 1]))\n```\n```output\n4\n```\nBoth say 4.\n\\boxed{4}")


@pytest.mark.timeout(60)
def test_tir_prompt_through_distill_and_sft_L30_L32(tokenizer, tmp_path, monkeypatch):
    """A fork replaces the prompt's text (executor.py imports with a 2-line prompt, and the
    --stateful one is unchanged) and the exemplars (prose between blocks): distill reads
    them, its prompt is the new text then the exemplar, and SFT trains the prose between
    blocks as model tokens while the two output blocks (tokenised alone) are outputs."""
    src = open(ex.__file__).read()
    forked = re.sub(r'SYSTEM_PROMPT = """.*?"""', lambda _: f"SYSTEM_PROMPT = {TIR_PROMPT!r}", src, count=1, flags=re.S)
    (tmp_path / "executor_tir.py").write_text(forked)
    spec = importlib.util.spec_from_file_location("executor_tir", tmp_path / "executor_tir.py")
    spec.loader.exec_module(mod := importlib.util.module_from_spec(spec))
    assert mod.SYSTEM_PROMPT == TIR_PROMPT and mod.SYSTEM_PROMPT_STATEFUL == ex.SYSTEM_PROMPT_STATEFUL
    monkeypatch.setattr(ex, "SYSTEM_PROMPT", TIR_PROMPT)
    (tmp_path / "tir.jsonl").write_text(json.dumps({"id": "t0", "problem": "2 + 2?", "answer": "4", "completion": TIR}))
    exemplars = distill.load_exemplars(str(tmp_path / "tir.jsonl"))
    prompt = tokenizer.decode(ex.stage_prompt_ids(tokenizer, "3 + 3?", exemplars=exemplars))
    assert prompt.index(TIR_PROMPT) < prompt.index("The sum is 4; check by counting.") < prompt.index("3 + 3?")
    example = sft.build_example(tokenizer, "2 + 2?", TIR, ["4", "4"])
    roles, ids = torch.tensor(example["roles"]), torch.tensor(example["ids"])
    model_text = tokenizer.decode(ids[roles == ROLE_MODEL].tolist())
    assert "The sum is 4; check by counting." in model_text and "Both say 4." in model_text
    outputs = ids[roles == ex.ROLE_OUTPUT].tolist()
    block = ex.encode_text(tokenizer, "```output\n4\n```\n")
    assert outputs in (block * 2, (ex.encode_text(tokenizer, "\n```output\n4\n```\n")) * 2)


def test_one_step_reads_in_at_most_800_code_lines():
    """The walk of one GRPO step (tests/benchmarks/walk.list: every definition a default step
    enters from grpo.py main, down to executor.py's Internals line, Sandbox.run read as its
    interface) stays within 800 code lines, and every name in the list still exists (a
    renamed definition fails here, not silently)."""
    spec = importlib.util.spec_from_file_location("walk", os.path.join(HERE, "benchmarks", "walk.py"))
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    rows = walk.walk()
    read = [r for r in rows if walk.WAYS["to the line"](r)]
    assert {r[2] for r in rows} >= {"main", "grpo_step", "rollout", "policy_loss", "update_policy", "Sandbox.run"}
    assert sum(r[3] for r in read) <= 800
    # the line is where executor.py says: rollout and the KV cache its mask arithmetic needs
    # above it, the grouped attention kernel below it
    below = {r[2] for r in rows if r[5]}
    assert "_grouped_sdpa" in below and not below & {"rollout", "_Row", "_kv_cache", "_forward_chunk", "_compact"}
