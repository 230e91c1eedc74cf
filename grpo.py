"""GRPO for THINC: sample G code-interleaved trajectories per problem, reward the correct
ones, and move the policy towards them with DAPO's token-level clipped objective.

Objective (paper Sec. 3.3: GRPO, DAPO token-level normalisation and clip-higher, no KL):

    J = 1/N sum_i sum_{t: model token of o_i} min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
    r_it = pi(o_it | q, o_i,<t) / pi_old(o_it | q, o_i,<t),   A_i = (R_i - mean_G R) / std_G R
    R_i = 1[answer_i = ground truth]

N counts the model-written tokens of the optimizer step over all ranks and micro-batches;
prompt, interpreter-output and padding tokens are never in the loss. pi_old is the
trainer's own forward before the step's first update (ratio exactly 1 with one update).
The sampler's logprobs are not the trainer's: a bf16 copy decoding from a KV cache against
an fp32 (autocast) or FSDP trainer differs per token (up to 7.8e-3 on a random model,
emulated on CPU; far more reported at scale), so each token's loss is weighted by
min(pi_old / pi_sampler, --tis-cap) (departure 4), and the mean |trainer - sampler|
logprob is logged each step (sampler_logprob_gap) with the mean weight and capped share.

The reward R is `--reward FILE.py:FUNCTION`, a batch function `reward(samples, problems) ->
list of floats` (problems[i] is the problem of samples[i]; `answer_reward`, the paper's, by
default); a reward that is not a finite number stops the run, naming its problem. The
logged accuracy and the per-prompt pass rates stay `is_correct`, whatever the reward.
Ablations each change one place: the reward (`--reward`, which may take the run's `args`),
the advantage `compute_advantages` (one per sample or one per token), which groups have
signal `has_signal`, which samples enter the loss `in_loss`, the loss `policy_loss` (it gets
the whole micro-batch; `update_policy` logs every metric it returns), its normaliser
`loss_normalizer` (README "Forking for an ablation").

Reading order for one step: `main` (the loop, at the end of the file), `grpo_step`, then
what it calls, laid out above it in the order it runs: rollouts, rewards and group
advantages, the loss, batching, the update; then bookkeeping (metrics), the prompt stream,
the end-of-run summary, the command line, `setup_run`.

Reads: --model (HF dir) or --resume DIR; problems JSONL {"id", "problem", "answer"}.
Writes under --out: latest/ (HF model dir + trainer_state_rank{r}.pt:
optimizer unless --no-save-optimizer, step, data position, RNG), metrics.jsonl (a line per
step), pass_rates.jsonl (a line per prompt per step: step, id, n, correct, reward), args.json.

    python grpo.py --model runs/sft/final --data dapo17k.jsonl --out runs/rl
    torchrun --standalone --nproc_per_node=8 grpo.py --model runs/sft/final --data dapo17k.jsonl --out runs/rl

--steps is a global counter that --resume continues: the paper's stages end at steps 280,
400 and >= 500 (stages 2 and 3 with --resume and --drop-solved of stage 1's pass_rates.jsonl,
copied aside at step 280; the run's own live file is refused: a resume would drop other
prompts). --resume restores weights, optimizer, step, data position and RNG; the flags given
now (budgets, --steps) apply. A prompt with no room for a token under
--max-context is skipped and counted. --temperature (> 0) also divides the logits in the
loss. --stateful: block k sees what blocks 1..k-1 of its trajectory defined
(executor.Sandbox.run). --updates-per-step: optimizer steps (mini-batches) per rollout
batch; 1 is on-policy (ratio exactly 1). --max-num-seqs: sequences decoding at once per rank
(vLLM's max_num_seqs; continuous batching: a finished sequence's place goes to the next, and a
group's G sequences share their prompt's prefill). --save-every: steps between writes of out/latest
(a crash loses at most this many). --no-save-optimizer: checkpoints hold weights, step,
data order and RNG but not AdamW's state (2 x the fp32 weights), which then starts fresh.
--kv-cache-gb: the rows a rank decodes at once are also capped so that their KV cache fits it
(`sft.memory_plan`, printed at start). An update whose gradient norm is not finite is skipped
and logged (grad_norms); --max-skipped-steps updates in a row end the run. --dist-timeout: hours a collective waits.

Departures from the paper (which does not describe these details):
  1. Groups whose advantages are all 0 (all-equal rewards) are dropped from the loss and
     from N (counted, logged), not replaced by more draws (DAPO's dynamic sampling).
  2. --drop-solved drops a prompt whose *latest* pass-rate record was solved G/G.
  3. fp32 master weights train under bf16 autocast on GPU (as sft.py); rollouts run on a
     bf16 copy synced every step, at most --max-num-seqs sequences at once per rank.
  4. Truncated importance sampling (Yao et al. 2025) is on, per token, cap 2.0, as TRL's
     GRPO turns it on by default for its vLLM sampler (cap 2.0; 3.0 in later versions): the
     sampler here is a bf16 copy too, so without it the update is silently off-policy. An
     fp32 sampler on CPU gives weights of 1 to ~1e-7 (a tiny model's mean gap: 1.8e-7);
     --tis-cap 0 turns it off.
"""
import argparse, datetime, functools, hashlib, inspect, math, numbers, os, random, runpy, sys, time, traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

import executor
import sft

@dataclass
class Dist:
    """Where this process sits (from `sft.setup_distributed`)."""
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    autocast_dtype: torch.dtype | None = None  # bf16 on CUDA unless --fp32


# -----------------------------------------------------------------------------
# Rollouts


def mix_seed(*xs) -> int:
    """A deterministic seed from integers (step, rank, round, ...): resuming at a step
    reproduces its rollouts without saving generator states."""
    h = 0
    for x in xs:
        h = (h * 1_000_003 + int(x) + 1) % (2 ** 61 - 1)
    return h


# the flags grpo_step passes to collect_rollouts
COLLECT_ARGS = ("group_size", "stateful", "max_num_seqs", "temperature", "top_p", "max_context", "max_new_tokens",
                "max_tool_calls")


def collect_rollouts(policy, tokenizer, problems, sandbox, *, group_size: int, seed: int, stateful: bool = False,
                     max_num_seqs: int = 0, progress=None, rollout_fn=None, **sampling):
    """G = group_size samples per problem, prompt-major (result[i * G + j]), under the prompt
    of `executor.stage_prompt_ids`, in one rollout call: at most `max_num_seqs` rows decode
    at once (0 = all) and a finished sample's place goes to the next one. `sampling`
    (temperature, top_p, max_context, max_new_tokens, max_tool_calls), stateful and progress
    are `executor.rollout`'s (`rollout_fn`, default `executor.rollout` looked up at each call:
    patching it reaches grpo as it reaches evaluate, tests/faults.md L25). Returns (samples,
    seconds the sampler stalled waiting on code blocks; the rest of their execution overlaps
    decoding)."""
    stats = {}
    prompts = [executor.stage_prompt_ids(tokenizer, p["problem"], stateful) for p in problems]
    was_training = policy.training  # the policy may be the trained module itself
    policy.eval()
    out = (rollout_fn or executor.rollout)(policy, tokenizer, prompts, sandbox, n=group_size, seed=seed,
                                           max_num_seqs=max_num_seqs, stats=stats, stateful=stateful,
                                           progress=progress, **sampling)
    policy.train(was_training)
    return out, stats.get("exec_wait_s", 0.0)


def sync_policy(model, policy):
    """Copy the trained weights into the rollout copy (casting to its dtype); nothing when the
    sampler runs the trained module itself. Every rank calls it: under FSDP it gathers one
    parameter at a time, cast to the rollout dtype first (a collective, outside the sampler):
    never the whole fp32 model on every GPU."""
    if policy is sft.unwrap_model(model):
        return
    target = dict(policy.named_parameters())
    with torch.no_grad():
        for name, p in sft.unwrap_model(model).named_parameters():
            p = p.detach().to(target[name].dtype)  # (FSDP: this rank's shard, cast)
            target[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)


# -----------------------------------------------------------------------------
# Rewards and group advantages


def answer_reward(samples, problems, args=None) -> list:
    """The default reward (the paper's): 1[answer = ground truth] for each sample, problems[i]
    being the problem of samples[i]. --reward FILE.py:FUNCTION replaces it with a function of
    the same signature (`load_reward`); the logged accuracy stays `is_correct`. `args`: the
    run's flags (`parse_args`), passed to a reward that names it (a length penalty reads
    `args.max_context` there); this one ignores them."""
    return [float(is_correct(s, p)) for s, p in zip(samples, problems)]


def load_reward(spec: str):
    """The function named by --reward FILE.py:FUNCTION, run from that file, whose folder is
    put on sys.path (a helper module beside it imports). Raises InputError when the file or
    the function is missing (`--reward ''` included), or the file raises or exits as it loads.
    The function returned raises InputError, one line, when the user's raises or exits
    (`user_reward`)."""
    path, _, name = spec.rpartition(":")
    if path.endswith(".py") and os.path.isfile(path):
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        fn = runpy.run_path(path).get(name) if path.endswith(".py") and os.path.isfile(path) else None
    except (Exception, SystemExit) as e:  # (a syntax error, a failed import, sys.exit at the top of the file)
        raise executor.InputError(f"--reward {spec}: loading {path} raised {_raised(e)}") from None
    if not callable(fn):
        raise executor.InputError(f"--reward {spec}: expected FILE.py:FUNCTION, a function of an existing file")
    return user_reward(fn, spec)


def user_reward(fn, spec: str):
    """`fn` (--reward `spec`) called as it is, except that an exception it raises, or sys.exit,
    becomes one line saying so: the user's function, the sample (and its problem) it was on, the exception and
    where (a traceback deep in grpo.py did not say whose code failed, nor on which sample:
    tests/faults.md B48). The sample is the one a frame of the failed call held as a variable."""
    @functools.wraps(fn)  # (the same signature: batch_rewards passes `args` to a reward that names it)
    def call(samples, problems, **kw):
        try:
            return fn(samples, problems, **kw)
        except (Exception, SystemExit) as e:
            raise executor.InputError(f"--reward {spec} raised {_raised(e)}, on "
                                      f"{_failed_on(e, samples, problems)}") from None
    return call


def _raised(e: BaseException) -> str:
    """`Type: message at file:line`, the line the innermost frame of the exception's traceback ran."""
    where = traceback.extract_tb(e.__traceback__)[-1:]
    at = f" at {os.path.basename(where[0].filename)}:{where[0].lineno}" if where else ""
    return f"{type(e).__name__}: {str(e).strip() or '?'}"[:300] + at


def _failed_on(e: BaseException, samples, problems) -> str:
    """Which sample the failed reward call was on: the one a frame's variable holds (innermost
    frame first), else the batch."""
    index = {id(s): i for i, s in enumerate(samples)}
    for f, _ in reversed(list(traceback.walk_tb(e.__traceback__))):
        if hits := [index[id(v)] for v in f.f_locals.values() if id(v) in index]:
            return f"sample {hits[0]} (problem {problems[hits[0]]['id']!r})"
    return f"one of its {len(samples)} samples"


def batch_rewards(reward_fn, samples, problems, step: int = 0, args=None) -> torch.Tensor:
    """(N,) float64 rewards (1.1 logs as 1.1) `reward_fn(samples, problems)`, problems[i] the
    problem of samples[i], with `args=args` when the function takes an `args` keyword.
    Raises InputError, one line naming the reward and the step, unless it returns a list,
    tuple, 1-D tensor or array of N real numbers (a dict, a string, None, a generator, words,
    complex or nested values, another count: tests/faults.md B40), and for a reward that is
    not finite, naming its problem (one NaN would make its group's advantages NaN and,
    after one step, every weight). An exception the reward raises itself propagates."""
    takes_args = "args" in inspect.signature(reward_fn).parameters
    out = reward_fn(samples, problems, **({"args": args} if takes_args else {}))
    out = out.tolist() if getattr(out, "ndim", None) == 1 else out  # a 1-D tensor or numpy array
    seq = isinstance(out, (list, tuple))
    odd = sorted({type(r).__name__ for r in out if not isinstance(r, numbers.Real)}) if seq else []  # words, None, ...
    if not seq or len(out) != len(samples) or odd:
        got = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (list, tuple, dict, str)) else "")
        raise executor.InputError(f"reward {getattr(reward_fn, '__name__', reward_fn)} at step {step} returned {got}"
                                  + (f" holding {', '.join(odd)}" if odd else "")
                                  + f": expected a list of {len(samples)} real numbers, one per sample")
    for r, problem in zip(out, problems):
        if not math.isfinite(r):
            raise executor.InputError(f"reward {r} for a sample of problem {problem['id']!r}: rewards must be finite")
    return torch.tensor([float(r) for r in out], dtype=torch.float64)


def is_correct(sample, problem) -> bool:
    """The answer in the model's own text answers the problem (`executor.correct`, every
    reward's verdict). `sample.pred` comes from model-written tokens only, so an output
    block printing \\boxed{...} earns nothing (tests/faults.md L7)."""
    return executor.correct(sample.pred, problem)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO advantages A_i = (r_i - mean_group) / std_group, unbiased std.

    Args:
        rewards: (N,) float, N = groups * group_size, each group contiguous.
        group_size: G.
    Returns:
        (N,) float32. A group whose rewards are all equal, and any group of size 1, gets
        exactly 0, never NaN or inf: equality is tested directly, not through a small std.
        Example: [1, 0, 0, 0] -> [1.5, -0.5, -0.5, -0.5].
    """
    assert rewards.dim() == 1 and rewards.numel() % group_size == 0, (rewards.shape, group_size)
    if group_size == 1:  # (std of one value would warn)
        return torch.zeros(rewards.shape, dtype=torch.float32)
    r = rewards.to(torch.float64).reshape(-1, group_size)  # (N/G, G)
    const = r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values  # (N/G, 1): all equal
    std = torch.where(const, 1.0, r.std(dim=1, unbiased=True, keepdim=True))  # (N/G, 1), no 0 / 0 anywhere
    adv = torch.where(const, 0.0, (r - r.mean(dim=1, keepdim=True)) / std)  # (N/G, G)
    return adv.reshape(-1).to(torch.float32)


def compute_advantages(samples, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """THE advantage of a step, the one place to change for an advantage ablation.

    Args: samples: the step's N samples, groups of group_size contiguous; rewards: (N,).
    Returns:
        (N,) one advantage per sample, or (N, T) one per token, T >= the longest len(ids),
        column t belonging to samples[i].ids[t] (only model tokens enter the loss; finite
        everywhere). A group whose rewards are all equal has no signal and is dropped from
        the step (`has_signal`). The paper's: `group_advantages(rewards, group_size)`.
    """
    return group_advantages(rewards, group_size)


# -----------------------------------------------------------------------------
# Loss
def has_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N/G,) bool: the group's rewards ((N,), groups contiguous) are not all equal. A group
    without signal is dropped from the step and counted in zero_var_share. Rewards, not
    advantages: `r - group mean` is not exactly 0 on a constant group (three rewards of 0.1
    give -1.39e-17), and such a group would dilute the token mean (tests/faults.md L35). An
    advantage that is not a function of the group's rewards (a batch-mean baseline) replaces
    this too: `torch.ones(len(rewards) // group_size, dtype=torch.bool)`."""
    r = rewards.reshape(-1, group_size)  # (N/G, G)
    return r.max(dim=1).values != r.min(dim=1).values


def in_loss(samples, advantages: torch.Tensor) -> torch.Tensor:
    """(N,) bool: the sample enters the loss if its group has signal. The one place for a
    per-sample mask, e.g. DAPO's overlong filter (`s.finish_reason != "length"`); it leaves
    the groups' signal, and so zero_var_share, as it was. The paper's: every sample."""
    return torch.ones(len(samples), dtype=torch.bool)


def loss_normalizer(tokens: float, world_size: int) -> float:
    """What each rank divides its micro-batches' masked sums of token losses by, given the
    loss tokens of the whole mini-batch over all ranks. The paper's (DAPO's token mean):
    tokens / world_size, since DDP / FSDP average gradients over ranks, so that the sum over
    micro-steps and ranks is exactly the token mean (tests/faults.md L2). Dr. GRPO divides
    by a constant instead (a token budget, over world_size in the same way)."""
    return tokens / world_size


def policy_loss(logprobs: torch.Tensor, *, batch: dict, old_logprobs: torch.Tensor, normalizer=None,
                eps_low: float = 0.20, eps_high: float = 0.28, tis_cap: float = 2.0,
                entropy: torch.Tensor | None = None):
    """Clipped surrogate with token-level (DAPO) aggregation and truncated importance
    sampling (TIS, Yao et al. 2025) on the sampler's logprobs:

        loss = sum_{b,t: mask} -w min(r A_b, clip(r, 1 - eps_low, 1 + eps_high) A_b) / normalizer
        r = exp(clamp(logprobs - old_logprobs, -20, 20)),  w = min(pi_old / pi_sampler, tis_cap), detached

    Args:
        logprobs: (B, T) the current policy's logprob of each token (with grad).
        batch: the micro-batch (`make_batch`), whole, so that an ablation reads what it needs:
            advantages (B,) or (B, T), loss_mask (B, T) bool (True at model-written tokens),
            roles and attention_mask (B, T) (the lengths), sampler_logprobs (B, T), and
            ref_logprobs (B, T) when the step has a reference policy (`update_policy`'s
            `reference`). Logprobs may be anything, NaN included, off the mask: they are
            selected away with torch.where, never multiplied by 0.
        old_logprobs: (B, T) the same tokens under pi_old (the trainer before the step).
        normalizer: the masked sum is divided by it (`loss_normalizer`); None = this call's
            own token count.
        eps_low, eps_high: asymmetric clip range (clip-higher).
        tis_cap: C, the cap of the TIS weight; 0 = off (w = 1). The defaults here are the
            command line's (a caller from Python trains as grpo.py does, tests/faults.md L33).
        entropy: (B, T) per-token entropy, for the metric only (there is no bonus term).
    Returns:
        loss: 0-dim tensor.
        metrics: 0-dim detached tensors, means over the masked tokens: loss (the token loss
            -w min(...), whatever the normaliser), clip_frac_low (r < 1 - eps_low with A <
            0), clip_frac_high (r > 1 + eps_high with A > 0) - the two regions where the
            gradient is cut - approx_kl (k3 = r - 1 - log r, an estimate of KL(pi_old ||
            pi)), entropy (if given), with TIS on tis_weight (w) and tis_capped (the share
            of tokens whose pi_old / pi_sampler exceeds C); and tokens (the count).
    """
    mask = batch["loss_mask"].to(logprobs.device).bool()  # (B, T)
    assert logprobs.shape == old_logprobs.shape == mask.shape and batch["advantages"].shape[:1] == logprobs.shape[:1]
    # (B, T), NaN-free and detached: given logprobs itself (update_policy's first mini-batch) the
    # ratio is exactly 1 and the gradient that of A * logprob
    old = torch.where(mask, old_logprobs.to(logprobs.dtype), logprobs).detach()
    log_ratio = (logprobs - old).clamp(-20.0, 20.0)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = batch["advantages"].to(logprobs).reshape(len(logprobs), -1)  # (B, 1), broadcast over T on purpose, or (B, T)
    surr = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)  # (B, T)
    is_ratio = torch.where(mask, old - batch["sampler_logprobs"].to(old), 0.0).clamp(max=20.0).exp()  # (B, T)
    weight = is_ratio.clamp(max=tis_cap) if tis_cap > 0 else torch.ones_like(is_ratio)  # (B, T), no grad
    token_loss = torch.where(mask, -weight * surr, 0.0)  # (B, T)
    n_tokens = mask.sum()
    loss = token_loss.sum() / (n_tokens.clamp(min=1) if normalizer is None else normalizer)

    with torch.no_grad():
        denom = n_tokens.clamp(min=1).float()
        low = mask & (ratio < 1.0 - eps_low) & (adv < 0)  # (B, T)
        high = mask & (ratio > 1.0 + eps_high) & (adv > 0)  # (B, T)
        k3 = torch.where(mask, (ratio - 1.0) - log_ratio, 0.0).float()  # (B, T)
        metrics = {"loss": token_loss.sum().float() / denom, "clip_frac_low": low.sum() / denom,
                   "clip_frac_high": high.sum() / denom, "approx_kl": k3.sum() / denom, "tokens": n_tokens.float()}
        if tis_cap > 0:
            metrics["tis_weight"] = torch.where(mask, weight, 0.0).sum().float() / denom
            metrics["tis_capped"] = (mask & (is_ratio > tis_cap)).sum() / denom
        if entropy is not None:
            metrics["entropy"] = torch.where(mask, entropy.float(), 0.0).sum() / denom
    return loss, metrics


# -----------------------------------------------------------------------------
# Batching: the engine's ids and roles, never re-tokenized


def make_batch(samples, advantages, pad_id: int = 0) -> dict:
    """Right-pad samples into training tensors (CPU), in the layout of `sft.token_logprobs`
    (position t holds token t and the logprob of predicting it).

    Args:
        samples: `executor.Sample`s; `ids` and `roles` are used exactly as the sampler fed them.
        advantages: (B,) one per sample, or (B, T') one per token with T' >= the longest sample.
    Returns dict of (B, T) input_ids, attention_mask (from lengths, never from pad ids),
        position_ids, roles; loss_mask (B, T) bool = roles == ROLE_MODEL; sampler_logprobs
        (B, T) (NaN off model tokens); advantages (B,) or (B, T) float32.
    """
    assert all(len(s.ids) == len(s.roles) == len(s.logprobs) for s in samples), "ids, roles and logprobs must align"
    mb = sft.collate([{"ids": s.ids, "roles": s.roles} for s in samples], pad_id)
    mb["sampler_logprobs"] = torch.nn.utils.rnn.pad_sequence(  # (B, T)
        [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples], batch_first=True, padding_value=float("nan"))
    mb["loss_mask"] = mb["roles"] == executor.ROLE_MODEL  # (B, T)
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    mb["advantages"] = adv if adv.dim() == 1 else adv[:, :mb["input_ids"].shape[1]]  # (B,) or (B, T)
    return mb


def dummy_batch(pad_id: int = 0) -> dict:
    """One 2-token sequence with no loss token. A rank with fewer micro-batches than another
    runs these so that every rank does the same forwards and backwards: DDP's gradient
    all-reduce and FSDP's gathers are collectives inside them (tests/faults.md D3)."""
    prompt = executor.Sample(prompt_ids=[pad_id] * 2, ids=[pad_id] * 2, roles=[executor.ROLE_PROMPT] * 2,
                             logprobs=[float("nan")] * 2)
    return make_batch([prompt], torch.zeros(1), pad_id)


# -----------------------------------------------------------------------------
# The update


def _logprobs(model, mb, proc: Dist, chunk_size: int, temperature: float, with_entropy: bool):
    """(B, T) logprobs of each token at the sampling temperature (chunked head, sft.py),
    with (B, T) entropy if asked; under bf16 autocast on CUDA."""
    with torch.autocast(proc.device.type, proc.autocast_dtype, enabled=proc.autocast_dtype is not None):
        return sft.token_logprobs(model, mb["input_ids"].to(proc.device), mb["attention_mask"].to(proc.device),
                                  mb["position_ids"].to(proc.device), chunk_size, temperature,
                                  return_entropy=with_entropy, start=sft.first_loss_column(mb["loss_mask"]),
                                  check_finite=False)


UPDATE_ARGS = ("updates_per_step", "micro_batch", "eps_low", "eps_high", "tis_cap", "chunk_size", "temperature",
               "grad_clip")


def update_policy(model, optimizer, samples, advantages, proc: Dist, *, micro_batch: int, updates_per_step: int = 1,
                  eps_low: float = 0.20, eps_high: float = 0.28, tis_cap: float = 2.0, chunk_size: int = 1024,
                  temperature: float = 1.0, grad_clip: float = 1.0, pad_id: int = 0, progress=None,
                  reference=None) -> dict:
    """The training half of a GRPO step: `updates_per_step` optimizer steps over this rank's
    samples (one mini-batch each, cut into micro-batches of `micro_batch`), every rank in
    lockstep.

    Args:
        model: the policy as `sft.wrap_model` returned it, in train mode.
        samples: this rank's samples to learn from; advantages: (len(samples),) or
            (len(samples), T) (`compute_advantages`).
        eps_low, eps_high, tis_cap: `policy_loss`'s; chunk_size, temperature:
            `sft.token_logprobs`'s; grad_clip: max global grad norm (0 = off).
        progress: None, or the title of a bar of the micro-batches run (`executor.progress_bar`).
        reference: None (the paper's: no KL term), or a frozen policy on proc.device whose
            logprobs each micro-batch then carries as ref_logprobs (B, T) into `policy_loss`.
            The reference is the start model: in `main`, after `setup_run`,
            `executor.load_model(args.model, ...)`, which under --resume is still the run's
            --model (`sft.check_run_dirs` takes it from the checkpoint's args.json,
            tests/faults.md B46), never `args.resume or args.model` as the policy is loaded:
            that is the checkpoint, a reference that would move with every resume.
    Returns:
        dict: sums, this rank's: loss_tokens (the `tokens` count every loss returns), every
        other metric `policy_loss` returns (a mean over its loss tokens) times those tokens,
        and sampler_logprob_gap (|trainer - sampler| logprob summed over loss tokens); none
        without a loss token on any rank. grad_norms (one a mini-batch with a loss token, in
        order; inf or NaN where that update was skipped, `sft.optimizer_step`) and
        optimizer_steps (their count), both already identical on every rank. A non-finite
        logit makes its update's gradient non-finite, so every rank skips that update
        together (tests/faults.md L34), instead of raising on one rank mid-collective.
    """
    K = updates_per_step
    # 1) K mini-batches of micro-batches; sorted by length inside a mini-batch (less padding)
    minis = []
    for chunk in torch.arange(len(samples)).tensor_split(K):  # sizes differ by at most one
        chunk = sorted(chunk.tolist(), key=lambda i: -len(samples[i].ids))
        cuts = [chunk[j:j + micro_batch] for j in range(0, len(chunk), micro_batch)]
        minis.append([make_batch([samples[i] for i in c], advantages[c], pad_id) for c in cuts])
    # 2) global sizes, fixed before any micro-step: the loss tokens of each mini-batch over
    #    all ranks (the normaliser) and the most micro-batches any rank has (ranks with
    #    fewer run dummy micro-batches so that their collectives pair up, tests/faults.md D3)
    tokens = sft.all_reduce(torch.tensor([float(sum(int(mb["loss_mask"].sum()) for mb in m)) for m in minis],
                                         dtype=torch.float64, device=proc.device)).tolist()
    normalizers = [loss_normalizer(t, proc.world_size) for t in tokens]
    n_micro = sft.all_reduce(torch.tensor([len(m) for m in minis], device=proc.device), dist.ReduceOp.MAX).tolist()
    for k, m in enumerate(minis):
        m += [dummy_batch(pad_id) for _ in range(n_micro[k] - len(m))]
    progress = executor.progress_bar(total=sum(n for n, t in zip(n_micro, tokens) if t > 0), desc=progress,
                                     unit="micro-batch", leave=False, disable=not progress)
    # 3) old logprobs: the trainer's own forward before any update. Mini-batch 0 uses its
    #    first forward, detached (the same computation), so its ratio is exactly 1; later
    #    mini-batches need a no-grad pass now, before the first optimizer step.
    with torch.no_grad():
        olds = {(k, j): _logprobs(model, mb, proc, chunk_size, temperature, False)
                for k in range(1, K) if tokens[k] > 0 for j, mb in enumerate(minis[k])}
    # 4) K optimizer steps
    sums, grad_norms = [], []
    for k in range(K):
        if tokens[k] == 0:  # no loss token on any rank: every rank skips (a global count)
            continue
        for j, mb in enumerate(minis[k]):
            # gradients are all-reduced on the last micro-step only (sft.grad_sync)
            with sft.grad_sync(model, sync=j == n_micro[k] - 1):
                logprobs, entropy = _logprobs(model, mb, proc, chunk_size, temperature, True)  # (B, T), (B, T)
                mask = mb["loss_mask"].to(proc.device)  # (B, T)
                if reference is not None:
                    with torch.no_grad():
                        mb["ref_logprobs"] = _logprobs(reference, mb, proc, chunk_size, temperature, False)  # (B, T)
                loss, loss_metrics = policy_loss(logprobs, batch=mb, old_logprobs=olds[k, j] if k > 0 else logprobs,
                                                 normalizer=normalizers[k], eps_low=eps_low, eps_high=eps_high,
                                                 tis_cap=tis_cap, entropy=entropy)
                loss.backward()
            # sums over loss tokens of whatever metrics the loss returns (means over its tokens);
            # they stay on the device until the end (no host sync inside the loop)
            gap = (logprobs.detach().float() - mb["sampler_logprobs"].to(proc.device)).abs()  # (B, T), NaN off model
            n = loss_metrics.pop("tokens")
            sums.append({"loss_tokens": n, "sampler_logprob_gap": torch.where(mask, gap, 0.0).sum(),
                         **{name: value.double() * n for name, value in loss_metrics.items()}})
            progress.update()
        grad_norms.append(sft.optimizer_step(model, optimizer, grad_clip))
    progress.close()
    # optimizer_steps: the mini-batches with a loss token, one skipped for a non-finite norm included
    return {"sums": {k: float(sum(s[k].double() for s in sums)) for k in (sorted(sums[0]) if sums else [])},
            "grad_norms": grad_norms, "optimizer_steps": len(grad_norms)}


# -----------------------------------------------------------------------------
# One GRPO step


def grpo_step(model, policy, tokenizer, optimizer, sandbox, problems, args, proc: Dist, step: int,
              reward_fn=None, rollout_fn=None, show_progress: bool = False, reference=None):
    """One GRPO step, called on every rank: rollouts, rewards, advantages, the update.

    Args:
        model: the trained policy as `sft.wrap_model` returned it.
        policy: the plain module the sampler runs (no collective inside its forward,
            tests/faults.md D2), already holding the current weights (`sync_policy`).
        problems: this rank's share of the step's --prompts-per-step problems.
        args: grpo's flags (`parse_args`).
        reward_fn: (samples, problems) -> list of floats (`answer_reward`'s signature);
            default `answer_reward`, looked up at each call.
        rollout_fn: the sampler, default `executor.rollout` (looked up at each call);
            replaceable to replay fixed samples.
        show_progress: a bar for the rollout and one for the training micro-batches.
        reference: `update_policy`'s (None: no reference policy, the paper's).
    Returns:
        (metrics: dict reduced over ranks, identical on every rank;
         records: per-prompt pass rates from every rank, on rank 0 only ([] elsewhere);
         samples: this rank's, prompt-major: samples[i] answers problems[i // G]).
    """
    G = args.group_size
    t0 = time.perf_counter()
    # 1) rollouts: G samples for each of this rank's problems
    seed = mix_seed(args.seed, step, proc.rank, 0)  # (the trailing 0 keeps the seeds of earlier versions' runs)
    rollout_bar = executor.RolloutProgress(len(problems) * G, f"step {step} rollout", not show_progress)
    samples, t_exec = collect_rollouts(policy, tokenizer, problems, sandbox, seed=seed, progress=rollout_bar,
                                       rollout_fn=rollout_fn, **{k: getattr(args, k) for k in COLLECT_ARGS})
    rollout_bar.close()
    # 2) rewards -> advantages; a group whose rewards are all equal carries no signal and is dropped
    rewards = batch_rewards(reward_fn or answer_reward, samples, [problems[i // G] for i in range(len(samples))],
                            step, args)
    advantages = compute_advantages(samples, rewards, G)  # (N,) or (N, T)
    signal = has_signal(rewards, G)  # (N/G,)
    kept = signal.repeat_interleave(G) & in_loss(samples, advantages)  # (N,)
    # 3) the update, on the kept samples only
    t1 = time.perf_counter()
    train = update_policy(model, optimizer, [s for s, keep in zip(samples, kept.tolist()) if keep], advantages[kept],
                          proc, pad_id=tokenizer.pad_token_id or 0, progress=show_progress and f"step {step} training",
                          reference=reference, **{k: getattr(args, k) for k in UPDATE_ARGS})
    times = [t1 - t0 - t_exec, t_exec, time.perf_counter() - t1]  # rollout (less the stalls), exec stalls, training
    return (*step_metrics(step, problems, samples, rewards, int((~signal).sum()), train, times, G, optimizer, proc),
            samples)


# -----------------------------------------------------------------------------
# Bookkeeping: metrics and pass rates

SHARES = {  # metric: (numerator, denominator), sums over the step's samples on every rank
    "reward_mean": ("reward", "samples"), "accuracy": ("correct", "samples"),
    "zero_var_share": ("zero_var_groups", "groups"), "model_tokens_per_sample": ("model_tokens", "samples"),
    "tool_calls_per_sample": ("tool_calls", "samples"), "exec_errors_per_sample": ("exec_errors", "samples"),
    "exec_error_rate": ("exec_errors", "tool_calls"), "finish_length_share": ("finish_length", "samples"),
    "finish_tool_budget_share": ("finish_tool_budget", "samples"),
}


def step_metrics(step: int, problems, samples, rewards, dropped: int, train, times, G: int, optimizer, proc: Dist):
    """The step's metrics and per-prompt pass rates, computed in one place from this rank's
    problems, samples, (N,) rewards, groups dropped for no signal and `update_policy`'s
    sums: every count is summed over ranks in one all-reduce, the records are gathered on
    rank 0. Times (s): rollout and exec stalls are the slowest rank's; training is the
    shortest, that of the rank whose rollout ended last (a rank that ended its rollout
    earlier waits for it in the update's first collective, and its clock counts the wait),
    so rollout + exec + training is the step's wall time (tests/faults.md D15). The loss's
    metrics are means per loss token, absent (with grad_norm None) when no group had signal
    (not a misleading 0). grad_norm is the mean over the updates applied (None if none was);
    grad_norms lists each update's (None: skipped for a non-finite norm, tests/faults.md L34).
    Returns (metrics, records) as `grpo_step`."""
    correct = torch.tensor([is_correct(s, problems[i // G]) for i, s in enumerate(samples)])  # (N,)
    records = [{"step": step, "id": p["id"], "n": G, "correct": c, "reward": r} for p, c, r in
               zip(problems, correct.reshape(-1, G).sum(1).tolist(), rewards.reshape(-1, G).sum(1).tolist())]
    statuses = [b["status"] for s in samples for b in s.blocks or []]
    sums = {"samples": len(samples), "groups": len(problems), "reward": rewards.sum(), "correct": correct.sum(),
            "zero_var_groups": dropped, "tool_calls": len(statuses),
            "exec_errors": sum(x != "ok" for x in statuses), "model_tokens": sum(s.n_model_tokens for s in samples),
            **{"finish_" + f: sum(s.finish_reason == f for s in samples) for f in ("length", "tool_budget")},
            "loss_tokens": 0, **train["sums"]}  # the same keys, in the same order, on every rank
    totals = dict(zip(sums, sft.all_reduce(torch.tensor([float(v) for v in sums.values()], dtype=torch.float64,
                                                        device=proc.device)).tolist()))
    slowest = sft.all_reduce(torch.tensor(times[:2], dtype=torch.float64, device=proc.device), dist.ReduceOp.MAX)
    update = sft.all_reduce(torch.tensor(times[2:], dtype=torch.float64, device=proc.device), dist.ReduceOp.MIN)
    if proc.world_size > 1:
        parts = [None] * proc.world_size
        dist.all_gather_object(parts, records)  # every rank calls it; rank 0 keeps the result
        records = [r for p in parts for r in p]
    finite = [n for n in train["grad_norms"] if math.isfinite(n)]  # the updates applied
    metrics = {"step": step, "groups": int(totals["groups"]), "loss_tokens": int(totals["loss_tokens"]),
               **{name: totals[a] / max(totals[b], 1.0) for name, (a, b) in SHARES.items()},
               **{name: totals[name] / totals["loss_tokens"] for name in train["sums"] if name != "loss_tokens"},
               "grad_norm": sum(finite) / len(finite) if finite else None,
               "grad_norms": [n if math.isfinite(n) else None for n in train["grad_norms"]],
               "optimizer_steps": train["optimizer_steps"], "lr": optimizer.param_groups[0]["lr"],
               **dict(zip(("time_rollout", "time_exec", "time_train"), slowest.tolist() + update.tolist()))}
    return metrics, (records if proc.rank == 0 else [])


def budget_warning(metrics) -> str | None:
    """A loud message when most samples end on a budget (rewards silently become 0)."""
    length, tools = metrics["finish_length_share"], metrics["finish_tool_budget_share"]
    if length + tools > 0.5:
        return (f"WARNING step {metrics['step']}: {length:.0%} of samples hit the length budget (--max-context / "
                f"--max-new-tokens) and {tools:.0%} the tool-call budget (--max-tool-calls): unfinished samples "
                "score 0 and training learns little. Raise the budgets or check the prompt / stop tokens.")


# -----------------------------------------------------------------------------
# Data: the order problems are drawn in


def solved_ids(path: str) -> set:
    """Ids whose latest record in a pass-rate JSONL was solved n / n."""
    latest = {}
    for i, r in executor.read_jsonl(path, torn_tail_ok=True):
        # ("n": "2" or true is no count; nor correct > n or a negative one: tests/faults.md B34)
        if not ({"id", "n", "correct"} <= set(r) and type(r["n"]) is type(r["correct"]) is int
                and 0 <= r["correct"] <= r["n"] and r["n"] > 0):
            raise executor.InputError(f"{path}:{i}: not a pass-rate record (id, integers n > 0 and "
                                      f"0 <= correct <= n): {r}")
        latest[str(r["id"])] = r["correct"] == r["n"]
    return {k for k, v in latest.items() if v}


class PromptStream:
    """The order problems are drawn in: a permutation of the list seeded by (seed, epoch).
    Every rank walks the same order and takes every world_size-th problem of each global
    batch, from its rank on, so rank shards are disjoint. State (epoch, offset, fingerprint
    of the id list) goes into checkpoints."""

    def __init__(self, problems, seed: int, rank: int = 0, world_size: int = 1):
        assert problems, "no problems to draw from"
        self.problems, self.seed, self.rank, self.world = problems, seed, rank, world_size
        self.fingerprint = hashlib.sha256("\n".join(str(p["id"]) for p in problems).encode()).hexdigest()[:16]
        self.epoch, self.offset = 0, 0

    def next(self, n_global: int) -> list:
        """This rank's share (n_global / world_size problems) of the next global batch."""
        assert n_global % self.world == 0, (n_global, self.world)
        n, batch = len(self.problems), []
        while len(batch) < n_global:
            if self.offset == n:
                self.epoch, self.offset = self.epoch + 1, 0
            order = random.Random(self.seed * 1_000_003 + self.epoch).sample(range(n), n)  # this epoch's permutation
            take = order[self.offset:self.offset + n_global - len(batch)]
            batch, self.offset = batch + take, self.offset + len(take)
        return [self.problems[i] for i in batch[self.rank::self.world]]

    def state_dict(self):
        return {"epoch": self.epoch, "offset": self.offset, "fingerprint": self.fingerprint}

    def load_state_dict(self, state):
        """Continue where a checkpoint stopped. A different problem list (another file, or
        --drop-solved) cannot continue a permutation: it starts a fresh one at epoch + 1."""
        same = state["fingerprint"] == self.fingerprint
        if not same:
            sft.print0(f"problem list differs from the checkpoint's: new order from epoch {state['epoch'] + 1}")
        self.epoch, self.offset = (state["epoch"], state["offset"]) if same else (state["epoch"] + 1, 0)


# Progress and the end-of-run summary


def dir_gb(path: str) -> float:
    """Size of the files under `path`, in GB (1e9 bytes)."""
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs) / 1e9


def step_table(rows) -> str:
    """A markdown table of metrics.jsonl rows: the figures to read a short run by."""
    head = ("step", "reward", "accuracy", "groups with signal", "model tokens / sample", "tool calls / sample",
            "exec errors / sample", "loss tokens", "grad norm", "rollout s", "training s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in rows:
        cells = (m["step"], f"{m['reward_mean']:.3f}", f"{m['accuracy']:.3f}",
                 f"{round(m['groups'] * (1 - m['zero_var_share']))} of {m['groups']}",
                 f"{m['model_tokens_per_sample']:.0f}", f"{m['tool_calls_per_sample']:.2f}",
                 f"{m['exec_errors_per_sample']:.2f}", m["loss_tokens"],
                 "-" if m["grad_norm"] is None else f"{m['grad_norm']:.2f}",
                 f"{m['time_rollout'] + m['time_exec']:.0f}", f"{m['time_train']:.0f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def run_summary(args, problems, samples) -> str:
    """What a run ends with (rank 0): one sampled trajectory of its last step (samples[i]
    answers problems[i // G]) in readable form (a correct one with code if any, else the one
    with the most blocks), the per-step table of metrics.jsonl, and where the files are."""
    s, prob = max(((s, problems[i // args.group_size]) for i, s in enumerate(samples)),
                  key=lambda sp: (is_correct(*sp), len(sp[0].blocks) > 0, sp[0].finish_reason == "stop",
                                  len(sp[0].blocks)))
    record = executor.sample_record(prob, s)  # (the reward is not called again: it may need whole groups)
    return "\n".join([
        "", "=" * 80, "One trajectory of the last step (rank 0):", "", executor.format_trajectory(record), "",
        "Per step (metrics.jsonl):", "",
        step_table(executor.read_jsonl_tolerant(os.path.join(args.out, "metrics.jsonl"))), "",
        f"Files in {os.path.abspath(args.out)}:",
        "  metrics.jsonl     one line per step (the table above and more)",
        "  pass_rates.jsonl  one line per prompt per step: correct of G",
        "  latest/           the trained policy (Hugging Face directory) and trainer state", "=" * 80])


# -----------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = executor.ArgumentParser(description="THINC GRPO: token-level clipped policy gradient, outputs masked")
    # model and data
    p.add_argument("--model", type=executor.model_path, default=executor.DEFAULT_POLICY,
                   help="policy to start from: HF dir, .gguf file or packaged model name; ignored with --resume")
    p.add_argument("--data", type=executor.input_file, default=executor.DEMO_PROBLEMS,
                   help="problems JSONL: id, problem, answer; a prompt with no room under --max-context is skipped")
    p.add_argument("--out", default="runs/grpo", help="output dir: checkpoints, metrics.jsonl, pass_rates.jsonl")
    p.add_argument("--resume", help="checkpoint dir (out/latest) to continue; the flags given now apply")
    p.add_argument("--drop-solved", type=executor.input_file, help="pass-rate JSONL: drop prompts last solved G/G")
    # GRPO
    p.add_argument("--steps", type=executor.nonneg_int, default=280, help="last step (a counter --resume continues)")
    p.add_argument("--prompts-per-step", type=executor.size_int, default=128, help="prompts a step, all ranks")
    p.add_argument("--group-size", type=executor.bounded(int, 2, 2**16), default=8, help="G: samples per prompt (>= 2)")
    p.add_argument("--updates-per-step", type=executor.positive_int, default=1, help="updates a rollout; 1 = on-policy")
    p.add_argument("--eps-low", type=executor.fraction, default=0.20, help="clip: ratio >= 1 - eps_low")
    p.add_argument("--eps-high", type=executor.nonneg_float, default=0.28, help="clip: ratio <= 1 + eps_high")
    p.add_argument("--reward", help="FILE.py:FUNCTION: f(samples, problems[, args]) -> floats; default 1[answer=gold]")
    p.add_argument("--tis-cap", type=executor.nonneg_float, default=2.0,
                   help="truncated importance sampling: weight min(pi_old / pi_sampler, C) a token; 0 = off")
    # rollout
    p.add_argument("--temperature", type=executor.positive_float, default=1.0, help="sampling and loss temperature")
    p.add_argument("--top-p", type=executor.unit_float, default=1.0, help="nucleus mass: 1.0 only (the loss's logprob "
                   "is over the whole vocabulary)")
    p.add_argument("--max-context", type=executor.positive_int, default=16384, help="tokens a sample, prompt included")
    p.add_argument("--max-new-tokens", type=executor.nonneg_int, default=0, help="model tokens a sample; 0 = no cap")
    p.add_argument("--max-tool-calls", type=executor.nonneg_int, default=20, help="executed code blocks per sample")
    p.add_argument("--max-num-seqs", type=executor.nonneg_int, default=32, help="sequences at once a rank; 0 = all")
    p.add_argument("--kv-cache-gb", type=executor.nonneg_float, default=0.0, help="GiB of KV cache a rank; caps "
                   "--max-num-seqs; 0 = 90%% of GPU memory less the training state (none on CPU)")
    p.add_argument("--exec-timeout", type=executor.positive_float, default=10.0, help="seconds per code block")
    p.add_argument("--exec-workers", type=executor.nonneg_int, default=0,
                   help="blocks run at once per rank; 0 = CPUs/ranks")
    p.add_argument("--stateful", action="store_true", help="a block sees what earlier blocks defined (Sandbox.run)")
    # optimisation and run
    p.add_argument("--lr", type=executor.unit_float, default=1e-6, help="AdamW learning rate, constant")
    p.add_argument("--save-every", type=executor.nonneg_int, default=1, help="steps a write of latest/; 0 = at the end")
    p.add_argument("--save-optimizer", action=argparse.BooleanOptionalAction, default=True, help="AdamW in checkpoints")
    # the flags shared with sft.py: --micro-batch, --weight-decay, --grad-clip, --chunk-size, --seed,
    # --fsdp, --shard-optimizer, --grad-checkpointing, --fp32, --no-progress
    sft.add_training_args(p)
    args = p.parse_args(argv)
    if args.top_p < 1:  # the sampler would record the nucleus's logprob (tests/faults.md G18)
        p.error(f"--top-p {args.top_p}: GRPO samples at top-p 1.0 (the paper's value): its loss takes each "
                "token's logprob over the whole vocabulary, so a nucleus would train another policy than the one "
                "that sampled")
    return args


# -----------------------------------------------------------------------------
# Training loop


def setup_run(args):
    """Everything before the loop, each check before the run's first write (bad input
    changes no file): ranks, the run folder, the problems (--drop-solved, --max-context), the
    trained model, its rollout copy (the trained module itself when it can be shared) and
    AdamW, and with --resume the trainer state. Returns (proc, model, policy, tokenizer,
    optimizer, stream, step: the last step done)."""
    # a step's first collective waits for the slowest rank's rollouts (hours at 32K tokens and
    # 40 blocks) or rank 0's save: far past NCCL's default 10 minutes (tests/faults.md D5)
    rank, _, world, device = sft.setup_distributed(args.seed, timeout=datetime.timedelta(hours=args.dist_timeout))
    # one interpreter policy per run (its rollouts and prompt never mix); the seed orders the data
    args.resume = sft.check_run_dirs("grpo.py", args, ("metrics.jsonl", "latest"), ("stateful", "seed"))
    sft.check_torch(args, device)
    live = os.path.join(args.out, "pass_rates.jsonl")  # grows every step (tests/faults.md L16)
    if args.drop_solved and os.path.exists(live) and os.path.samefile(args.drop_solved, live):
        raise executor.InputError(f"--drop-solved {args.drop_solved}: this run's live pass rates; drop from a copy "
                                  "frozen at the end of stage 1 (README: Running at paper scale)")
    proc = Dist(rank, world, device, torch.bfloat16 if device.type == "cuda" and not args.fp32 else None)
    if args.prompts_per_step % world:
        raise executor.InputError(f"--prompts-per-step {args.prompts_per_step} is not a multiple of {world} ranks")
    sft.print0(f"{args.prompts_per_step} prompts x G {args.group_size} a step over {world} ranks, micro-batch "
               f"{args.micro_batch}, {args.updates_per_step} update(s) a step (1: on-policy, the ratio is exactly 1)")
    if args.updates_per_step == 1 and (args.eps_low, args.eps_high) != (0.20, 0.28):
        sft.print0("warning: --eps-low / --eps-high change nothing with --updates-per-step 1 (the ratio is exactly 1)")

    # 1) data, read before anything is written (bad input changes no file)
    problems = executor.read_problems(args.data)
    if args.drop_solved:
        solved = solved_ids(args.drop_solved)
        sft.print0(f"--drop-solved: dropping {sum(p['id'] in solved for p in problems)} of {len(problems)} "
                   f"prompts solved G/G in {args.drop_solved}")
        problems = [p for p in problems if p["id"] not in solved]
        if not problems:
            raise executor.InputError(f"--drop-solved {args.drop_solved}: every problem of {args.data} was solved")

    # 2) model: fp32 master weights (bf16 autocast on CUDA), a rollout copy, AdamW
    lm, tokenizer = executor.load_model(args.resume or args.model, dtype="float32", device="cpu")
    # prompts are measured before any forward: one with no room for a token under --max-context
    # is skipped and counted, never prefilled (every rank filters the same list)
    n0 = len(problems)
    problems = [p for p in problems
                if len(executor.stage_prompt_ids(tokenizer, p["problem"], args.stateful)) < args.max_context]
    if not problems:
        raise executor.InputError(f"--max-context {args.max_context}: no prompt of {args.data} leaves room for a token")
    if len(problems) < n0:
        sft.print0(f"skipped {n0 - len(problems)} of {n0} problems whose prompt leaves no room under --max-context")
    # A separate rollout copy is needed under FSDP (sharded weights would put collectives in
    # the sampler's token loop) or in bf16; otherwise the sampler uses the trained module
    # itself, which saves one copy of the weights (the 2-rank CPU demo needs it).
    share = not args.fsdp and proc.autocast_dtype is None
    # the KV cache the engine can reach fits the budget: rows admitted (tests/faults.md D12)
    kv_bytes = 2 if proc.autocast_dtype else 4
    state = sft.state_gib(sum(p.numel() for p in lm.parameters()), world, args.fsdp, args.shard_optimizer,
                          0 if share else kv_bytes)
    args.max_num_seqs, plan = sft.memory_plan(lm.config, kv_bytes, args.max_num_seqs, args.max_context,
                                              args.kv_cache_gb, state, device)
    sft.print0(plan)
    if rank == 0:  # every check passed: the run's first write
        sft.start_run(os.path.join(args.out, "args.json"), "grpo", args, lock=args.out)
    stream = PromptStream(problems, args.seed, rank, world)
    # the rollout copy is loaded in its own dtype: no second fp32 model in host RAM a rank
    policy = None if share else executor.load_model(args.resume or args.model, dtype=str(
        proc.autocast_dtype or torch.float32).removeprefix("torch."), device=device)[0].requires_grad_(False)
    model = sft.wrap_model(lm, device, fsdp=args.fsdp, grad_checkpointing=args.grad_checkpointing)
    policy = sft.unwrap_model(model) if share else policy
    optimizer = sft.make_optimizer(model.parameters(), args.lr, args.weight_decay, shard=args.shard_optimizer)
    step = 0
    if args.resume:
        state = sft.load_trainer_state(args.resume, optimizer,
                                       logs=[os.path.join(args.out, f) for f in ("metrics.jsonl", "pass_rates.jsonl")])
        step = state["step"]
        stream.load_state_dict(state["data"])
        for group in optimizer.param_groups:  # the flags given now apply, as --help says
            group["lr"], group["weight_decay"] = args.lr, args.weight_decay
    return proc, model, policy, tokenizer, optimizer, stream, step


def main(argv=None, reward_fn=None):
    """Run GRPO from the command line. `reward_fn` (samples, problems) -> floats replaces
    --reward when called from Python (tests)."""
    args = parse_args(argv)
    reward_fn = reward_fn or (load_reward(args.reward) if args.reward is not None else answer_reward)
    proc, model, policy, tokenizer, optimizer, stream, step = setup_run(args)

    # the loop; rank 0 shows a bar per phase and keeps its last step's samples for the summary
    rank, skipped, samples = proc.rank, 0, []
    show_bars, latest = rank == 0 and not args.no_progress, os.path.join(args.out, "latest")
    bar = executor.progress_bar(total=args.steps, initial=step, disable=not show_bars, desc="grpo", unit="step")
    say = bar.write if show_bars else lambda text: None  # (tqdm's write keeps a terminal's bars whole)
    with executor.Sandbox(workers=args.exec_workers, timeout=args.exec_timeout) as sandbox:
        while step < args.steps:
            step += 1
            sync_policy(model, policy)
            batch = stream.next(args.prompts_per_step)
            metrics, records, samples = grpo_step(model, policy, tokenizer, optimizer, sandbox, batch, args, proc, step,
                                                  reward_fn=reward_fn, show_progress=show_bars)
            # updates skipped in a row for a non-finite gradient norm (sft.optimizer_step, tests/faults.md D10, L34)
            for norm in metrics["grad_norms"]:
                skipped = 0 if norm is not None else skipped + 1
            metrics["skipped_in_a_row"] = skipped
            if rank == 0:
                executor.append_jsonl(os.path.join(args.out, "metrics.jsonl"), [metrics])
                executor.append_jsonl(os.path.join(args.out, "pass_rates.jsonl"), records)
                if warn := budget_warning(metrics):
                    print("\n" + "!" * 80 + "\n" + warn + "\n" + "!" * 80, file=sys.stderr, flush=True)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", zero_var=f"{metrics['zero_var_share']:.2f}",
                            tokens=metrics["model_tokens_per_sample"], refresh=False)
            bar.update(1)
            sft.stop_after_skips(skipped, args.max_skipped_steps)
            if args.save_every and step % args.save_every == 0 or step == args.steps:
                say(f"step {step}: writing checkpoint {latest} ...")
                t0 = time.perf_counter()
                sft.save_checkpoint(latest, model, tokenizer, {"stage": "grpo", **vars(args)},
                                    {"step": step, "data": stream.state_dict()},
                                    optimizer if args.save_optimizer else None)
                say(f"step {step}: checkpoint written in {time.perf_counter() - t0:.0f} s ({dir_gb(latest):.1f} GB)")
    bar.close()
    sft.print0(f"done: step {step}" + (f"; checkpoint {latest}" if os.path.isdir(latest) else "; nothing to run"))
    if rank == 0 and samples:
        print(run_summary(args, batch, samples), flush=True)
    sft.cleanup_distributed()


if __name__ == "__main__":
    sys.exit(executor.cli(main, interrupted=lambda: sft.interrupted_note(parse_args().out)))
