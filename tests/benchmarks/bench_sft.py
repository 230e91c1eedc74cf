"""Benchmark: sft.py's masked SFT loop against TRL's SFTTrainer on the same model, data and
batches, in one run. Not a test (pytest does not collect it).

    python tests/benchmarks/bench_sft.py                            # random Qwen3, hidden 256, 4 layers
    python tests/benchmarks/bench_sft.py --steps 8 --micro-batch 2
    python tests/benchmarks/bench_sft.py --trl-sampler random       # TRL's own (random) batching
    python tests/benchmarks/bench_sft.py --threads 1 --repeats 2    # on a shared / busy machine

On a machine where other processes run, use --threads 1: with torch's default of one thread per
core, a busy core stalls every parallel region and steps get up to 10x slower at random.

Data: `--n` synthetic THINC trajectories (a plan, 1-3 ```python blocks whose ```output blocks
the sandbox really printed, some of them tracebacks, then \\boxed{...}), written to a temp JSONL
and read by each side with `sft.load_sft_data` (identical ids; loss on model + output tokens,
never on the prompt). TRL gets them pre-tokenised: `input_ids` plus a `completion_mask` equal to
sft.py's loss mask, with `completion_only_loss=True`.

Each side runs in its own subprocess (so peak RSS is its own), from the same random init:
global batch `--global-batch` = `--micro-batch` x accumulation, `--steps` optimizer steps, AdamW
(0.9, 0.999, eps 1e-8, no weight decay), cosine LR without warmup, clip 1.0, fp32, no gradient
checkpointing (TRL's default of it is turned off). sft.py's side calls its own functions
(step_indices, micro_batches_for_rank, collate, backward_step) exactly as `sft.main` does, minus
checkpoint I/O. By default (`--trl-sampler same`) TRL is fed the very micro-batches sft.py
builds (a sequential sampler over the examples in sft.py's order), so both sides process
identical padded tensors and their per-step losses must agree: the speed and memory gap is then
the implementation of the step alone. `--trl-sampler random` (TRL's default) shows TRL's own
batching instead, with more padding.

Reported: tokens/s (non-pad tokens of steps 2..N over their wall time; step 1 warms up), the
median step time, peak RSS of the process and peak RSS minus the RSS once model and data were
loaded (optimizer state, gradients, activations, trainer overhead).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path[:0] = [ROOT, os.path.join(HERE, "..")]


# -----------------------------------------------------------------------------
# data: THINC-style trajectories with real sandbox outputs

def _problems(n):
    """(problem, plan, [code blocks], answer-from-last-output?) rows of varied length."""
    out = []
    for i in range(n):
        k = i % 8
        N = 10 + 7 * i
        if k == 0:
            out.append((f"What is the sum of the integers from 1 to {N}?",
                        "Sum with a loop, then check with the formula n(n+1)/2.",
                        [f"print(sum(range(1, {N} + 1)))", f"n = {N}\nprint(n * (n + 1) // 2)"]))
        elif k == 1:
            out.append((f"How many primes are below {N * 3}?", "Count them with sympy.",
                        [f"import sympy\nprint(len(list(sympy.primerange({N * 3}))))"]))
        elif k == 2:
            out.append((f"How many integers n between 1 and {N * 2} are divisible by 3 or 5?",
                        "Enumerate the integers and count those divisible by 3 or by 5. "
                        "Then confirm with inclusion-exclusion.",
                        [f"print(sum(1 for n in range(1, {N * 2} + 1) if n % 3 == 0 or n % 5 == 0))",
                         f"M = {N * 2}\nprint(M // 3 + M // 5 - M // 15)"]))
        elif k == 3:
            out.append((f"How many integers up to {N} are of the form a + b + ab with 1 <= a < b?",
                        "Let us enumerate all pairs and count the distinct values.",
                        [f"s = set()\nfor a in range(1, {N} + 1):\n    for b in range(a + 1, {N} + 1):\n"
                         f"        if a + b + a * b <= {N}:\n            s.add(a + b + a * b)\nprint(len(s))"]))
        elif k == 4:
            out.append((f"What is the remainder of {N}! divided by 1000003?",
                        "Compute the factorial modulo the prime; a first attempt divides by zero by mistake.",
                        [f"x = 0\nprint({N} / x)",
                         f"import math\nprint(math.factorial({N}) % 1000003)"]))
        elif k == 5:
            out.append((f"Factor x^2 - {N * N} and give the sum of the roots' absolute values.",
                        "Factor with sympy, then solve for the roots.",
                        [f"import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**2 - {N * N}))",
                         f"import sympy as sp\nx = sp.symbols('x')\nr = sp.solve(x**2 - {N * N}, x)\n"
                         f"print(sum(abs(v) for v in r))"]))
        elif k == 6:
            out.append((f"What is the {N}th Fibonacci number modulo 1000?",
                        "Iterate the recurrence.",
                        [f"a, b = 0, 1\nfor _ in range({N}):\n    a, b = b, a + b\nprint(a % 1000)"]))
        else:
            out.append((f"What is gcd({N * 6}, {N * 4 + 8}) + lcm(6, {N})?",
                        "Use the math module.",
                        [f"import math\nprint(math.gcd({N * 6}, {N * 4 + 8}))",
                         f"import math\nprint(math.lcm(6, {N}))",
                         f"import math\nprint(math.gcd({N * 6}, {N * 4 + 8}) + math.lcm(6, {N}))"]))
    return out


def write_trajectories(path, n):
    import executor
    rows = []
    with executor.Sandbox(workers=2, timeout=10, memory_mb=1024) as sb:
        for q, plan, codes in _problems(n):
            outs = [r.output for r in sb.run_many(codes)]  # what the sandbox really prints
            ans = outs[-1].strip().splitlines()[-1] if outs[-1].strip() else "0"
            comp = plan + "".join(f"\n```python\n{c}\n```\n```output\n{o.rstrip(chr(10))}\n```\n"
                                  for c, o in zip(codes, outs)) + f"The answer is \\boxed{{{ans}}}."
            rows.append({"problem": q, "completion": comp, "blocks": [{"output": o} for o in outs]})
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# -----------------------------------------------------------------------------
# one side, in its own process

def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def setup(a):
    import sft
    import tiny
    tok = tiny.make_tokenizer()
    lm = tiny.make_model(tok, hidden=a.hidden, layers=a.layers)
    examples, dropped = sft.load_sft_data(a.data, tok, a.max_len)
    assert len(examples) >= a.global_batch, (len(examples), dropped)
    accum = a.global_batch // a.micro_batch
    lengths = [len(e["ids"]) for e in examples]
    # the micro-batches sft.main builds for each step (one rank)
    plan = [sft.micro_batches_for_rank(sft.step_indices(s, len(examples), a.global_batch, a.seed),
                                       lengths, a.micro_batch, accum, 1, 0) for s in range(a.steps)]
    return tok, lm, examples, accum, plan


def run_ours(a):
    import torch

    import sft
    tok, lm, examples, accum, plan = setup(a)
    base = rss_kib()
    model = sft.wrap_model(lm, "cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: sft.cosine_schedule(s, a.steps, 0))
    steps = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        mbs = [sft.collate([examples[i] for i in c], tok.pad_token_id) for c in plan[step]]
        m = sft.backward_step(model, mbs, chunk_size=a.chunk_size)
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        steps.append({"s": dt, "tokens": int(m["n_tokens"]), "padded": sum(mb["input_ids"].numel() for mb in mbs),
                      "loss": m["nll_sum"] / max(1.0, m["n_loss_tokens"]), "grad_norm": float(gn)})
    return {"steps": steps, "rss_base_kib": base, "rss_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def run_trl(a):
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from executor import ROLE_MODEL, ROLE_OUTPUT
    tok, lm, examples, accum, plan = setup(a)

    def row(e):
        return {"input_ids": e["ids"], "completion_mask": [int(r in (ROLE_MODEL, ROLE_OUTPUT)) for r in e["roles"]]}

    if a.trl_sampler == "same":  # sft.py's micro-batches, in order, one pass
        rows = [row(examples[i]) for step in plan for c in step for i in c]
        sampler = "sequential"
    else:
        rows = [row(e) for e in examples]
        sampler = a.trl_sampler
    ds = Dataset.from_list(rows)
    base = rss_kib()
    cfg = SFTConfig(output_dir=os.path.join(a.tmp, "trl_out"), per_device_train_batch_size=a.micro_batch,
                    gradient_accumulation_steps=accum, max_steps=a.steps, learning_rate=a.lr,
                    lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                    adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, report_to=[],
                    save_strategy="no", use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                    completion_only_loss=True, max_length=None, pad_to_multiple_of=None, seed=a.seed,
                    dataloader_num_workers=0, train_sampling_strategy=sampler, disable_tqdm=True)
    counts = {"tokens": 0, "padded": 0}

    class Counting(SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kw):
            counts["tokens"] += int(inputs["attention_mask"].sum())
            counts["padded"] += inputs["input_ids"].numel()
            return super().compute_loss(model, inputs, *args, **kw)

    steps, marks, logged = [], [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not marks:
                marks.append((time.perf_counter(), 0, 0))

        def on_step_end(self, args, state, control, **kw):
            t, tk, pd = marks[-1]
            now = time.perf_counter()
            steps.append({"s": now - t, "tokens": counts["tokens"] - tk, "padded": counts["padded"] - pd})
            marks.append((now, counts["tokens"], counts["padded"]))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append({"loss": logs["loss"], "grad_norm": logs.get("grad_norm")})

    trainer = Counting(model=lm, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    trainer.train()
    for s, lg in zip(steps, logged):
        s.update({k: float(v) for k, v in lg.items() if v is not None})
    import trl
    return {"steps": steps, "rss_base_kib": base, "rss_peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "trl": trl.__version__, "torch_threads": torch.get_num_threads()}


# -----------------------------------------------------------------------------

def summarise(r):
    st = r["steps"][1:] if len(r["steps"]) > 1 else r["steps"]
    tok = sum(s["tokens"] for s in st)
    secs = sum(s["s"] for s in st)
    return {"tok_s": tok / secs, "step_s": statistics.median(s["s"] for s in st),
            "pad_frac": 1 - sum(s["tokens"] for s in r["steps"]) / max(1, sum(s["padded"] for s in r["steps"])),
            "peak_mib": r["rss_peak_kib"] / 1024, "delta_mib": (r["rss_peak_kib"] - r["rss_base_kib"]) / 1024}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--n", type=int, default=64, help="trajectories")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (12 = 3 epochs of 64 at 16)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per side (0 = torch's default)")
    p.add_argument("--repeats", type=int, default=1, help="runs per side, alternated; the fastest is reported")
    p.add_argument("--trl-sampler", default="same", choices=["same", "random", "group_by_length"],
                   help="'same': TRL gets sft.py's micro-batches; else TRL's own sampler")
    a = p.parse_args()
    assert a.global_batch % a.micro_batch == 0
    if a.side:
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)
        r = run_ours(a) if a.side == "ours" else run_trl(a)
        print("RESULT " + json.dumps(r))
        return

    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.2f} before the run; other processes will skew the timings")
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "traj.jsonl")
        write_trajectories(data, a.n)
        import sft
        import tiny
        exs, dropped = sft.load_sft_data(data, tiny.make_tokenizer(), a.max_len)
        lens = [len(e["ids"]) for e in exs]
        print(f"{len(exs)} trajectories ({dropped} dropped), {min(lens)}-{max(lens)} tokens "
              f"(mean {sum(lens) / len(lens):.0f}); "
              f"model Qwen3 hidden {a.hidden} x {a.layers} layers; global batch {a.global_batch} = "
              f"{a.micro_batch} x {a.global_batch // a.micro_batch}; {a.steps} steps; TRL batches: {a.trl_sampler}",
              flush=True)
        fwd = [x for x in sys.argv[1:]]
        res, sides = {}, ["ours", "trl"]
        for rep in range(a.repeats):  # alternate the sides; keep each side's fastest run
            for side in list(sides):
                cmd = [sys.executable, os.path.abspath(__file__), *fwd, "--side", side, "--data", data, "--tmp", tmp]
                pr = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                line = next((x for x in pr.stdout.splitlines() if x.startswith("RESULT ")), None)
                if pr.returncode != 0 or line is None:
                    err = pr.stderr.strip().splitlines()
                    if side == "trl" and any("No module named 'trl'" in x or "No module named 'datasets'" in x
                                             for x in err):
                        print("TRL comparison skipped: TRL is not installed")
                        sides.remove("trl")
                        continue
                    sys.exit(f"{side} side failed (rc {pr.returncode}):\n" + "\n".join(err[-30:]))
                r = json.loads(line[len("RESULT "):])
                if a.repeats > 1:
                    print(f"  run {rep + 1} {side}: {summarise(r)['tok_s']:.0f} tok/s", flush=True)
                if side not in res or summarise(r)["tok_s"] > summarise(res[side])["tok_s"]:
                    res[side] = r
    o = summarise(res["ours"])
    print(f"sft.py  {o['tok_s']:8.0f} tok/s  step {o['step_s']:.3f} s  padding {o['pad_frac']:.1%}  "
          f"peak RSS {o['peak_mib']:.0f} MiB (+{o['delta_mib']:.0f} MiB over model+data)")
    if "trl" not in res:
        return
    t = summarise(res["trl"])
    print(f"TRL {res['trl']['trl']:<7s}{t['tok_s']:5.0f} tok/s  step {t['step_s']:.3f} s  padding {t['pad_frac']:.1%}  "
          f"peak RSS {t['peak_mib']:.0f} MiB (+{t['delta_mib']:.0f} MiB over model+data)")
    print(f"sft.py / TRL: throughput {o['tok_s'] / t['tok_s']:.2f}x, "
          f"step time {t['step_s'] / o['step_s']:.2f}x faster, peak RSS {o['peak_mib'] / t['peak_mib']:.2f}x, "
          f"RSS growth {o['delta_mib'] / max(1e-9, t['delta_mib']):.2f}x")
    print(f"load average after the run: {os.getloadavg()[0]:.2f} "
          f"(torch threads per side: {res['trl']['torch_threads']})")
    lo = [s["loss"] for s in res["ours"]["steps"]]
    lt = [s.get("loss") for s in res["trl"]["steps"]]
    print("loss per step  sft.py: " + " ".join(f"{x:.4f}" for x in lo))
    print("               TRL:    " + " ".join("-" if x is None else f"{x:.4f}" for x in lt))
    if a.trl_sampler == "same" and all(x is not None for x in lt):
        print(f"max |loss difference| on identical batches: {max(abs(x - y) for x, y in zip(lo, lt)):.2e}")


if __name__ == "__main__":
    main()
