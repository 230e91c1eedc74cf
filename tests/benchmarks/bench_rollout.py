"""Benchmark: the hand-written KV-cached sampler against transformers `generate`.

(a) plain greedy decode of a batch of 8 prompts: `executor.rollout` vs `model.generate`;
(b) a three-turn tool rollout (model text, an output block, model text, ...): the engine
    continues every turn from its KV cache, while the baseline calls `generate` once per
    turn on the whole history (a fresh prefill each turn, as stop-string loops do).
(c) continuous batching against waves on a long-tailed workload: --samples samples in
    groups of --group per prompt, each drawing its length (about a quarter run to the
    budget of 4 x --tokens model tokens, the rest stop after 1/4 .. 1 x --tokens), --batch
    rows at most on both sides; waves call `rollout` on --batch // --group prompts at a
    time (the pre-continuous use), continuous batching calls it once with
    max_num_seqs=--batch. Sample i has the same seed on both sides. Reports tokens/s, wall time and mean occupancy (rows
    sampling at a decode step / rows allowed, over the decode steps).
Both sides decode the same number of tokens with the same random-initialised model. Each
side runs --repeats times, alternating, and the fastest run of each is compared (other
jobs on the machine slow both sides alike).

--prompt-tokens N gives (b) the shape of distillation: each prompt is the last N tokens of
the real 3-shot teacher prompt (distill.py; 2,296 tokens with Qwen2.5's tokenizer), so the
baseline re-prefills that history every turn, as a stop-string loop around `generate` does.

    python tests/benchmarks/bench_rollout.py [--hidden 256 --layers 4 --tokens 128 --repeats 3]
    python tests/benchmarks/bench_rollout.py --prompt-tokens 2296
    python tests/benchmarks/bench_rollout.py --model qwen2.5-coder-0.5b --tokens 64 --repeats 2
    python tests/benchmarks/bench_rollout.py --cases c --samples 32 --batch 8 --tokens 64 --repeats 1
"""
import argparse
import math
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import distill  # noqa: E402
import executor as ex  # noqa: E402
import tiny  # noqa: E402
from test_engine import Scripted  # noqa: E402


class LongTail(torch.nn.Module):
    """The model's real forward (KV cache, lm_head), then forced logits: after a prompt (its
    last token is `start`) a draw over the marks, the first (long) with probability 1/4 and
    each other with 3/16; a row whose last token is a mark t gets t again (all the mass)
    until it holds lengths[t] model tokens, then EOS. Every prompt has P tokens, so a row's
    position says how many it holds. Pads and other tokens get EOS (nothing is sampled there)."""

    def __init__(self, lm, start, lengths, P, eos):
        super().__init__()
        self.lm, self.start, self.lengths, self.P, self.eos = lm, start, lengths, P, eos
        self.config, self.generation_config = lm.config, lm.generation_config

    def forward(self, **kw):
        out = self.lm(**kw)
        last, pos = kw["input_ids"][:, -1].tolist(), kw["position_ids"][:, -1].tolist()
        logits = torch.full_like(out.logits[:, -1:], -1e4)  # (B, 1, V)
        for b, (t, p) in enumerate(zip(last, pos)):
            if t == self.start:
                for k, mark in enumerate(self.lengths):
                    logits[b, 0, mark] = math.log(0.25 if k == 0 else 0.1875)
            else:
                logits[b, 0, t if p - self.P + 1 < self.lengths.get(t, 0) else self.eos] = 0.0
        out.logits = logits
        return out


def long_tail(lm, tok, n, group, budget, short, question=48, seed=0):
    """(model, prompts): n // group prompts of one length (a shared chat-template head,
    `question` random ids, a start token) whose samples draw their length: about a quarter
    run past `budget` (they end by it), the rest stop after short / 4, 2, 3 or 4 x short / 4
    model tokens (and EOS)."""
    g = torch.Generator().manual_seed(seed)
    start, *marks = tok.convert_tokens_to_ids(["x", "0", "1", "2", "3", "4"])
    lengths = dict(zip(marks, [2 * budget] + [short * k // 4 for k in (1, 2, 3, 4)]))
    head = ex.build_prompt_ids(tok, "Count the pairs.")
    vocab = [i for i in range(3, min(len(tok), 30000)) if i not in marks and i not in (start, tok.eos_token_id)]
    prompts = [head + [vocab[j] for j in torch.randint(len(vocab), (question,), generator=g).tolist()] + [start]
               for _ in range(n // group)]
    return LongTail(lm, start, lengths, len(prompts[0]), tok.eos_token_id), prompts


def waves_or_continuous(model, tok, prompts, sandbox, group, rows, budget, waves, seed=0):
    """(samples, mean occupancy): `group` samples of each prompt (temperature 1, sample i
    seeded from (seed, i) on both sides), at most `rows` at once: in waves of rows // group
    prompts (one rollout call each), or in one continuous-batching call."""
    steps, sampled = [0], [0]

    def count(tokens, done=None):
        steps[0] += tokens > 0
        sampled[0] += tokens
    seeds = [seed * 1_000_003 + i for i in range(len(prompts) * group)]
    kw = dict(n=group, temperature=1.0, max_new_tokens=budget, max_context=1 << 20, progress=count)
    if waves:
        w = rows // group
        out = [s for k in range(0, len(prompts), w)
               for s in ex.rollout(model, tok, prompts[k:k + w], sandbox, seed=seeds[k * group:(k + w) * group], **kw)]
    else:
        out = ex.rollout(model, tok, prompts, sandbox, seed=seeds, max_num_seqs=rows, **kw)
    return out, sampled[0] / (steps[0] * rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf or packaged model name; default a random tiny Qwen3 (--hidden, --layers)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per row (per turn in b)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = all cores")
    p.add_argument("--repeats", type=int, default=3, help="runs per side; the fastest counts")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="(b) only: prompts of this many tokens from the 3-shot teacher prompt; 0 = short")
    p.add_argument("--samples", type=int, default=32, help="(c) only: samples of the long-tailed workload")
    p.add_argument("--group", type=int, default=4, help="(c) only: samples per prompt (GRPO's G, evaluation's k)")
    p.add_argument("--cases", default="abc", help="which cases to run, e.g. 'c'")
    args = p.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count())
    if args.model:
        model, tok = ex.load_model(args.model, dtype="float32")
    else:
        tok = tiny.make_tokenizer()
        model = tiny.make_model(tok, hidden=args.hidden, layers=args.layers)
    # (a): neither side may stop early, both decode exactly the budget
    model.generation_config.eos_token_id = None
    stop_token_ids, ex.stop_token_ids = ex.stop_token_ids, lambda *a, **k: set()
    if tok.pad_token_id is None:
        tok.pad_token_id = 0
    problems = [f"How many integers up to {50 * (i + 1)} are sums a + b + ab? Count them." * (1 + i % 3)
                for i in range(args.batch)]
    prompts = [ex.build_prompt_ids(tok, q) for q in problems]
    T = args.tokens

    def best(ours, base):
        """Run both sides --repeats times, alternating; (fastest ours, fastest base, last outputs)."""
        times, outs = ([], []), [None, None]
        for _ in range(args.repeats):
            for j, fn in enumerate((ours, base)):
                t0 = time.perf_counter()
                outs[j] = fn()
                times[j].append(time.perf_counter() - t0)
        return min(times[0]), min(times[1]), outs

    with ex.Sandbox(workers=2) as sb:
        ex.rollout(model, tok, prompts[:2], sb, temperature=0, max_new_tokens=4)  # warm-up
        if "a" in args.cases:  # (a) plain decode
            ids, mask = ex._pad_left(prompts, tok.pad_token_id, "cpu")

            def generate():
                with torch.inference_mode():
                    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=T,
                                          min_new_tokens=T, pad_token_id=tok.pad_token_id)
            t_ours, t_gen, (ours, ref) = best(
                lambda: ex.rollout(model, tok, prompts, sb, temperature=0, max_new_tokens=T, max_context=1 << 20),
                generate)
            same = all(o.ids[len(pr):] == ref[i, ids.shape[1]:].tolist()
                       for i, (o, pr) in enumerate(zip(ours, prompts)))
            n = args.batch * T
            print(f"(a) decode batch {args.batch} x {T} tokens: engine {n / t_ours:.1f} tok/s, "
                  f"generate {n / t_gen:.1f} tok/s, ratio {t_gen / t_ours:.2f}x (same tokens: {same})")

        # (b) three turns: each turn T model tokens ending in a closed block, then its output
        ex.stop_token_ids = stop_token_ids  # the scripted rows end with EOS
        if "b" in args.cases:
            x = tok.encode("x", add_special_tokens=False)[0]
            eos = tok.eos_token_id
            turn = lambda k: tok.encode(f"\n```python\nprint({k})\n```", add_special_tokens=False)  # noqa: E731
            prompt = prompts[0]
            if args.prompt_tokens:
                exemplars = distill.load_exemplars(os.path.join(ROOT, "data", "exemplars.jsonl"))
                prompt = ex.stage_prompt_ids(tok, problems[0], exemplars=exemplars)[-args.prompt_tokens:]
            # one prompt, the same scripted turns in every row (a group of `batch` samples)
            seq = list(prompt)
            for k in range(args.turns):
                code = turn(k)
                seq += [x] * (T - len(code)) + code
                seq += tok.encode(f"\n```output\n{k}\n```\n", add_special_tokens=False)
            scripted = Scripted(model, [seq + [x] * 4 + [eos]], eos)

            def engine():
                out = ex.rollout(scripted, tok, [prompt], sb, n=args.batch, temperature=0, max_context=1 << 20)
                assert all(len(o.blocks) == args.turns for o in out), [(len(o.blocks), o.finish_reason) for o in out]
                return out

            def regenerate():
                # baseline: generate T tokens per turn over the whole history, run the block, append
                hist = [list(prompt) for _ in range(args.batch)]
                with torch.inference_mode():
                    for k in range(args.turns):
                        ids, mask = ex._pad_left(hist, tok.pad_token_id, "cpu")
                        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=T,
                                             min_new_tokens=T, pad_token_id=tok.pad_token_id)
                        res = sb.run_many([f"print({k})"] * len(hist))
                        for i in range(len(hist)):
                            hist[i] += out[i, ids.shape[1]:].tolist()
                            hist[i] += tok.encode(f"\n```output\n{res[i].output.strip()}\n```\n",
                                                  add_special_tokens=False)
                return hist
            t_ours, t_gen, _ = best(engine, regenerate)
            n = args.batch * T * args.turns
            print(f"(b) {args.turns}-turn tool rollout, batch {args.batch}, prompt {len(prompt)} tokens: "
                  f"engine {n / t_ours:.1f} model tok/s, generate + re-prefill {n / t_gen:.1f} tok/s, "
                  f"ratio {t_gen / t_ours:.2f}x")

        if "c" in args.cases:  # (c) long tail: continuous batching against waves at --batch rows
            budget = 4 * T
            lm, prompts = long_tail(model, tok, args.samples, args.group, budget, T)
            t_c, t_w, ((cont, occ_c), (wav, occ_w)) = best(
                lambda: waves_or_continuous(lm, tok, prompts, sb, args.group, args.batch, budget, waves=False),
                lambda: waves_or_continuous(lm, tok, prompts, sb, args.group, args.batch, budget, waves=True))
            n = sum(s.n_model_tokens for s in cont)
            at_budget = sum(s.finish_reason == "length" for s in cont)
            same = [s.ids for s in cont] == [s.ids for s in wav]
            print(f"(c) long tail, {len(cont)} samples of {len(prompts)} prompts "
                  f"({at_budget} to the budget of {budget} tokens, {n} model "
                  f"tokens), {args.batch} rows: waves {n / t_w:.1f} tok/s, {t_w:.2f} s, occupancy {occ_w:.2f}; "
                  f"continuous {n / t_c:.1f} tok/s, {t_c:.2f} s, occupancy {occ_c:.2f}; ratio {t_w / t_c:.2f}x "
                  f"(same tokens: {same})")


if __name__ == "__main__":
    main()
