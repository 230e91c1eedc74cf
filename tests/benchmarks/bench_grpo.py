"""Benchmark: wall time of one GRPO step and its split (rollout / execution / training), and,
when TRL is installed, the same single-turn step through TRL's GRPOTrainer in the same run.
Not a test (pytest does not collect it).

    python tests/benchmarks/bench_grpo.py                        # a random tiny Qwen3 (CPU)
    python tests/benchmarks/bench_grpo.py --hidden 512 --layers 8
    python tests/benchmarks/bench_grpo.py --model /path/to/Qwen2.5-0.5B-Instruct

Both sides: the same model and prompts (the THINC system prompt + a problem), G samples per
prompt, exactly `--new-tokens` completion tokens (no EOS on either side), temperature 1, no KL, eps 0.20 / 0.28,
token-level loss, one optimizer step per rollout batch, and a toy reward with signal (first completion
token id even). Single turn: no code is executed (a fair comparison with TRL, which has no
tool loop). Target: grpo.py >= 1.5x faster per step.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", ".."), os.path.join(os.path.dirname(__file__), "..")]
import executor as ex  # noqa: E402
import grpo  # noqa: E402
import tiny  # noqa: E402


def reward(samples, problems):
    """grpo's batch reward: 1 when a sample's first completion token id is even."""
    return [float(len(s.ids) > len(s.prompt_ids) and s.ids[len(s.prompt_ids)] % 2 == 0) for s in samples]


def bench_ours(lm, tok, problems, a, device):
    args = grpo.parse_args(["--out", "-"])
    args.prompts_per_step, args.group_size, args.max_new_tokens = a.prompts, a.group, a.new_tokens
    args.micro_batch, args.max_num_seqs, args.lr, args.max_tool_calls = a.micro_batch, 0, 1e-6, 0
    d = grpo.Dist(device=device, autocast_dtype=torch.bfloat16 if device.type == "cuda" else None)
    policy = copy.deepcopy(lm).to(device=device, dtype=torch.bfloat16 if d.autocast_dtype else torch.float32).eval()
    model = lm.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stream = grpo.PromptStream(problems, 0)
    rows = []
    with ex.Sandbox(workers=2) as sb:
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            grpo.sync_policy(model, policy)
            m, _, _ = grpo.grpo_step(model, policy, tok, opt, sb, stream.next(a.prompts), args, d, step,
                                     reward_fn=reward)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows.append((time.perf_counter() - t0, m["time_rollout"], m["time_exec"], m["time_train"],
                         m["model_tokens_per_sample"]))
    return rows[1:] if len(rows) > 1 else rows  # the first step warms up


def bench_trl(lm, tok, problems, a):
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"TRL comparison skipped: {e}")
        return None
    ds = Dataset.from_list([{"prompt": [{"role": "system", "content": ex.SYSTEM_PROMPT},
                                        {"role": "user", "content": p["problem"]}]} for p in problems])

    def trl_reward(completions, completion_ids=None, **kw):
        return [float(bool(c) and c[0] % 2 == 0) for c in completion_ids]

    cfg = GRPOConfig(output_dir="/tmp/bench_trl", num_generations=a.group,
                     per_device_train_batch_size=a.prompts * a.group,
                     max_completion_length=a.new_tokens, temperature=1.0, beta=0.0, epsilon=0.20, epsilon_high=0.28,
                     loss_type="dapo", learning_rate=1e-6, max_steps=a.steps, logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=not torch.cuda.is_available(),
                     # the same numerics and work as grpo.py's side: bf16 autocast on CUDA only (fp32 on CPU),
                     # no gradient checkpointing. TRL's own defaults (bf16=True everywhere, checkpointing on)
                     # would compare a bf16 CPU step against an fp32 one.
                     bf16=torch.cuda.is_available(), gradient_checkpointing=False, disable_tqdm=True,
                     generation_kwargs={"min_new_tokens": a.new_tokens})  # no EOS: every sample is full length
    times, lengths = [], []

    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer = GRPOTrainer(model=lm, reward_funcs=trl_reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    return (times[1:], lengths[1:]) if len(times) > 1 else (times, lengths)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="HF model dir; default a random tiny Qwen3")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="G")
    p.add_argument("--new-tokens", type=int, default=64, help="completion tokens per sample")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.model:
        lm, tok = ex.load_model(a.model, dtype="float32", device="cpu")
    else:
        tok = tiny.make_tokenizer()
        lm = tiny.make_model(tok, hidden=a.hidden, layers=a.layers)
    problems = [{"id": str(i), "problem": f"How many integers up to {50 * (i + 1)} are sums a + b + ab?",
                 "answer": "0"} for i in range(a.prompts * (a.steps + 1))]
    trl_lm = copy.deepcopy(lm)
    ex.stop_token_ids = lambda *args, **kw: set()  # no EOS: every sample is full length, as on TRL's side
    rows = bench_ours(lm, tok, problems, a, device)
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"grpo.py  step {med[0]:.3f} s (median of {len(rows)}): rollout {med[1]:.3f}, exec {med[2]:.3f}, "
          f"train {med[3]:.3f}, {med[4]:.0f} completion tokens / sample  "
          f"[{a.prompts} prompts x G {a.group}, <= {a.new_tokens} new tokens, {device}]")
    trl = bench_trl(trl_lm, tok, problems, a)
    if trl and trl[0]:
        t = statistics.median(trl[0])
        length = f", {statistics.median(trl[1]):.0f} completion tokens / sample" if trl[1] else ""
        print(f"TRL      step {t:.3f} s (median of {len(trl[0])}){length};  "
              f"speed-up {t / med[0]:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main()
