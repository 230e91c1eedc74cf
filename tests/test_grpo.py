"""GRPO: advantages, the token-level clipped loss, masking, the step, resume and ranks
(tests/faults.md L1-L10, D1-D4), and a toy task the loop must learn.

The 2-rank cases run this file as a `torchrun --nproc_per_node 2` worker (gloo, CPU) once
per session, with a timeout so that a hang fails the test instead of the run.
"""
import copy
import itertools
import inspect
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import executor as ex  # noqa: E402
import grpo  # noqa: E402
import sft  # noqa: E402
import tiny  # noqa: E402
from executor import ROLE_MODEL, ROLE_OUTPUT, ROLE_PROMPT, Sample  # noqa: E402

# -----------------------------------------------------------------------------
# Helpers (shared with the torchrun worker at the bottom)


def make_args(*extra, **kw):
    """grpo's flags for a tiny CPU run: argparse's defaults, then the sizes below, then the
    command-line flags `extra`, then keywords `kw` (dashes as _). A flag given in `extra` is
    never overwritten by the sizes below; one given both ways is an error."""
    base = {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4, "micro_batch": 4,
            "max_num_seqs": 0, "lr": 1e-2, "save_every": 0,
            "tis_cap": 0.0}  # fake_sample's sampler logprobs are made up (-1.0): TIS is tested on its own
    argv = ["--out", "unused"] + list(extra)  # the default --data (a parse checks that it exists)
    args = grpo.parse_args(argv)
    flags = {a[2:].split("=")[0].replace("-", "_") for a in extra if a.startswith("--")}
    assert not flags & set(kw), f"given as a flag and as a keyword: {flags & set(kw)}"
    for k, v in {**base, **kw}.items():
        if k not in flags:
            setattr(args, k, v)
    return args


def loss_batch(advantages, mask, sampler_logprobs=None):
    """The micro-batch fields `policy_loss` reads; sampler logprobs default to NaN (for tis_cap=0: TIS off)."""
    nan = torch.full(mask.shape, float("nan"))
    return {"advantages": advantages, "loss_mask": mask, "sampler_logprobs": nan if sampler_logprobs is None
            else sampler_logprobs}


def problems(n):
    return [{"id": f"p{i}", "problem": f"Problem {i}: what is {i} plus {i + 1}?", "answer": str(2 * i + 1)}
            for i in range(n)]


def each(reward):
    """A batch reward (grpo's signature: samples, problems -> floats) from one of a sample."""
    return lambda samples, problems: [reward(s, p) for s, p in zip(samples, problems)]


def first_token_reward(sample, problem):
    """Toy reward a random policy can raise: the first completion token is in a fixed set
    (ids divisible by 8, about 1/8 of the vocabulary)."""
    comp = sample.ids[len(sample.prompt_ids):]
    return float(bool(comp) and comp[0] % 8 == 0)


def fake_sample(n_prompt, n_model, seed, vocab):
    """A Sample with n_prompt prompt tokens and n_model model tokens (ids random)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_prompt + n_model,), generator=g).tolist()
    roles = [ROLE_PROMPT] * n_prompt + [ROLE_MODEL] * n_model
    lps = [float("nan")] * n_prompt + [-1.0] * n_model
    return Sample(prompt_ids=ids[:n_prompt], ids=ids, roles=roles, logprobs=lps, blocks=[], finish_reason="stop")


class GradCatcher:
    """An optimizer stand-in: step() records the flattened gradient instead of updating."""

    def __init__(self, params):
        self.params = list(params)
        self.param_groups = [{"lr": 0.0}]
        self.grads = []

    def step(self):
        self.grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                     for p in self.params]).clone())

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


L2_LENGTHS, L2_ADV = [1, 1, 1, 97], [1.0, -0.5, 0.25, -1.0]


def l2_grad(lm, samples, adv, micro, d=None):
    """Gradient of one GRPO update over `samples` with micro-batch `micro` on this rank."""
    d = d or grpo.Dist()
    model = lm if d.world_size == 1 else sft.wrap_model(lm, d.device)
    opt = GradCatcher(model.parameters())
    out = grpo.update_policy(model, opt, samples, torch.tensor(adv), d, micro_batch=micro, grad_clip=0.0)
    assert out["optimizer_steps"] == 1
    return opt.grads[0]


def per_prompt_rollout(policy, tokenizer, prompts, sandbox, *, n, seed, **kw):
    """The real sampler, called once per prompt with a seed taken from the prompt: samples
    that do not depend on how prompts are split over ranks (for the 2-rank == 1-rank test)."""
    out = []
    for p in prompts:
        out += ex.rollout(policy, tokenizer, [p], sandbox, n=n, seed=sum(p) % 100_003, **kw)
    return out


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in sft.unwrap_model(model).parameters()])


def run_steps(lm, tok, args, probs, n_steps, reward_fn, sandbox, rollout_fn=ex.rollout, d=None, stream=None,
              opt_fn=None):
    d = d or grpo.Dist()
    policy = copy.deepcopy(lm).eval()
    model = lm.train() if d.world_size == 1 else sft.wrap_model(lm, d.device)
    opt = (opt_fn or (lambda ps: torch.optim.AdamW(ps, lr=args.lr)))(model.parameters())
    stream = stream or grpo.PromptStream(probs, args.seed, d.rank, d.world_size)
    out = []
    for step in range(1, n_steps + 1):
        grpo.sync_policy(model, policy)
        m, rec, _ = grpo.grpo_step(model, policy, tok, opt, sandbox, stream.next(args.prompts_per_step), args, d, step,
                                   reward_fn=reward_fn and each(reward_fn), rollout_fn=rollout_fn)
        out.append((m, rec))
    return model, out


@pytest.fixture(scope="module")
def sandbox():
    with ex.Sandbox(workers=2, timeout=5) as sb:
        yield sb


# -----------------------------------------------------------------------------
# Advantages and loss (pure)


@pytest.mark.timeout(10)
def test_group_advantages_L3():
    r = torch.tensor([1., 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0])
    a = grpo.group_advantages(r, 4)
    assert a[:8].tolist() == [0.0] * 8
    assert torch.allclose(a[8:], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-7)
    assert grpo.group_advantages(torch.tensor([1.0]), 1).tolist() == [0.0]
    assert grpo.group_advantages(torch.tensor([0.3, 0.7]), 1).tolist() == [0.0, 0.0]
    # equal non-integer rewards: exactly 0 (no tiny-std blow-up), never NaN
    a = grpo.group_advantages(torch.tensor([0.1] * 3 + [0.7, 0.1, 0.1]), 3)
    assert a[:3].tolist() == [0.0] * 3 and torch.isfinite(a).all()


@pytest.mark.timeout(10)
def test_policy_loss_values_and_gradients_L4():
    cases = [(1.5, 1, -1.28, True), (1.25, 1, -1.25, False), (0.5, 1, -0.5, False), (0.5, -1, 0.8, True),
             (0.79, -1, 0.8, True), (1.5, -1, 1.5, False), (1.0, 1, -1.0, False), (1.0, -1, 1.0, False)]
    for r, A, want, clipped in cases:
        lp = torch.tensor([[math.log(r)]], requires_grad=True)
        loss, m = grpo.policy_loss(lp, batch=loss_batch(torch.tensor([float(A)]), torch.ones(1, 1, dtype=torch.bool)),
                                   old_logprobs=torch.zeros(1, 1), eps_low=0.2, eps_high=0.28, tis_cap=0.0)
        loss.backward()
        assert loss.item() == pytest.approx(want, abs=1e-6), (r, A)
        assert (lp.grad.item() == 0.0) == clipped, (r, A, lp.grad)
        assert m["clip_frac_low"].item() == float(clipped and A < 0)
        assert m["clip_frac_high"].item() == float(clipped and A > 0)


@pytest.mark.timeout(10)
def test_token_level_weights_L1():
    lp = torch.zeros(2, 1000, requires_grad=True)
    mask = torch.zeros(2, 1000, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :] = True
    old = torch.where(mask, torch.zeros(2, 1000), torch.full((2, 1000), float("nan")))
    loss, m = grpo.policy_loss(lp, batch=loss_batch(torch.tensor([1.0, -1.0]), mask), old_logprobs=old, tis_cap=0.0)
    loss.backward()
    # the objective's weight of every valid token is A_i / 1010 (the loss gradient is its negative)
    assert torch.allclose(lp.grad[0, :10], torch.full((10,), -1 / 1010))
    assert torch.allclose(lp.grad[1], torch.full((1000,), 1 / 1010))
    assert (lp.grad[0, 10:] == 0).all() and m["tokens"].item() == 1010


@pytest.mark.timeout(60)
def test_gradient_independent_of_micro_batching_L2(tokenizer):
    V = len(tokenizer)
    samples = [fake_sample(3, n, i, V) for i, n in enumerate(L2_LENGTHS)]
    g4 = l2_grad(tiny.make_model(tokenizer), samples, L2_ADV, micro=4)
    g1 = l2_grad(tiny.make_model(tokenizer), samples, L2_ADV, micro=1)
    assert g4.abs().max() > 0
    assert torch.allclose(g4, g1, atol=1e-6, rtol=0)


@pytest.mark.timeout(10)
def test_defaults_have_no_hidden_terms_L8():
    args = grpo.parse_args(["--out", "y"])
    assert (args.group_size, args.prompts_per_step, args.eps_low, args.eps_high) == (8, 128, 0.20, 0.28)
    assert (args.temperature, args.lr, args.updates_per_step) == (1.0, 1e-6, 1)
    assert (args.max_context, args.max_tool_calls, args.steps) == (16384, 20, 280)
    assert args.tis_cap == 2.0  # TIS, the one weight on the paper's loss (grpo.py departure 4)
    # no other term, whatever a flag is named: under the defaults' values, with the sampler's
    # logprobs equal to pi_old (weight 1), the loss is the clipped surrogate alone
    torch.manual_seed(0)
    lp, old = torch.randn(3, 7), torch.randn(3, 7)
    adv, mask = torch.randn(3), torch.rand(3, 7) > 0.3
    ent = torch.rand(3, 7) * 5
    flags = {k: getattr(args, k) for k in ("eps_low", "eps_high", "tis_cap")}  # the defaults' values
    l1, m1 = grpo.policy_loss(lp, batch=loss_batch(adv, mask, old), old_logprobs=old, entropy=ent, **flags)
    l0, _ = grpo.policy_loss(lp, batch=loss_batch(adv, mask), old_logprobs=old, tis_cap=0.0)
    r = torch.exp(lp - old)
    ref = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.28) * adv[:, None])[mask].sum() / mask.sum()
    assert l1.item() == l0.item() == pytest.approx(ref.item(), abs=1e-6)  # entropy is a metric, not a term
    assert {"loss", "clip_frac_low", "clip_frac_high", "approx_kl", "entropy"} <= set(m1)
    assert m1["loss"].item() == pytest.approx(ref.item(), abs=1e-6)  # the loss is logged


@pytest.mark.timeout(10)
def test_function_defaults_are_the_command_line_defaults_L33():
    """A forker who calls `update_policy` or `policy_loss` from Python trains as grpo.py does:
    every default they share with a flag is the flag's (TIS on at 2.0; it was off)."""
    args = grpo.parse_args(["--out", "y"])
    for fn in (grpo.update_policy, grpo.policy_loss):
        defaults = {n: p.default for n, p in inspect.signature(fn).parameters.items()
                    if hasattr(args, n) and p.default is not inspect.Parameter.empty}
        assert defaults == {n: getattr(args, n) for n in defaults}, fn.__name__
        assert defaults["tis_cap"] == 2.0


# -----------------------------------------------------------------------------
# Ids end to end, masking (a scripted policy through the real sampler and sandbox)


class ScriptedPolicy(torch.nn.Module):
    """Emits fixed model segments through the real `executor.rollout`. Every row writes the
    same text, so the next token depends only on the row's position: segment k starts
    after the k-th multi-token feed (the prompt, then each output block; a feed the engine
    cut into several forwards counts once). Rows may pause
    for their blocks at different times and leave the batch in any order.
    `fed[p]` is the token fed at position p (the same in every row, or a test fails)."""

    def __init__(self, config, segments):
        super().__init__()
        self.config, self.segments = config, segments
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.fed, self.next, self.starts = {}, {}, []

    def forward(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep):
        B, L = input_ids.shape
        real = attention_mask[:, -L:].bool()  # (B, L)
        logits = torch.full((B, 1, self.config.vocab_size), -1e4)
        for b in range(B):
            for p, t in zip(position_ids[b][real[b]].tolist(), input_ids[b][real[b]].tolist()):
                assert self.fed.setdefault(p, t) == t, (p, t, self.fed[p])
            q = int(position_ids[b, -1])  # position of the row's last real token
            if not real[b].any():  # a row waiting on its block
                continue
            if real[b].sum() > 1 and q not in self.starts:  # after the prompt or an output block
                if self.starts and int(position_ids[b][real[b]][0]) == self.starts[-1] + 1:
                    self.starts.pop()  # the rest of a feed the engine cut (executor.FEED_CHUNK)
                self.next.update({q + j: t for j, t in enumerate(self.segments[len(self.starts)])})
                self.starts.append(q)
            logits[b, 0, self.next[q]] = 0.0
        return types.SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def scripted(tokenizer, model, sandbox):
    """One prompt, G = 2 identical samples: plan + a block printing \\boxed{42}, its output
    block, then prose without any boxed answer, then EOS."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    seg1 = enc("Plan: print it.\n```python\nprint('\\\\boxed{42}')\n```")
    seg2 = enc("\nThe printed value is the result.") + [tokenizer.eos_token_id]
    policy = ScriptedPolicy(model.config, [seg1, seg2])
    prob = {"id": "s0", "problem": "What is 6 times 7?", "answer": "42"}
    prompt = ex.build_prompt_ids(tokenizer, prob["problem"])
    samples = ex.rollout(policy, tokenizer, [prompt], sandbox, n=2, max_new_tokens=200, seed=0)
    return types.SimpleNamespace(policy=policy, samples=samples, prompt=prompt, seg1=seg1, seg2=seg2, prob=prob)


@pytest.mark.timeout(60)
def test_trainer_ids_are_the_sampler_ids_L6(tokenizer, scripted):
    s = scripted.samples[0]
    assert s.blocks and "\\boxed{42}" in s.blocks[0]["output"], s.blocks
    out_ids = tokenizer.encode("\n```output\n" + s.blocks[0]["output"].rstrip("\n") + "\n```\n",
                               add_special_tokens=False)
    assert s.ids == scripted.prompt + scripted.seg1 + out_ids + scripted.seg2
    assert s.roles == ([ROLE_PROMPT] * len(scripted.prompt) + [ROLE_MODEL] * len(scripted.seg1)
                       + [ROLE_OUTPUT] * len(out_ids) + [ROLE_MODEL] * len(scripted.seg2))
    fed = scripted.policy.fed
    assert [fed[p] for p in range(len(fed))] == s.ids[:-1]  # what the sampler fed is what the
    # trainer sees (EOS is never fed)
    b = grpo.make_batch([s, scripted.samples[1]], torch.tensor([1.0, -1.0]), tokenizer.pad_token_id)
    assert b["input_ids"][0].tolist() == s.ids
    assert b["loss_mask"][0].tolist() == [r == ROLE_MODEL for r in s.roles]


@pytest.mark.timeout(60)
def test_step_trains_on_engine_ids_with_outputs_masked_L6_L7(tokenizer, model, scripted, sandbox):
    """grpo_step with the scripted policy: the trainer's forward sees exactly the sampled
    ids, the loss counts model tokens only, and the output block's \\boxed{42} earns 0."""
    s = scripted.samples[0]
    assert s.pred is None and grpo.answer_reward([s], [scripted.prob]) == [0.0]
    lm = copy.deepcopy(model).train()
    seen = []
    h = lm.model.register_forward_pre_hook(lambda mod, a, kw: seen.append((kw["input_ids"], kw["attention_mask"])),
                                           with_kwargs=True)
    replay = lambda *a, **k: [copy.deepcopy(x) for x in scripted.samples]  # noqa: E731
    alternate = itertools.cycle([1.0, 0.0])
    args = make_args(prompts_per_step=1, group_size=2)
    stream = grpo.PromptStream([scripted.prob], 0)
    m, rec, _ = grpo.grpo_step(lm, scripted.policy, tokenizer, torch.optim.SGD(lm.parameters(), lr=0.0),
                               sandbox, stream.next(1), args, grpo.Dist(), 1,
                               reward_fn=each(lambda smp, p: next(alternate)), rollout_fn=replay)
    h.remove()
    ids, attn = seen[0]
    for row, mask in zip(ids, attn):
        assert row[mask.bool()].tolist() == s.ids
    assert m["loss_tokens"] == 2 * s.n_model_tokens
    assert m["tool_calls_per_sample"] == 1 and m["accuracy"] == 0.0 and rec[0]["correct"] == 0


@pytest.mark.timeout(60)
def test_reward_reads_the_models_own_answer_L7(tokenizer, model, scripted, sandbox):
    s = scripted.samples[0]
    assert s.pred is None and grpo.answer_reward([s], [scripted.prob]) == [0.0]  # \\boxed{42} only in the output
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    own = ScriptedPolicy(model.config,
                         [scripted.seg1, enc("\nSo the answer is \\boxed{42}") + [tokenizer.eos_token_id]])
    [s2] = ex.rollout(own, tokenizer, [scripted.prompt], sandbox, n=1, max_new_tokens=200, seed=0)
    assert s2.pred == "42" and grpo.answer_reward([s2], [scripted.prob]) == [1.0]


@pytest.mark.timeout(30)
def test_tis_gradient_by_hand_L20():
    """Two tokens, A = 1, ratio 1: pi_old = 0.5 and 0.2 against sampler probabilities 0.25
    and 0.8 give weights min(2, 1.5) = 1.5 (capped) and 0.25; the loss -(1.5 + 0.25) / 2,
    its gradient -(1.5, 0.25) / 2 = (-0.75, -0.125); mean weight 0.875, capped share 0.5.
    Shifting the sampler's logprobs used to leave the gradient bit-identical."""
    lp = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    sampler = torch.tensor([[math.log(0.25), math.log(0.8)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = grpo.policy_loss(lp, batch=loss_batch(torch.tensor([1.0]), mask, sampler), old_logprobs=lp.detach(),
                               tis_cap=1.5)
    loss.backward()
    assert loss.item() == pytest.approx(-0.875, abs=1e-7)
    assert lp.grad[0].tolist() == pytest.approx([-0.75, -0.125], abs=1e-7)
    assert (m["tis_weight"].item(), m["tis_capped"].item()) == pytest.approx((0.875, 0.5), abs=1e-7)


@pytest.mark.timeout(60)
def test_rewards_in_float64_and_a_patched_executor_rollout_L24_L25(tokenizer, monkeypatch):
    """executor.rollout replaced by a replay of 4 fixed samples reaches grpo_step (it was
    bound at import: the real sampler ran). A reward of 1.1 is recorded as 1.1, not
    1.100000023841858 (float32), and the step's mean is (1.1 + 0 + 0 + 1) / 4 in float64."""
    samples = [fake_sample(3, n, i, len(tokenizer)) for i, n in enumerate([2, 3, 2, 1])]
    calls = []
    monkeypatch.setattr(ex, "rollout", lambda *a, **k: calls.append(k["n"]) or [copy.deepcopy(s) for s in samples])
    args = make_args(prompts_per_step=2, group_size=2)
    lm = tiny.make_model(tokenizer).train()
    m, rec, _ = grpo.grpo_step(lm, lm, tokenizer, GradCatcher(lm.parameters()), None, problems(2), args, grpo.Dist(),
                               1, reward_fn=lambda smp, prb: [1.1, 0.0, 0.0, 1.0])
    assert calls == [2] and [r["reward"] for r in rec] == [1.1, 1.0] and json.dumps(rec[0]["reward"]) == "1.1"
    assert m["reward_mean"] == (1.1 + 0.0 + 0.0 + 1.0) / 4


@pytest.mark.timeout(10)
def test_make_args_keeps_the_flags_it_is_given_L26():
    """A flag given to make_args is the run's: --micro-batch 2 and --max-new-tokens 9 were
    silently overwritten by its tiny-run sizes (4 and 4); one given twice is refused."""
    args = make_args("--micro-batch", "2", "--max-new-tokens=9", group_size=3)
    assert (args.micro_batch, args.max_new_tokens, args.group_size, args.lr) == (2, 9, 3, 1e-2)
    with pytest.raises(AssertionError, match="micro_batch"):
        make_args("--micro-batch", "2", micro_batch=3)


@pytest.mark.timeout(30)
def test_nan_old_logprobs_do_not_leak_L7(tokenizer, scripted):
    short = fake_sample(3, 2, 0, len(tokenizer))  # gives the batch a padded row
    b = grpo.make_batch([scripted.samples[0], short], torch.tensor([1.0, -1.0]), tokenizer.pad_token_id)
    old = b["sampler_logprobs"]  # NaN at prompt, output-block and pad positions
    assert old[~b["loss_mask"]].isnan().all() and not old[b["loss_mask"]].isnan().any()
    lp = torch.where(b["loss_mask"], old, torch.randn(old.shape)).requires_grad_(True)  # ratio 1 on model tokens
    loss, m = grpo.policy_loss(lp, batch=b, old_logprobs=old, tis_cap=2.0)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())
    assert (lp.grad[~b["loss_mask"]] == 0).all() and (lp.grad[b["loss_mask"]] != 0).all()
    out_pos = torch.tensor(scripted.samples[0].roles) == ROLE_OUTPUT
    assert out_pos.any() and (lp.grad[0, :len(out_pos)][out_pos] == 0).all()


# -----------------------------------------------------------------------------
# The step: ratio, clipping, learning


@pytest.mark.timeout(120)
def test_first_update_ratio_one_second_can_clip_L5(tokenizer, sandbox):
    probs = problems(4)
    args = make_args(prompts_per_step=4, group_size=4, updates_per_step=1, lr=0.05)
    _, out = run_steps(tiny.make_model(tokenizer), tokenizer, args, probs, 2, first_token_reward, sandbox)
    for m, _ in out:
        assert m["loss_tokens"] > 0
        assert m["clip_frac_low"] == m["clip_frac_high"] == m["approx_kl"] == 0.0
        assert m["entropy"] > 0 and m["grad_norm"] > 0 and m["sampler_logprob_gap"] < 1e-4
    args = make_args(prompts_per_step=4, group_size=4, updates_per_step=2, lr=0.05, micro_batch=8)
    _, out = run_steps(tiny.make_model(tokenizer), tokenizer, args, probs, 2, first_token_reward, sandbox)
    assert all(m["optimizer_steps"] == 2 for m, _ in out)
    assert sum(m["clip_frac_low"] + m["clip_frac_high"] for m, _ in out) > 0


@pytest.mark.timeout(120)
def test_dropout_is_off_in_training_ratio_exactly_one_L9(tokenizer, sandbox):
    """A policy whose config asks for attention dropout 0.3, trained with lr 0 and two
    updates per step: the trainer's logprobs are the sampler's (eval) logprobs and do not
    change between the two updates, so the ratio is exactly 1 (approx_kl and clip
    fractions exactly 0). With dropout left on, approx_kl was about 1e-4 and the gap 0.01."""
    lm = tiny.make_model(tokenizer)
    lm.config.attention_dropout = 0.3
    for m in lm.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.3
    model = sft.wrap_model(lm, "cpu")  # one process: the model itself, in train mode
    assert model.training
    args = make_args(prompts_per_step=4, group_size=4, updates_per_step=2, lr=0.0, micro_batch=2)
    _, out = run_steps(model, tokenizer, args, problems(4), 1, first_token_reward, sandbox,
                       opt_fn=lambda ps: torch.optim.SGD(ps, lr=0.0))
    m = out[0][0]
    assert m["optimizer_steps"] == 2 and m["loss_tokens"] > 0
    assert m["approx_kl"] == 0.0 and m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
    assert m["sampler_logprob_gap"] < 1e-5


@pytest.mark.timeout(60)
def test_the_reward_is_one_function_called_for_every_sample_L10(tokenizer, sandbox, monkeypatch):
    """Editing grpo.answer_reward (here: replacing it) changes the rewards the step trains
    on and logs, for every sample; the logged correctness stays is_correct's."""
    calls = []

    def parity_reward(samples, problems):
        calls.append([p["id"] for p in problems])
        return [float(s.ids[len(s.prompt_ids)] % 2) for s in samples]

    monkeypatch.setattr(grpo, "answer_reward", parity_reward)
    args = make_args(prompts_per_step=2, group_size=4)
    _, [(m, rec)] = run_steps(tiny.make_model(tokenizer), tokenizer, args, problems(2), 1, None, sandbox)
    assert len(calls) == 1 and sorted(calls[0]) == ["p0"] * 4 + ["p1"] * 4  # one call: every sample, its problem
    assert sum(r["reward"] for r in rec) == m["reward_mean"] * 8 > 0
    assert m["accuracy"] == 0.0 and all(r["correct"] == 0 for r in rec)  # nothing is boxed in 4 tokens


@pytest.mark.timeout(300)
def test_the_loop_learns(tokenizer, sandbox):
    """Real sampler, advantages, loss and AdamW on a tiny random policy: the mean reward of
    the toy task goes from about chance (1/8) to >= 0.9."""
    torch.manual_seed(0)
    args = make_args(prompts_per_step=4, group_size=8, max_new_tokens=1, micro_batch=32, lr=2e-2)
    lm = tiny.make_model(tokenizer)
    policy = copy.deepcopy(lm).eval()
    opt = torch.optim.AdamW(lm.parameters(), lr=args.lr)
    stream = grpo.PromptStream(problems(16), 0)
    rewards = []
    for step in range(1, 41):
        grpo.sync_policy(lm, policy)
        m, _, _ = grpo.grpo_step(lm.train(), policy, tokenizer, opt, sandbox, stream.next(4), args,
                                 grpo.Dist(), step, reward_fn=each(first_token_reward))
        rewards.append(m["reward_mean"])
        if len(rewards) >= 3 and min(rewards[-2:]) >= 0.9:
            break
    assert rewards[0] < 0.35, rewards
    assert min(rewards[-2:]) >= 0.9, rewards


@pytest.mark.timeout(60)
def test_dropped_groups_and_metrics(tokenizer, sandbox):
    """Constant-reward groups are counted and excluded; all counters are consistent."""
    args = make_args(prompts_per_step=2, group_size=4)
    probs = problems(2)
    half = lambda s, p: float(p["id"] == "p0" and s.ids[len(s.prompt_ids)] % 2 == 0)  # noqa: E731
    _, [(m, rec)] = run_steps(tiny.make_model(tokenizer), tokenizer, args, probs, 1, half, sandbox)
    assert m["groups"] == 2 and m["zero_var_share"] >= 0.5
    assert sorted(r["id"] for r in rec) == ["p0", "p1"] and all(r["n"] == 4 for r in rec)
    assert m["finish_length_share"] == 1.0 and grpo.budget_warning(m)  # every sample hit --max-new-tokens
    assert {"time_rollout", "time_exec", "time_train", "tool_calls_per_sample", "exec_errors_per_sample",
            "model_tokens_per_sample", "finish_tool_budget_share", "accuracy"} <= set(m)


@pytest.mark.timeout(30)
def test_progress_off_a_terminal_is_a_plain_line_every_30_s_L15(monkeypatch, capsys):
    """stderr redirected to a file (here: captured), a rollout bar updated once a second
    for 100 s: 4 plain lines (at 0, 30, 60 and 90 s) with the bar's figures, no carriage
    return and no cursor escape (before: a line a second, with escapes)."""
    clock = [1000.0]
    monkeypatch.setattr("tqdm.std.time", lambda: clock[0])  # tqdm's own clock
    monkeypatch.setattr(ex.time, "monotonic", lambda: clock[0])
    outer = ex.progress_bar(total=3, desc="grpo", unit="step")  # a second bar open at the same time
    bar = ex.RolloutProgress(100, "step 1 rollout")
    done = Sample(prompt_ids=[0], ids=[0, 1], roles=[ROLE_PROMPT, ROLE_MODEL], logprobs=[float("nan"), -1.0],
                  blocks=[{"status": "error"}], finish_reason="stop")
    for _ in range(100):
        clock[0] += 1.0
        bar(7, done)
    bar.close()
    outer.close()
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("step 1 rollout")]
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == ["0", "30", "60", "90"]
    assert lines[-1].split("|")[-1].endswith(", 90 blocks run, 90 errors]")
    assert len(err.splitlines()) == 4 + 2  # the outer bar: its first line and its last (on close)


@pytest.mark.timeout(30)
def test_prompt_stream_and_drop_solved(tmp_path):
    probs = problems(5)
    a, b = grpo.PromptStream(probs, 3, 0, 2), grpo.PromptStream(probs, 3, 1, 2)
    for _ in range(4):  # crosses epoch boundaries
        x, y = a.next(4), b.next(4)
        assert len(x) == len(y) == 2
        assert not {p["id"] for p in x} & {p["id"] for p in y}
    c = grpo.PromptStream(probs, 3, 0, 2)
    c.load_state_dict(a.state_dict())
    assert [p["id"] for p in c.next(4)] == [p["id"] for p in a.next(4)]
    f = tmp_path / "pass.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "id": "p0", "n": 8, "correct": 8}, {"step": 1, "id": "p1", "n": 8, "correct": 8},
        {"step": 2, "id": "p1", "n": 8, "correct": 3}, {"step": 2, "id": "p2", "n": 8, "correct": 0}]))
    assert grpo.solved_ids(str(f)) == {"p0"}


# -----------------------------------------------------------------------------
# Command line: stages, checkpoints, resume


def _write_problems(path, n):
    with open(path, "w") as f:
        for p in problems(n):
            f.write(json.dumps(p) + "\n")


def _cli(tiny_dir, data, out, *extra):
    return ["--model", tiny_dir, "--data", data, "--out", out, "--prompts-per-step", "2", "--group-size", "4",
            "--max-new-tokens", "3", "--micro-batch", "4", "--lr", "1e-2", "--exec-workers", "1",
            "--no-progress", *extra]


def _load_weights(d):
    from safetensors.torch import load_file
    return load_file(os.path.join(d, "model.safetensors"))


@pytest.mark.timeout(150)
def test_resume_equivalence_and_drop_solved(tiny_dir, tmp_path):
    data = str(tmp_path / "probs.jsonl")
    _write_problems(data, 6)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    grpo.main(_cli(tiny_dir, data, a, "--steps", "4"), reward_fn=each(first_token_reward))
    grpo.main(_cli(tiny_dir, data, b, "--steps", "2"), reward_fn=each(first_token_reward))
    with pytest.raises(ex.InputError, match=r"already holds a run \(metrics.jsonl\); continue it with --resume"):
        grpo.main(_cli(tiny_dir, data, b, "--steps", "4"))  # a fresh run would overwrite b's
    with open(os.path.join(b, "metrics.jsonl"), "a") as f:  # a crash after logging step 3,
        f.write(json.dumps({"step": 3, "reward_mean": -1}) + "\n")
    os.replace(os.path.join(b, "latest"), os.path.join(b, "latest.old"))  # inside save_checkpoint's swap
    grpo.main(_cli(tiny_dir, data, b, "--steps", "4", "--resume", os.path.join(b, "latest")),
              reward_fn=each(first_token_reward))
    wa, wb = _load_weights(os.path.join(a, "latest")), _load_weights(os.path.join(b, "latest"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"],
                           _load_weights(tiny_dir)["model.embed_tokens.weight"])  # it did train
    ma, mb = (ex.read_jsonl_tolerant(os.path.join(x, "metrics.jsonl")) for x in (a, b))
    assert [m["step"] for m in mb] == [1, 2, 3, 4]
    drop_t = lambda m: {k: v for k, v in m.items() if not k.startswith("time")}  # noqa: E731
    assert [drop_t(m) for m in ma] == [drop_t(m) for m in mb]
    pr = ex.read_jsonl_tolerant(os.path.join(a, "pass_rates.jsonl"))
    assert len(pr) == 8 and {"step", "id", "n", "correct"} <= set(pr[0])
    assert json.load(open(os.path.join(a, "latest", "args.json")))["steps"] == 4
    # stage 2: drop what was solved G/G (here: mark two ids solved), continue the counter
    solved = str(tmp_path / "solved.jsonl")
    ex.append_jsonl(solved, [{"step": 4, "id": "p0", "n": 4, "correct": 4},
                             {"step": 4, "id": "p1", "n": 4, "correct": 4}])
    grpo.main(_cli(tiny_dir, data, a, "--steps", "6", "--resume", os.path.join(a, "latest"), "--drop-solved", solved),
              reward_fn=each(first_token_reward))
    later = [r for r in ex.read_jsonl_tolerant(os.path.join(a, "pass_rates.jsonl")) if r["step"] > 4]
    assert len(later) == 4 and not {r["id"] for r in later} & {"p0", "p1"}


@pytest.mark.timeout(60)
def test_stateful_run_measures_and_summarises_its_own_prompts(tiny_dir, tmp_path, capsys):
    """--stateful prompts carry their own system prompt: the run ends with a trajectory of
    its last step (before, the summary looked the samples up under the default prompt and
    found none)."""
    data = str(tmp_path / "probs.jsonl")
    _write_problems(data, 2)
    grpo.main(_cli(tiny_dir, data, str(tmp_path / "o"), "--steps", "1", "--prompts-per-step", "2", "--stateful"),
              reward_fn=each(first_token_reward))
    assert "One trajectory of the last step (rank 0):" in capsys.readouterr().out


def test_resume_with_the_other_interpreter_policy_is_refused(tiny_dir, tmp_path, capsys):
    """A run made stateless continues only stateless (and the reverse): the flag is in the
    checkpoint's args.json, and a resume with the other one stops before any step."""
    data = str(tmp_path / "probs.jsonl")
    _write_problems(data, 2)
    out = str(tmp_path / "o")
    grpo.main(_cli(tiny_dir, data, out, "--steps", "1", "--prompts-per-step", "2"), reward_fn=each(first_token_reward))
    capsys.readouterr()
    argv = _cli(tiny_dir, data, out, "--steps", "2", "--prompts-per-step", "2", "--stateful",
                "--resume", os.path.join(out, "latest"))
    assert ex.cli(lambda a: grpo.main(a, reward_fn=each(first_token_reward)), argv) == 2
    err = capsys.readouterr().err
    assert "were made with --stateful False, this run has True" in err and err.count("\n") == 1
    assert len(open(os.path.join(out, "metrics.jsonl")).readlines()) == 1


def test_resume_applies_the_lr_given_now(tiny_dir, tmp_path):
    """--help says the flags given at resume apply: the step after a resume with a new --lr
    runs at it (before, plain AdamW took the saved lr back from its state dict)."""
    data = str(tmp_path / "probs.jsonl")
    _write_problems(data, 2)
    out = str(tmp_path / "o")
    grpo.main(_cli(tiny_dir, data, out, "--steps", "1"), reward_fn=each(first_token_reward))
    grpo.main(_cli(tiny_dir, data, out, "--steps", "2", "--lr", "5e-3", "--resume", os.path.join(out, "latest")),
              reward_fn=each(first_token_reward))
    assert [m["lr"] for m in ex.read_jsonl_tolerant(os.path.join(out, "metrics.jsonl"))] == [1e-2, 5e-3]


@pytest.mark.parametrize("flags, msg", [
    (("--group-size", "1"), "argument --group-size: expected an integer in [2, 65536], got '1'"),
    (("--temperature", "0"), "argument --temperature: expected a number in (0, 1000000], got '0'"),
    (("--drop-solved", "no/such.jsonl"), "argument --drop-solved: no/such.jsonl: no such file")])
def test_bad_arguments_are_refused_before_loading(flags, msg, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # a model folder, never loaded
    assert ex.cli(grpo.main, ["--model", str(tmp_path), "--out", str(tmp_path / "o"), *flags]) == 2
    assert capsys.readouterr().err == f"grpo.py: error: {msg}\n"
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.timeout(30)
def test_bad_problem_line_names_file_and_line(tiny_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(problems(1)[0]) + "\n" + json.dumps({"id": "x", "problem": "no answer"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        grpo.main(_cli(tiny_dir, str(data), str(tmp_path / "o"), "--steps", "1"))


# -----------------------------------------------------------------------------
# Two ranks (torchrun, gloo): D1-D4, L2 across ranks, 2-rank step == 1-rank step


STEP_EQ_ARGS = dict(prompts_per_step=2, group_size=4, max_new_tokens=3, micro_batch=2, lr=1e-2)


def sgd(params):
    """SGD with lr 1: the weight change is the (clipped) gradient itself, so comparing
    weights compares gradients to 1e-6 (Adam's first step, g / (|g| + eps), would amplify
    rounding in near-zero gradients)."""
    return torch.optim.SGD(params, lr=1.0)


def step_eq_reward(sample, problem):
    comp = sample.ids[len(sample.prompt_ids):]
    return float(sum(comp) % 2 == 0)  # both groups of this test's step have reward variance


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), "--worker", str(out), tiny_dir]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = [json.load(open(out / f"rank{k}.json")) for k in range(2)]
    return types.SimpleNamespace(dir=out, res=res, tiny_dir=tiny_dir)


@pytest.mark.timeout(300)
def test_ranks_sample_differently_weights_stay_equal_shards_disjoint_D1(two_ranks):
    r0, r1 = two_ranks.res
    assert r0["d1_prompt"] == r1["d1_prompt"] and r0["d1_completions"] != r1["d1_completions"]
    assert r0["d1_weights"] == r1["d1_weights"]
    assert not set(r0["d1_shard"]) & set(r1["d1_shard"])


@pytest.mark.timeout(300)
def test_ragged_rollout_lengths_do_not_hang_D2(two_ranks):
    r0, r1 = two_ranks.res
    assert r0["d2_max_model_tokens"] == 3 and r1["d2_max_model_tokens"] == 64
    assert r0["d2_steps"] == r1["d2_steps"] == 1


@pytest.mark.timeout(300)
def test_step_times_add_up_to_the_step_D15(two_ranks):
    r0, r1 = two_ranks.res
    assert r0["d15_times"] == r1["d15_times"] == [4.0, 0.0, 2.0]  # slowest rollout, the unwaited update


@pytest.mark.timeout(300)
def test_uneven_micro_batches_after_dropping_D3(two_ranks):
    r0, r1 = two_ranks.res
    assert (r0["d3_kept"], r1["d3_kept"]) == (3, 0)
    assert r0["d3_optimizer_steps"] == r1["d3_optimizer_steps"] == 1
    assert r0["d3_weights"] == r1["d3_weights"] and r0["d3_changed"]


@pytest.mark.timeout(300)
def test_rank0_logs_reduced_metrics_once_D4(two_ranks):
    rows = ex.read_jsonl_tolerant(str(two_ranks.dir / "d4" / "metrics.jsonl"))
    assert len(rows) == 1 and rows[0]["reward_mean"] == 0.5 and rows[0]["groups"] == 2
    pr = ex.read_jsonl_tolerant(str(two_ranks.dir / "d4" / "pass_rates.jsonl"))
    assert len(pr) == 2
    assert os.path.exists(two_ranks.dir / "d4" / "latest" / "model.safetensors")


@pytest.mark.timeout(300)
def test_sharded_optimizer_steps_and_resume_equal_replicated(two_ranks):
    w = {n: load_file(str(two_ranks.dir / n / "latest" / "model.safetensors"))
         for n in ("zero_plain", "zero", "zero_resumed")}
    start = load_file(os.path.join(two_ranks.tiny_dir, "model.safetensors"))
    assert any(not torch.equal(start[k], w["zero_plain"][k]) for k in start)  # it trained
    assert all(torch.equal(w["zero_plain"][k], w["zero"][k]) and torch.equal(w["zero"][k], w["zero_resumed"][k])
               for k in start)
    steps = [r["optimizer_steps"] for r in ex.read_jsonl_tolerant(str(two_ranks.dir / "zero" / "metrics.jsonl"))]
    assert steps == [1, 1]
    share = torch.load(two_ranks.dir / "zero" / "latest" / "trainer_state_rank1.pt", weights_only=False)
    assert "optimizer" not in share and len(share["optimizer_shard"]["state"]) > 0


@pytest.mark.timeout(300)
def test_gradient_two_ranks_equals_one_rank_L2(two_ranks, tokenizer):
    V = len(tokenizer)
    samples = [fake_sample(3, n, i, V) for i, n in enumerate(L2_LENGTHS)]
    g = l2_grad(tiny.make_model(tokenizer), samples, L2_ADV, micro=4)
    g2 = torch.load(two_ranks.dir / "l2_grad.pt")
    assert torch.allclose(g, g2, atol=1e-6, rtol=0)


@pytest.mark.timeout(300)
def test_two_rank_step_equals_one_rank_step(two_ranks, tokenizer, sandbox):
    args = make_args(**STEP_EQ_ARGS)
    model, [(m, _)] = run_steps(tiny.make_model(tokenizer), tokenizer, args, problems(4), 1, step_eq_reward,
                                sandbox, rollout_fn=per_prompt_rollout, opt_fn=sgd)
    m2 = two_ranks.res[0]["eq_metrics"]
    assert m["loss_tokens"] > 0 and m["loss_tokens"] == m2["loss_tokens"]
    for k in ("reward_mean", "zero_var_share", "entropy", "grad_norm", "model_tokens_per_sample"):
        assert m[k] == pytest.approx(m2[k], abs=1e-5), k
    w2 = torch.load(two_ranks.dir / "eq_weights.pt")
    assert torch.allclose(flat_params(model), w2, atol=1e-6, rtol=0)
    # and with FSDP instead of DDP
    assert two_ranks.res[0]["fsdp_metrics"]["loss_tokens"] == m["loss_tokens"]
    assert torch.allclose(flat_params(model), torch.load(two_ranks.dir / "fsdp_weights.pt"), atol=1e-6, rtol=0)


# -----------------------------------------------------------------------------
# The torchrun worker


def _worker(out_dir, tiny_dir):
    import torch.distributed as dist
    rank, _, world, device = sft.setup_distributed(0)
    assert world == 2
    d = grpo.Dist(rank, world, device)
    tok = tiny.make_tokenizer()
    res = {}

    def digest(model):
        return float(flat_params(model).double().abs().sum()), flat_params(model).sum().item()

    with ex.Sandbox(workers=1, timeout=5) as sb:
        # D1: the same prompt on both ranks at temperature 1
        args = make_args(prompts_per_step=2, group_size=4, max_new_tokens=8)
        stream = grpo.PromptStream(problems(1), 0, rank, world)
        seen = {}

        def spy(policy, tokenizer, prompts, sandbox, **kw):
            got = ex.rollout(policy, tokenizer, prompts, sandbox, **kw)
            seen["prompts"], seen["ids"] = prompts, [s.ids for s in got]
            return got

        model, _ = run_steps(tiny.make_model(tok), tok, args, None, 1, first_token_reward, sb, rollout_fn=spy,
                             d=d, stream=stream)
        res.update(d1_prompt=seen["prompts"], d1_completions=seen["ids"], d1_weights=digest(model))
        res["d1_shard"] = [p["id"] for p in grpo.PromptStream(problems(8), 0, rank, world).next(8)]

        # D2: rank 0's samples stop after 3 tokens, rank 1's after 64
        args = make_args(prompts_per_step=2, group_size=2, max_new_tokens=3 if rank == 0 else 64, micro_batch=1)
        toks = {}

        def lengths(policy, tokenizer, prompts, sandbox, **kw):
            got = ex.rollout(policy, tokenizer, prompts, sandbox, **kw)
            toks["max"] = max(s.n_model_tokens for s in got)
            return got

        alternate = itertools.cycle([1.0, 0.0])  # every group of 2 has signal: both ranks train
        real_metrics = grpo.step_metrics

        def set_times(*a):  # D15: the times the step measured, replaced by fixed ones (s)
            return real_metrics(*a[:6], [1.0, 0.0, 5.0] if rank == 0 else [4.0, 0.0, 2.0], *a[7:])

        grpo.step_metrics = set_times
        model, [(m, _)] = run_steps(tiny.make_model(tok), tok, args, problems(2), 1,
                                    lambda s, p: next(alternate), sb, rollout_fn=lengths, d=d)
        grpo.step_metrics = real_metrics
        res.update(d2_max_model_tokens=toks["max"], d2_steps=m["optimizer_steps"],
                   d15_times=[m["time_rollout"], m["time_exec"], m["time_train"]])

        # D3: after dropping, rank 0 has 3 micro-batches (1 group of 3, micro-batch 1), rank 1 none
        args = make_args(prompts_per_step=2, group_size=3, max_new_tokens=3, micro_batch=1)
        counter = itertools.count()
        r3 = (lambda s, p: float(next(counter) % 3 == 0)) if rank == 0 else (lambda s, p: 1.0)
        kept = {}
        orig = grpo.update_policy

        def spy_update(model, opt, samples, *a, **k):
            kept["n"] = len(samples)
            return orig(model, opt, samples, *a, **k)

        grpo.update_policy = spy_update
        lm = tiny.make_model(tok)
        before = flat_params(lm).clone()
        model, [(m, _)] = run_steps(lm, tok, args, problems(2), 1, r3, sb, d=d)
        grpo.update_policy = orig
        res.update(d3_kept=kept["n"], d3_optimizer_steps=m["optimizer_steps"], d3_weights=digest(model),
                   d3_changed=bool((flat_params(model) != before).any()))

        # L2 across ranks: 2 sequences per rank, micro-batch 2
        samples = [fake_sample(3, n, i, len(tok)) for i, n in enumerate(L2_LENGTHS)]
        g = l2_grad(tiny.make_model(tok), samples[2 * rank:2 * rank + 2], L2_ADV[2 * rank:2 * rank + 2], 2, d)
        if rank == 0:
            torch.save(g, os.path.join(out_dir, "l2_grad.pt"))

        # the 2-rank step against the 1-rank step (same prompts, per-prompt seeded sampler)
        args = make_args(**STEP_EQ_ARGS)
        model, [(m, _)] = run_steps(tiny.make_model(tok), tok, args, problems(4), 1, step_eq_reward, sb,
                                    rollout_fn=per_prompt_rollout, d=d, opt_fn=sgd)
        res["eq_metrics"] = m
        if rank == 0:
            torch.save(flat_params(model), os.path.join(out_dir, "eq_weights.pt"))

        # the same step with FSDP (fully_shard, sharded parameters): rollouts use a synced copy
        lm = tiny.make_model(tok)
        policy = copy.deepcopy(lm).eval()
        model = sft.wrap_model(lm, device, fsdp=True)
        opt = sgd(model.parameters())
        stream = grpo.PromptStream(problems(4), args.seed, rank, world)
        grpo.sync_policy(model, policy)
        m, _, _ = grpo.grpo_step(model, policy, tok, opt, sb, stream.next(2), args, d, 1,
                                 reward_fn=each(step_eq_reward), rollout_fn=per_prompt_rollout)
        grpo.sync_policy(model, policy)  # gathers the sharded weights on every rank
        res["fsdp_metrics"] = m
        if rank == 0:
            torch.save(flat_params(policy), os.path.join(out_dir, "fsdp_weights.pt"))

    # D4: rewards [1, 1] on rank 0 and [0, 0] on rank 1, through the command line entry
    data = os.path.join(out_dir, "d4.jsonl")
    if rank == 0:
        _write_problems(data, 2)
    dist.barrier()
    sft.cleanup_distributed = lambda: None  # several command-line runs share this process group
    grpo.main(["--model", tiny_dir, "--data", data, "--out", os.path.join(out_dir, "d4"), "--steps", "1",
               "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "2", "--exec-workers", "1",
               "--no-progress"], reward_fn=each(lambda s, p: 1.0 if rank == 0 else 0.0))

    # ZeRO-1 (--shard-optimizer): 2 steps plain, 2 steps sharded, 1 sharded step + resume
    def zero_run(name, *extra):
        alternate = itertools.cycle([1.0, 0.0])  # every group has signal: AdamW state after step 1
        grpo.main(["--model", tiny_dir, "--data", data, "--out", os.path.join(out_dir, name), "--prompts-per-step",
                   "2", "--group-size", "2", "--max-new-tokens", "3", "--exec-workers", "1", "--lr", "1e-3",
                   "--no-progress", *extra], reward_fn=each(lambda s, p: next(alternate)))

    zero_run("zero_plain", "--steps", "2")
    zero_run("zero", "--steps", "2", "--shard-optimizer")
    zero_run("zero_resumed", "--steps", "1", "--shard-optimizer")
    zero_run("zero_resumed", "--steps", "2", "--shard-optimizer", "--resume",
             os.path.join(out_dir, "zero_resumed", "latest"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__" and "--worker" in sys.argv:
    torch.set_num_threads(1)
    i = sys.argv.index("--worker")
    _worker(sys.argv[i + 1], sys.argv[i + 2])
    # the runs above share one process group (cleanup_distributed is off): a rank that exits without
    # destroying it aborts now and then ('terminate called without an active exception', tests/faults.md T3)
    torch.distributed.destroy_process_group()
