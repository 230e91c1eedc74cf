"""Benchmark: one SFT gradient with and without gradient checkpointing, on the same model and
trajectories, each side in its own subprocess (so peak RSS is its own), alternated. Not a test.

    python tests/benchmarks/bench_checkpointing.py --data runs/recipe/distill/traj.jsonl
    python tests/benchmarks/bench_checkpointing.py --data traj.jsonl --n 4 --repeats 2 --threads 1

Each side loads the model (`--model`, default the packaged 0.5B, fp32), builds the first `--n`
trajectories of `--data` as sft.py does (`sft.load_sft_data`), and times `sft.backward_step`
over them, one sequence a micro-batch (sft.py's default), after one untimed warm-up sequence.
Checkpointing recomputes each layer's forward in backward: it trades about a third more
compute for not keeping the layers' activations. Printed: seconds per side, their ratio, the
peak RSS of each process, and the largest |gradient difference| between the sides (0 or
rounding: checkpointing changes no value the loss sees).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def side(args):
    import torch

    import executor
    import sft
    torch.set_num_threads(args.threads or torch.get_num_threads())
    lm, tokenizer = executor.load_model(args.model, dtype="float32")
    examples, _ = sft.load_sft_data(args.data, tokenizer, max_len=1 << 30)
    examples = examples[:args.n + 1]
    model = sft.wrap_model(lm, "cpu", grad_checkpointing=args.side == "on")
    batches = [sft.collate([e], tokenizer.pad_token_id or 0) for e in examples]
    sft.backward_step(model, batches[:1], chunk_size=256)  # warm-up, not timed
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    sft.backward_step(model, batches[1:], chunk_size=256)
    seconds = time.perf_counter() - t0
    grads = torch.cat([p.grad.flatten()[:4096] for p in model.parameters() if p.grad is not None])
    torch.save(grads, os.path.join(args.tmp, f"grad_{args.side}.pt"))
    tokens = sum(len(e["ids"]) for e in examples[1:])
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux -> GB
    print(json.dumps({"side": args.side, "seconds": seconds, "tokens": tokens, "peak_rss_gb": peak_gb}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--data", required=True, help="trajectory JSONL (distill.py's kept file)")
    p.add_argument("--n", type=int, default=4, help="sequences timed (after one warm-up)")
    p.add_argument("--repeats", type=int, default=1, help="runs per side, alternated; the fastest is reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--side", choices=["on", "off"], help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="/tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        return side(args)
    runs = {"on": [], "off": []}
    for _ in range(args.repeats):
        for name in ("off", "on"):
            cmd = [sys.executable, __file__, "--side", name, "--model", args.model, "--data", args.data,
                   "--n", str(args.n), "--threads", str(args.threads), "--tmp", args.tmp]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(runs[name][-1], flush=True)
    import torch
    diff = (torch.load(os.path.join(args.tmp, "grad_on.pt")) - torch.load(os.path.join(args.tmp, "grad_off.pt")))
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in runs.items()}
    print(f"{best['off']['tokens']} tokens: without checkpointing {best['off']['seconds']:.1f} s "
          f"(peak RSS {best['off']['peak_rss_gb']:.1f} GB), with {best['on']['seconds']:.1f} s "
          f"({best['on']['peak_rss_gb']:.1f} GB): ratio {best['on']['seconds'] / best['off']['seconds']:.2f}; "
          f"max |gradient difference| {float(diff.abs().max()):.3g}")


if __name__ == "__main__":
    main()
