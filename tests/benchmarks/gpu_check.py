"""GPU check: the paper-scale path measured in one command. Not a test.

Models are random-initialised from Qwen3Config with the real Qwen3-1.7B / Qwen3-4B shapes
(nothing is downloaded; the tokenizer is the tiny byte-level one of tests/tiny.py, whose
ids are a subset of the 151,936-token vocabulary). Rows, each measured on its own (a row
that fails, e.g. out of memory, is recorded as an error and the others still run):

  decode   engine (`executor.rollout`) vs transformers `generate`, batch 1 / 8 / 32, bf16,
           128 new tokens after 128-token prompts (the prefill is < 2% of the work and is
           timed too): tokens/s and the fraction of the bandwidth bound, B / ((weight bytes +
           KV bytes read per step) / copy bandwidth, read + write, measured in the run).
  rollout  3 tool turns at batch 32 (4 prompts x G 8) over 2K-token histories, real
           sandbox: the engine continues from its KV cache; the baseline calls `generate`
           once per turn on the whole history (a fresh prefill each turn).
  batching continuous batching against waves at 32 rows (bench_rollout.py (c)): 128
           samples (16 prompts x G 8), each drawing its length: about a quarter run to a
           512-token budget, the rest stop after 32..128 tokens; waves of 4 prompts (one
           rollout call each) against one call with max_num_seqs=32: tokens/s, wall time,
           mean occupancy, peak memory.
  grpo     one `grpo.update_policy` step (2 sequences, micro-batch 1) at 4B shapes, 8K and
           16K tokens per sequence, with and without --grad-checkpointing: time, peak memory.
           The bf16 rollout copy stays resident, as in grpo.py.
  fit      the largest --max-num-seqs whose 16K-token KV caches fit beside the 4B
           training state (fp32 weights + AdamW + bf16 rollout copy) in 90% of the device.
  layout   the README's layouts per rank, FSDP-8 and DDP-8 (`sft.memory_plan` on this
           device's memory): training state + rollout copy, rows admitted at 16K and 32K.
  sft      one `sft.backward_step` + AdamW step (1 sequence) at 16K and 32K, with and
           without checkpointing.
  feed     a 1,000-token output block fed on one row while the others decode, at the rows
           the plan admits (FSDP-8 state) x the full stage-3 context (32K): the forward's
           peak above the weights and the KV cache against the plan's figure for it
           (`sft.feed_transient_bytes`), and transformers' repeat_kv copy it avoids.
  ranks2   grpo.py under torchrun on 2 ranks, --fsdp, 2 steps of the tiny model (NCCL when
           two GPUs are there, else recorded as skipped; gloo on CPU in the dry run).

A random model does not write code, so both sides of decode and rollout are *forced*: the
model runs its real forward (KV cache, lm_head), then its logits are replaced by a one-hot
on the scripted next token (the engine through a wrapper module, `generate` through a
logits processor; the same (B, V) work on both sides). The rollout script is, per turn,
filler then "\\n```python\\nprint(k)\\n```", so the engine's own fence detection stops the
row and the sandbox runs the block.

    python tests/benchmarks/gpu_check.py               # one GPU: 4-8 minutes (estimated, never run)
    python tests/benchmarks/gpu_check.py --dry-run     # tiny shapes, CPU: about 30 s on 2 cores
    python tests/benchmarks/gpu_check.py --rows decode,fit --out /tmp/check.json

Prints one line per row and writes every row (after each row) to --out as JSON
(default $OUT/gpu_check.json if $OUT is set, else runs/gpu_check.json).
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, LogitsProcessor, Qwen3Config  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), HERE]
import bench_rollout  # noqa: E402
import executor as ex  # noqa: E402
import grpo  # noqa: E402
import sft  # noqa: E402
import tiny  # noqa: E402

# -----------------------------------------------------------------------------
# Shapes

QWEN3 = {"qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, intermediate_size=6144),
         "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=9728)}
TINY = {"tiny-a": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128),
        "tiny-b": dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=24, intermediate_size=192)}
# lengths in tokens; "big" is the model that is trained (the paper's 4B)
PAPER = dict(models=QWEN3, big="qwen3-4b", vocab=151936, batches=(1, 8, 32), prompt=128, new=128, group=8,
             rollout_batch=32, history=2048, turn=128, grpo=(8192, 16384), sft=(16384, 32768), context=16384,
             copy_mib=4096, tail=(128, 512, 128), block=1000)
DRY = dict(models=TINY, big="tiny-b", vocab=512, batches=(1, 8, 32), prompt=16, new=8, group=8,
           rollout_batch=16, history=64, turn=16, grpo=(64, 128), sft=(128, 256), context=256, copy_mib=64,
           tail=(32, 32, 8), block=300)
GiB = 1 << 30
# what the stages' parse_args require; nothing is read from or written to them here
STAGE_ARGS = ["--data", os.path.join(ROOT, "data", "demo_problems.jsonl"),
              "--out", os.path.join(ROOT, "runs", "unused")]


# -----------------------------------------------------------------------------
# Forcing the model's next token


class Forced(torch.nn.Module):
    """The model's real forward, then logits one-hot on next_token(position, n_fed) for each
    row that was fed something (position: of its last fed token; n_fed: tokens it fed), or
    on next_token itself if it is a token id (no device sync then, as in `ForceTokens`)."""

    def __init__(self, lm, next_token):
        super().__init__()
        self.lm, self.next_token = lm, next_token
        self.config, self.generation_config = lm.config, lm.generation_config

    def forward(self, **kw):
        out = self.lm(**kw)
        forced = torch.full_like(out.logits[:, -1:], -1e4)  # (B, 1, V)
        if isinstance(self.next_token, int):
            forced[:, :, self.next_token] = 0.0
            out.logits = forced
            return out
        L = kw["input_ids"].shape[1]
        fed = kw["attention_mask"][:, -L:].sum(dim=1).tolist()
        pos = kw["position_ids"][:, -1].tolist()
        tokens = torch.tensor([self.next_token(p, f) if f else 0 for p, f in zip(pos, fed)], device=out.logits.device)
        out.logits = forced.scatter_(2, tokens[:, None, None], 0.0)
        return out


class ForceTokens(LogitsProcessor):
    """The same for `generate`: the j-th new token is tokens[j]."""

    def __init__(self, tokens, prompt_len):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids, scores):
        scores.fill_(-1e4)
        scores[:, self.tokens[input_ids.shape[1] - self.prompt_len]] = 0.0
        return scores


class TurnPlan:
    """Per-position script for identical rows: a multi-token feed (the prompt, an output
    block; one the engine cut into several forwards counts once) ending at position e starts
    the next turn, whose j-th token is sampled from the logits at e + j. Past the last turn
    every row gets EOS."""

    def __init__(self, turns, eos):
        self.turns, self.eos, self.starts, self.plan = turns, eos, [], {}

    def __call__(self, pos, n_fed):
        if n_fed > 1 and self.starts and pos - n_fed == self.starts[-1]:
            self.starts.pop()  # the rest of a feed the engine cut into forwards (executor.FEED_CHUNK)
        if n_fed > 1 and pos not in self.starts and len(self.starts) < len(self.turns):
            for j, t in enumerate(self.turns[len(self.starts)]):
                self.plan[pos + j] = t
            self.starts.append(pos)
        return self.plan.get(pos, self.eos)


# -----------------------------------------------------------------------------
# Setup: what the rows share, built on first use


class Context:
    """Shapes (PAPER or DRY), device, tokenizer, and the models, trainer and sandbox that
    rows share; `keep` frees what the next row does not need."""

    def __init__(self, a):
        self.S, self.dev = DRY if a.dry_run else PAPER, torch.device(a.device)
        self.cuda = self.dev.type == "cuda"
        self.autocast = torch.bfloat16 if self.cuda else None  # as grpo.py / sft.py
        self.tok = tiny.make_tokenizer()
        self.x, self.eos, self.pad = self.tok.encode("x")[0], self.tok.eos_token_id, self.tok.pad_token_id
        self.objects, self.bandwidth, self._sandbox = {}, None, None

    @property
    def sandbox(self):
        if self._sandbox is None:  # started on first use: the training rows need none
            self._sandbox = ex.Sandbox(workers=min(8, os.cpu_count() or 1))
        return self._sandbox

    def close(self):
        if self._sandbox is not None:
            self._sandbox.close()

    def build(self, name, dtype):
        cfg = Qwen3Config(vocab_size=self.S["vocab"], max_position_embeddings=40960, tie_word_embeddings=True,
                          eos_token_id=self.eos, pad_token_id=self.pad, bos_token_id=None,
                          **self.S["models"][name])
        torch.manual_seed(0)
        with self.dev:  # initialised in place: a 4B model in seconds
            lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        lm.generation_config.eos_token_id, lm.generation_config.pad_token_id = [self.eos], self.pad
        return lm.eval()

    def get(self, key):
        if key not in self.objects:
            if key == "trainer":
                lm = self.build(self.S["big"], torch.float32)
                opt = sft.make_optimizer(lm.parameters(), lr=1e-6)
                model = sft.wrap_model(lm, self.dev)
                sft_step(self, model, opt, 64)  # allocate AdamW state: every row then holds all of it
                self.objects[key] = model, opt
            else:  # ("policy", name): the bf16 rollout copy (fp32 on CPU)
                self.objects[key] = self.build(key[1], torch.bfloat16 if self.cuda else torch.float32)
        return self.objects[key]

    def keep(self, keys):
        for k in [k for k in self.objects if k not in keys]:
            del self.objects[k]
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def measured(ctx, fn):
    """(seconds, peak GiB allocated or None on CPU, fn's result)."""
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if ctx.cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return dt, torch.cuda.max_memory_allocated() / GiB if ctx.cuda else None, out


def copy_bandwidth(ctx, reps=10):
    """Device copy bandwidth in bytes/s, read + write, from a large tensor copy."""
    src = torch.empty(ctx.S["copy_mib"] << 20, dtype=torch.uint8, device=ctx.dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    dt, _, _ = measured(ctx, lambda: [dst.copy_(src) for _ in range(reps)])
    return 2 * reps * src.numel() / dt


def kv_bytes_per_token(ctx, lm, n=64):
    """Bytes the KV cache holds per token, measured on a transformers cache after n tokens."""
    cache = DynamicCache(config=lm.config)
    with torch.inference_mode():  # the keyword the engine passes its cache with
        lm(input_ids=torch.full((1, n), ctx.x, device=ctx.dev), cache=cache, use_cache=True)
    filled = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    if not filled:  # the engine would then decode without its history, silently
        raise RuntimeError(f"transformers {transformers.__version__} ignored the cache passed as cache=")
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in filled) / n


def weight_bytes(lm):
    return sum(p.numel() * p.element_size() for p in lm.parameters())  # a tied head counts once


def prompts(ctx, n, length):
    """n random prompts of `length` ids, each starting with its own id (no shared prefix)."""
    g = torch.Generator().manual_seed(length)
    return [[3 + i] + torch.randint(3, len(ctx.tok), (length - 1,), generator=g).tolist() for i in range(n)]


def generate(ctx, lm, rows, tokens):
    """Append `tokens` to every row (equal lengths) through `generate`; the new ids."""
    ids = torch.tensor(rows, device=ctx.dev)
    with torch.inference_mode():
        out = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=len(tokens), logits_processor=[ForceTokens(tokens, ids.shape[1])],
                          pad_token_id=ctx.pad)
    return out[:, ids.shape[1]:].tolist()


def synthetic_samples(ctx, length, n):
    """n samples of `length` tokens in the engine's layout: a prompt of length / 8, then
    model tokens with an interpreter-output stretch in every fourth 512-token block."""
    P, out = length // 8, []
    for ids in prompts(ctx, n, length):
        roles = [ex.ROLE_PROMPT] * P + [ex.ROLE_OUTPUT if (t // 512) % 4 == 3 else ex.ROLE_MODEL
                                        for t in range(length - P)]
        logprobs = [-1.0 if r == ex.ROLE_MODEL else float("nan") for r in roles]
        out.append(ex.Sample(prompt_ids=ids[:P], ids=ids, roles=roles, logprobs=logprobs))
    return out


def set_checkpointing(ctx, model, on):
    """Turn gradient checkpointing on (as the stages do) or off; returns whether it is on now."""
    lm = sft.unwrap_model(model)
    if on:
        sft.wrap_model(lm, ctx.dev, grad_checkpointing=True)
    else:  # the transformers 5.2x name, or the older one
        (getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable)()
    return any(getattr(m, "gradient_checkpointing", False) for m in lm.modules())


def sft_step(ctx, model, opt, length):
    s = synthetic_samples(ctx, length, 1)[0]
    mb = sft.collate([{"ids": s.ids, "roles": s.roles}], ctx.pad, ctx.dev)
    args = sft.parse_args(STAGE_ARGS)
    sft.backward_step(model, [mb], chunk_size=args.chunk_size, autocast_dtype=ctx.autocast)
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)  # one process: no DDP buckets to keep


# -----------------------------------------------------------------------------
# Rows: each returns a dict of figures


def decode_row(ctx, name, batch):
    lm, T, P = ctx.get(("policy", name)), ctx.S["new"], ctx.S["prompt"]
    rows = prompts(ctx, batch, P)
    engine = Forced(lm, ctx.x)
    ours = lambda: ex.rollout(engine, ctx.tok, rows, ctx.sandbox, temperature=0, max_new_tokens=T,  # noqa: E731
                              max_context=P + T + 8)
    ours()  # warm-up (kernels, allocator), both sides
    generate(ctx, lm, rows, [ctx.x] * T)
    t_ours, _, out = measured(ctx, ours)
    if any(len(s.ids) != P + T for s in out):
        raise RuntimeError(f"engine decoded {[len(s.ids) - P for s in out]} tokens, not {T}")
    t_gen, _, new = measured(ctx, lambda: generate(ctx, lm, rows, [ctx.x] * T))
    if ctx.bandwidth is None:
        ctx.bandwidth = copy_bandwidth(ctx)
    read = weight_bytes(lm) + batch * (P + T / 2) * kv_bytes_per_token(ctx, lm)  # bytes per decode step
    bound = batch * ctx.bandwidth / read
    n = batch * T
    return dict(engine_tok_s=n / t_ours, generate_tok_s=n / t_gen, speedup=t_gen / t_ours, bound_tok_s=bound,
                engine_of_bound=n / t_ours / bound, generate_of_bound=n / t_gen / bound,
                same_tokens=all(s.ids[P:] == g for s, g in zip(out, new)))


def rollout_row(ctx, turns=3):
    lm, S = ctx.get(("policy", ctx.S["big"])), ctx.S
    G, P = S["group"], S["history"]
    rows = prompts(ctx, S["rollout_batch"] // G, P)
    script = []
    for k in range(turns):
        code = ctx.tok.encode(f"\n```python\nprint({k})\n```", add_special_tokens=False)
        script.append([ctx.x] * (S["turn"] - len(code)) + code)
    script.append([ctx.x] * 4 + [ctx.eos])
    ours = lambda: ex.rollout(Forced(lm, TurnPlan(script, ctx.eos)), ctx.tok, rows, ctx.sandbox,  # noqa: E731
                              n=G, temperature=0, max_context=P + (turns + 1) * (S["turn"] + 64))
    t_ours, _, out = measured(ctx, ours)
    if any(len(s.blocks) != turns or s.finish_reason != "stop" for s in out):
        raise RuntimeError(f"engine rows ran {[len(s.blocks) for s in out]} blocks, not {turns} each")

    def regenerate():
        hist = [list(p) for p in rows for _ in range(G)]
        for k, tokens in enumerate(script):
            for h, new in zip(hist, generate(ctx, lm, hist, tokens)):
                h += new
            if k < turns:
                res = ctx.sandbox.run_many([f"print({k})"] * len(hist))
                for h, r in zip(hist, res):
                    h += ctx.tok.encode(ex.output_block(r.output), add_special_tokens=False)
        return hist
    t_gen, _, hist = measured(ctx, regenerate)
    n = len(out) * sum(map(len, script))  # model tokens, both sides
    return dict(rows=len(out), history=P, tool_calls=turns, engine_tok_s=n / t_ours, generate_tok_s=n / t_gen,
                speedup=t_gen / t_ours, same_ids=all(s.ids == h for s, h in zip(out, hist)))


def batching_row(ctx):
    """Waves against continuous batching at the same rows on bench_rollout.py (c)'s
    long-tailed workload, S["tail"] = (samples, budget, short), forced greedy tokens."""
    lm, S = ctx.get(("policy", ctx.S["big"])), ctx.S
    (n, budget, short), rows = S["tail"], S["rollout_batch"]
    model, prompts = bench_rollout.long_tail(lm, ctx.tok, n, S["group"], budget, short)
    run = lambda p, b, waves: bench_rollout.waves_or_continuous(model, ctx.tok, p, ctx.sandbox,  # noqa: E731
                                                                S["group"], rows, b, waves)
    run(prompts[:rows // S["group"]], 4, False)  # warm-up
    got = {name: measured(ctx, lambda: run(prompts, budget, name == "waves")) for name in ("waves", "continuous")}
    (t_w, peak_w, (wav, occ_w)), (t_c, peak_c, (cont, occ_c)) = got["waves"], got["continuous"]
    tokens = sum(s.n_model_tokens for s in cont)
    return dict(samples=n, rows=rows, budget=budget, at_budget=sum(s.finish_reason == "length" for s in cont),
                model_tokens=tokens, waves_s=t_w, continuous_s=t_c, waves_tok_s=tokens / t_w,
                continuous_tok_s=tokens / t_c, waves_occupancy=occ_w, continuous_occupancy=occ_c,
                waves_peak_gib=peak_w, continuous_peak_gib=peak_c, speedup=t_w / t_c,
                same_ids=[s.ids for s in wav] == [s.ids for s in cont])


def grpo_row(ctx, length, ckpt):
    model, opt = ctx.get("trainer")
    checkpointing = set_checkpointing(ctx, model, ckpt)
    args = grpo.parse_args(STAGE_ARGS + ["--micro-batch", "1"])
    d = grpo.Dist(device=ctx.dev, autocast_dtype=ctx.autocast)
    samples = synthetic_samples(ctx, length, 2)
    t, peak, m = measured(ctx, lambda: grpo.update_policy(model, opt, samples, torch.tensor([1.0, -1.0]), d,
                                                          pad_id=ctx.pad,
                                                          **{k: getattr(args, k) for k in grpo.UPDATE_ARGS}))
    return dict(seq_tokens=length, sequences=2, checkpointing=checkpointing, time_s=t, train_tok_s=2 * length / t,
                peak_gib=peak, loss_tokens=m["sums"]["loss_tokens"])


def sft_row(ctx, length, ckpt):
    model, opt = ctx.get("trainer")
    checkpointing = set_checkpointing(ctx, model, ckpt)
    t, peak, _ = measured(ctx, lambda: sft_step(ctx, model, opt, length))
    return dict(seq_tokens=length, sequences=1, checkpointing=checkpointing, time_s=t, train_tok_s=length / t,
                peak_gib=peak)


def fit_row(ctx, prompts_per_rank=16):
    """prompts_per_rank: the paper's 128 prompts per step over 8 GPUs."""
    (model, opt), policy = ctx.get("trainer"), ctx.get(("policy", ctx.S["big"]))
    opt.zero_grad(set_to_none=True)  # as between GRPO steps: no gradients during rollouts
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None] + state
    resident = sum(t.numel() * t.element_size() for t in tensors) + weight_bytes(policy)
    if ctx.cuda:
        capacity = torch.cuda.mem_get_info(ctx.dev)[1]
    else:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kv = kv_bytes_per_token(ctx, policy)
    seqs = int((0.9 * capacity - resident) // (kv * ctx.S["context"]))
    return dict(capacity_gib=capacity / GiB, resident_gib=resident / GiB, kv_bytes_per_token=kv,
                context=ctx.S["context"], sequences=seqs, max_num_seqs=seqs,
                share_of_step=min(1.0, seqs / (prompts_per_rank * ctx.S["group"])))


def layout_row(ctx, layout):
    """The README's layout per rank, by `sft.memory_plan`'s arithmetic on this device's memory:
    "FSDP-8" (fp32 weights, gradients and AdamW over 8 ranks) or "DDP-8" (all of them on every
    rank), plus the whole rollout copy; rows admitted at --max-num-seqs 32 under the default
    budget (90% of the device less that state) at the stage 1 and stage 3 contexts. Also checks
    the plan's KV bytes a token against the bytes a real cache holds."""
    policy = ctx.get(("policy", ctx.S["big"]))
    n = sum(p.numel() for p in policy.parameters())
    width = policy.dtype.itemsize
    if ctx.cuda:
        cap = torch.cuda.mem_get_info(ctx.dev)[1]
    else:
        cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    state = sft.state_gib(n, 8, fsdp=layout == "FSDP-8", rollout_bytes=width)
    row = dict(params=n, capacity_gib=cap / GiB, state_gib=state, kv_bytes_per_token=sft.kv_bytes_per_token(
        policy.config, width), kv_formula_matches=sft.kv_bytes_per_token(policy.config, width) ==
        kv_bytes_per_token(ctx, policy))
    for c in (ctx.S["context"], 2 * ctx.S["context"]):
        try:
            row[f"rows_at_{c}"] = sft.memory_plan(policy.config, width, 32, c, 0.9 * cap / GiB - state, state,
                                                  torch.device("cpu"))[0]
        except ex.InputError:  # not one row fits beside the state
            row[f"rows_at_{c}"] = 0
    return row


def feed_row(ctx):
    """One S["block"]-token output block fed on row 0 while the other rows decode a token, at
    the rows `sft.memory_plan` admits for the FSDP-8 layout at 2 x S["context"] (stage 3) on
    this device's memory, over a KV cache filled to that width (zeros written into the
    engine's slab: its content does not change the memory). The peak above what was allocated
    before (weights, cache) against the plan's figure; the repeat_kv copy transformers' sdpa
    would add, for comparison."""
    lm, width, block = ctx.get(("policy", ctx.S["big"])), 2 * ctx.S["context"], ctx.S["block"]
    cfg, dtype_bytes = lm.config, lm.dtype.itemsize
    cap = torch.cuda.mem_get_info(ctx.dev)[1] if ctx.cuda else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    state = sft.state_gib(sum(p.numel() for p in lm.parameters()), 8, fsdp=True, rollout_bytes=dtype_bytes)
    rows = sft.memory_plan(cfg, dtype_bytes, 32, width, 0.9 * cap / GiB - state, state, torch.device("cpu"))[0]
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cache = ex._kv_cache(lm, width + block)
    zeros = torch.zeros(rows, kv_heads, width, head_dim, dtype=lm.dtype, device=ctx.dev)
    for layer in cache.layers:
        layer.update(zeros, zeros)
    del zeros
    mask = torch.ones(rows, width, dtype=torch.long, device=ctx.dev)
    feeds = [[ctx.x] * block] + [[ctx.x]] * (rows - 1)
    before = torch.cuda.memory_allocated(ctx.dev) if ctx.cuda else None
    with torch.inference_mode():
        t, peak, _ = measured(ctx, lambda: ex._forward_chunk(lm, cache, mask, feeds, ctx.pad))
    plan = rows * sft.feed_transient_bytes(cfg, dtype_bytes, width + block, ex.FEED_CHUNK)
    transient = peak - before / GiB if ctx.cuda else None
    return dict(rows=rows, width=width, block=block, time_s=t, transient_gib=transient, plan_gib=plan / GiB,
                within_plan=None if transient is None else transient <= plan / GiB,
                kv_cache_gib=sft.kv_bytes_per_token(cfg, dtype_bytes) * rows * width / GiB,
                repeat_kv_gib=2 * rows * heads * (width + block) * head_dim * dtype_bytes / GiB)


def two_ranks_row(ctx):
    """grpo.py itself under torchrun on 2 ranks with --fsdp (NCCL on 2 GPUs; gloo on CPU in the
    dry run), 2 steps of the tiny model with a reward that gives every group signal: the
    process group and its timeout, sync_policy's gathers, the sharded update and checkpoint."""
    if ctx.cuda and torch.cuda.device_count() < 2:
        return dict(skipped=f"{torch.cuda.device_count()} GPU: needs 2")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "reward.py"), "w") as f:
            f.write("def alternate(samples, problems):\n    return [float(i % 2) for i in range(len(samples))]\n")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(ROOT, "grpo.py"), "--model", tiny.save_tiny(os.path.join(tmp, "m")), "--data",
               STAGE_ARGS[1], "--out", os.path.join(tmp, "rl"), "--steps", "2", "--prompts-per-step", "2",
               "--group-size", "2", "--max-new-tokens", "16", "--exec-workers", "1", "--fsdp", "--no-progress",
               "--reward", os.path.join(tmp, "reward.py") + ":alternate"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(f"exit {r.returncode}: {r.stderr[-300:]}")
        rows = ex.read_jsonl_tolerant(os.path.join(tmp, "rl", "metrics.jsonl"))
        return dict(ranks=2, steps=len(rows), optimizer_steps=sum(m["optimizer_steps"] for m in rows),
                    time_s=time.perf_counter() - t0,
                    plan=next((x for x in r.stdout.splitlines() if x.startswith("memory plan")), None))


def plan(S):
    """(label, objects the row needs, function, args), in run order."""
    big = ("policy", S["big"])
    rows = [(f"decode {m} b{b}", {("policy", m)}, decode_row, (m, b)) for m in S["models"] for b in S["batches"]]
    rows.append((f"rollout {S['big']} b{S['rollout_batch']}", {big}, rollout_row, ()))
    rows.append((f"batching {S['big']} b{S['rollout_batch']}", {big}, batching_row, ()))
    rows += [(f"grpo {L} ckpt={int(c)}", {big, "trainer"}, grpo_row, (L, c)) for c in (False, True) for L in S["grpo"]]
    rows.append((f"fit {S['big']} @{S['context']}", {big, "trainer"}, fit_row, ()))
    rows += [(f"layout {S['big']} {lay}", {big, "trainer"}, layout_row, (lay,)) for lay in ("FSDP-8", "DDP-8")]
    rows += [(f"sft {L} ckpt={int(c)}", {"trainer"}, sft_row, (L, c)) for c in (False, True) for L in S["sft"]]
    rows.append((f"feed {S['big']} {S['block']} @{2 * S['context']}", {big}, feed_row, ()))
    rows.append(("ranks2 grpo --fsdp", set(), two_ranks_row, ()))
    return rows


# -----------------------------------------------------------------------------
# Main


def fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main(argv=None):
    p = argparse.ArgumentParser(description="GPU check of the paper-scale path")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes (seconds on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", default="", help="comma-separated label prefixes to run "
                   "(decode,rollout,batching,grpo,fit,layout,sft,feed,ranks2)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "runs", "gpu_check.json"),
                   help="JSON report path")
    a = p.parse_args(argv)
    if not a.dry_run and a.device == "cpu":
        p.error("paper shapes need a GPU; use --dry-run on CPU")
    threads = torch.get_num_threads()
    if a.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only add stalls on a shared machine
    try:
        return run_rows(a)
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process by the test


def run_rows(a):
    ctx = Context(a)
    name = torch.cuda.get_device_name(ctx.dev) if ctx.cuda else "cpu"
    report = dict(device=name, dry_run=a.dry_run, torch=torch.__version__, transformers=transformers.__version__,
                  copy_bandwidth_gb_s=None, wall_s=0.0, rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    t_start = time.perf_counter()
    try:
        for label, needs, fn, args in plan(ctx.S):
            if a.rows and not label.startswith(tuple(a.rows.split(","))):
                continue
            ctx.keep(needs)
            t0 = time.perf_counter()
            try:
                row = dict(row=label, **fn(ctx, *args))
            except Exception as e:  # e.g. out of memory: record it, free what it held, go on
                row = dict(row=label, error=f"{type(e).__name__}: {str(e)[:300]}")
            if "error" in row and "trainer" in ctx.objects:
                ctx.objects["trainer"][1].zero_grad(set_to_none=True)  # a half-done backward
            ctx.keep(needs)
            row["wall_s"] = time.perf_counter() - t0
            report["rows"].append(row)
            report["copy_bandwidth_gb_s"] = ctx.bandwidth / 1e9 if ctx.bandwidth else None
            report["wall_s"] = time.perf_counter() - t_start
            print(f"{label:<28} " + "  ".join(f"{k}={fmt(v)}" for k, v in row.items() if k != "row"), flush=True)
            with open(a.out, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        ctx.close()
    print(f"{name}, copy bandwidth {fmt(report['copy_bandwidth_gb_s'])} GB/s, {report['wall_s']:.0f} s; "
          f"report: {a.out}")
    return sum("error" in r for r in report["rows"])


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
