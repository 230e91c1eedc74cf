"""Benchmark: the hand-written KV-cached sampler against transformers `generate`.

(a) plain greedy decode of a batch of 8 prompts: `executor.rollout` vs `model.generate`;
(b) a three-turn tool rollout (model text, an output block, model text, ...): the engine
    continues every turn from its KV cache, while the baseline calls `generate` once per
    turn on the whole history (a fresh prefill each turn, as stop-string loops do).
Both sides decode the same number of tokens with the same random-initialised model.

    python tests/benchmarks/bench_rollout.py [--hidden 512 --layers 8 --tokens 64]
"""
import argparse
import os
import sys
import time

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", ".."), os.path.join(os.path.dirname(__file__), "..")]
import executor as ex  # noqa: E402
import tiny  # noqa: E402
from test_engine import Scripted  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per row (per turn in b)")
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    tok = tiny.make_tokenizer()
    model = tiny.make_model(tok, hidden=args.hidden, layers=args.layers)
    model.generation_config.eos_token_id = None  # neither side may stop early
    problems = [f"How many integers up to {50 * (i + 1)} are sums a + b + ab? Count them." * (1 + i % 3)
                for i in range(args.batch)]
    prompts = [ex.build_prompt_ids(tok, q) for q in problems]
    T = args.tokens

    with ex.Sandbox(workers=2) as sb:
        # (a) plain decode
        ex.rollout(model, tok, prompts[:2], sb, temperature=0, max_new_tokens=4)  # warm-up
        t0 = time.perf_counter()
        ours = ex.rollout(model, tok, prompts, sb, temperature=0, max_new_tokens=T, max_context=1 << 20)
        t_ours = time.perf_counter() - t0
        ids, mask = ex._pad_left(prompts, tok.pad_token_id, "cpu")
        t0 = time.perf_counter()
        with torch.inference_mode():
            ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=T,
                                 min_new_tokens=T, pad_token_id=tok.pad_token_id)
        t_gen = time.perf_counter() - t0
        same = all(o.ids[len(pr):] == ref[i, ids.shape[1]:].tolist() for i, (o, pr) in enumerate(zip(ours, prompts)))
        n = args.batch * T
        print(f"(a) decode batch {args.batch} x {T} tokens: engine {n / t_ours:.1f} tok/s, "
              f"generate {n / t_gen:.1f} tok/s, ratio {t_gen / t_ours:.2f}x (same tokens: {same})")

        # (b) three turns: each turn T model tokens ending in a closed block, then its output
        x = tok.encode("x", add_special_tokens=False)[0]
        eos = tok.eos_token_id
        turn = lambda k: tok.encode(f"\n```python\nprint({k})\n```", add_special_tokens=False)  # noqa: E731
        # one prompt, the same scripted turns in every row (a group of `batch` samples)
        prompts = [prompts[0]] * args.batch
        seq = list(prompts[0])
        for k in range(args.turns):
            code = turn(k)
            seq += [x] * (T - len(code)) + code
            seq += tok.encode(f"\n```output\n{k}\n```\n", add_special_tokens=False)
        scripted = Scripted(model, [seq + [x] * 4 + [eos]], eos)
        t0 = time.perf_counter()
        ours = ex.rollout(scripted, tok, prompts[:1], sb, n=args.batch, temperature=0, max_context=1 << 20)
        t_ours = time.perf_counter() - t0
        assert all(len(o.blocks) == args.turns for o in ours), [(len(o.blocks), o.finish_reason, o.text[-200:]) for o in ours[:2]]
        # baseline: generate T tokens per turn over the whole history, run the block, append
        t0 = time.perf_counter()
        hist = [list(pr) for pr in prompts]
        with torch.inference_mode():
            for k in range(args.turns):
                ids, mask = ex._pad_left(hist, tok.pad_token_id, "cpu")
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=T,
                                     min_new_tokens=T, pad_token_id=tok.pad_token_id)
                res = sb.run_many([f"print({k})"] * len(hist))
                for i in range(len(hist)):
                    hist[i] += out[i, ids.shape[1]:].tolist()
                    hist[i] += tok.encode(f"\n```output\n{res[i].output.strip()}\n```\n", add_special_tokens=False)
        t_gen = time.perf_counter() - t0
        n = args.batch * T * args.turns
        print(f"(b) {args.turns}-turn tool rollout, batch {args.batch}: engine {n / t_ours:.1f} model tok/s, "
              f"generate + re-prefill {n / t_gen:.1f} tok/s, ratio {t_gen / t_ours:.2f}x")


if __name__ == "__main__":
    main()
