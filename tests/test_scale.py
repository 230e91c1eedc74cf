"""The paper-scale path on CPU: collective timeouts, non-finite steps, resumes that cannot
work, the KV-cache memory plan (tests/faults.md D5-D13).

The 2-rank cases run this file as a `torchrun --nproc_per_node 2` worker (gloo, CPU) once
per session, with a timeout so that a hang fails the test instead of the run.
"""
import json
import math
import os
import subprocess
import sys
import time
import types
from datetime import timedelta

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


def _write_problems(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "problem": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)})
                    + "\n")
    return str(path)


def _cli(tiny_dir, data, out, *extra):
    return ["--model", tiny_dir, "--data", data, "--out", out, "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "2", "--micro-batch", "2", "--lr", "1e-2", "--exec-workers", "1", "--no-progress",
            *extra]


def _alternate(samples, problems):
    """Rewards 1, 0, 1, 0, ...: every group of 2 has signal, so every step trains."""
    return [float(i % 2 == 0) for i in range(len(samples))]


# -----------------------------------------------------------------------------
# Two ranks (torchrun, gloo)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("scale")
    data = _write_problems(out / "p.jsonl", 4)
    # a weights-only checkpoint of one rank, for the 2-rank FSDP resume (tests/faults.md D17)
    grpo.main(_cli(tiny_dir, data, str(out / "w1"), "--steps", "1", "--no-save-optimizer"), reward_fn=_alternate)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), "--worker", str(out), tiny_dir, data]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # a hang fails the test, not the CI run
        pytest.fail(f"torchrun timed out: {e.stderr}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = [json.load(open(out / f"rank{k}.json")) for k in range(2)]
    return types.SimpleNamespace(dir=out, res=res, tiny_dir=tiny_dir, data=data)


@pytest.mark.timeout(500)
def test_slow_rank_outlasting_default_timeout_finishes_its_step_D5(two_ranks):
    """Rank 1's reward (its rollout's last work before the step's first collective) waits for
    a file rank 0 writes as it goes on to that collective, then takes 5 s more, against a
    default collective timeout patched to 1 s (NCCL's 10 minutes, scaled down): the step still
    ends on both ranks, because grpo.py sets its own (--dist-timeout, 24 h by default). The
    sleep only makes the old code fail; the new code passes however slow the machine is."""
    r0, r1 = two_ranks.res
    assert r0["d5_error"] is None and r1["d5_error"] is None
    rows = ex.read_jsonl_tolerant(str(two_ranks.dir / "d5" / "metrics.jsonl"))
    assert [m["step"] for m in rows] == [1] and rows[0]["optimizer_steps"] == 1


def test_dist_timeout_flag_default_covers_a_stage_3_step_D5():
    """--dist-timeout: hours, 24 by default, in both training stages' --help."""
    assert grpo.parse_args(["--out", "x"]).dist_timeout == 24.0
    assert sft.parse_args(["--data", grpo.executor.DEMO_PROBLEMS, "--out", "x"]).dist_timeout == 24.0


@pytest.mark.timeout(500)
def test_resume_with_fsdp_toggled_is_refused_before_rollout_D7(two_ranks):
    for r in two_ranks.res:
        assert r["d7_error"] == ["InputError", "--fsdp toggled"], r["d7_error"]
        assert "FSDP over 2 ranks, this run's full" in r["d7_message"]
    assert not os.path.exists(two_ranks.dir / "d7" / "metrics.jsonl")  # no step ran


@pytest.mark.timeout(500)
def test_fsdp_rank_without_its_optimizer_file_is_refused_D9(two_ranks):
    for r in two_ranks.res:
        assert r["d9_error"] == ["InputError", "missing"], r["d9_error"]
        assert r["d9_load"] == ("FileNotFoundError" if r["rank"] == 1 else "ok")
    assert not os.path.exists(two_ranks.dir / "d9" / "metrics.jsonl")


@pytest.mark.timeout(500)
def test_sync_policy_gathers_one_parameter_at_a_time_in_the_rollout_dtype_D6(two_ranks):
    """FSDP on 2 ranks, a bf16 rollout copy: one gather a parameter, each already bf16 (the
    old code gathered the whole fp32 state dict on every rank, then cast it); the copy holds
    exactly the fp32 weights cast to bf16."""
    for r in two_ranks.res:
        assert r["d6_gathers"] == ["torch.bfloat16"] * r["d6_params"] and r["d6_equal"] is True


@pytest.mark.timeout(500)
def test_weights_only_checkpoint_resumes_on_more_fsdp_ranks_D17(two_ranks):
    """A 1-rank --no-save-optimizer checkpoint (step 1) resumed with --fsdp on 2 ranks: every
    rank takes rank 0's trainer state (step, data order; no optimizer) and AdamW starts fresh;
    step 2 runs (before: rank 1 died on its missing trainer_state_rank1.pt)."""
    for r in two_ranks.res:
        assert r["d17_error"] is None, r["d17_error"]
    rows = ex.read_jsonl_tolerant(str(two_ranks.dir / "d17" / "metrics.jsonl"))
    assert [m["step"] for m in rows] == [2] and rows[0]["optimizer_steps"] == 1


@pytest.mark.timeout(300)
def test_an_error_on_rank_1_reaches_the_user_once_D16(tiny_dir, tmp_path):
    """grpo.py on 2 ranks whose reward returns NaN on rank 1's samples only: stderr holds rank
    1's one line naming the reward's problem, prefixed with its rank, once (before: rank 1 exited
    without a word; the user saw rank 0's "Connection closed by peer" and torchrun's block)."""
    data = _write_problems(tmp_path / "p.jsonl", 4)
    reward = tmp_path / "reward.py"
    reward.write_text("import os\n\n\ndef nan_on_rank1(samples, problems):\n"
                      "    return [float('nan') if os.environ['RANK'] == '1' else 1.0 for _ in samples]\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, HERE]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "grpo.py"), *_cli(tiny_dir, data, str(tmp_path / "o"), "--steps", "1", "--reward",
                                               f"{reward}:nan_on_rank1")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if "error: reward nan" in x]
    assert len(lines) == 1 and lines[0].startswith("[rank 1] grpo.py: error: reward nan for a sample of problem 'p"), \
        r.stderr[-3000:]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("ckpt, extra", [("fsdp", ["--fsdp"]), ("zero", ["--shard-optimizer"]),
                                         ("zero", [])])
def test_resume_on_another_world_size_is_refused_D8(two_ranks, tmp_path, ckpt, extra):
    """A 2-rank FSDP or ZeRO checkpoint resumed on 1 rank: one line, nothing written."""
    out = str(tmp_path / "o")
    argv = _cli(two_ranks.tiny_dir, two_ranks.data, out, "--steps", "2", "--resume",
                str(two_ranks.dir / ckpt / "latest"), *extra)
    with pytest.raises(ex.InputError, match="over 2 ranks, this run's full"):
        grpo.main(argv, reward_fn=_alternate)
    assert not os.path.exists(out)


def _worker(out, tiny_dir, data):
    import torch.distributed.distributed_c10d as c10d
    torch_default, c10d.default_pg_timeout = c10d.default_pg_timeout, timedelta(seconds=1)  # NCCL's 10 min, scaled
    rank = int(os.environ["RANK"])
    res = {"rank": rank}
    sft.cleanup_distributed = lambda: None  # several command-line runs share this process group
    waiting = os.path.join(out, "rank0_waiting")

    def slow_rank1(samples, problems):
        if rank == 0:
            open(waiting, "w").close()  # rank 0 goes on to update_policy's first all-reduce
        else:
            for _ in range(6000):  # (bounded: the fixture's timeout fails a hang)
                if os.path.exists(waiting):
                    break
                time.sleep(0.05)
            time.sleep(5.0)  # 5 x the default timeout; rank 0 is waiting in a collective
        return _alternate(samples, problems)

    # D5: the first run initialises the process group
    try:
        grpo.main(_cli(tiny_dir, data, os.path.join(out, "d5"), "--steps", "1"), reward_fn=slow_rank1)
        res["d5_error"] = None
    except Exception as e:  # (the old code: a gloo timeout on rank 0, then a closed connection)
        res["d5_error"] = f"{type(e).__name__}: {e}"[:500]
        raise
    c10d.default_pg_timeout = torch_default  # (for any group made later: a loaded machine is slow)

    # checkpoints of the two sharded layouts: FSDP and ZeRO, 1 step each
    grpo.main(_cli(tiny_dir, data, os.path.join(out, "fsdp"), "--steps", "1", "--fsdp"), reward_fn=_alternate)
    grpo.main(_cli(tiny_dir, data, os.path.join(out, "zero"), "--steps", "1", "--shard-optimizer"),
              reward_fn=_alternate)

    def refused(name, *extra):
        try:
            grpo.main(_cli(tiny_dir, data, os.path.join(out, name), "--steps", "2", *extra), reward_fn=_alternate)
            return ["none", ""], ""
        except Exception as e:
            return [type(e).__name__, ""], str(e)

    # D17: the 1-rank weights-only checkpoint resumed on 2 FSDP ranks: AdamW starts fresh
    (kind, _), msg = refused("d17", "--resume", os.path.join(out, "w1", "latest"), "--fsdp")
    res["d17_error"] = f"{kind}: {msg[:300]}" if kind != "none" else None
    # D7: the FSDP checkpoint resumed under DDP on as many ranks
    (kind, _), msg = refused("d7", "--resume", os.path.join(out, "fsdp", "latest"))
    res["d7_error"], res["d7_message"] = [kind, "--fsdp toggled" if "FSDP" in msg else msg[:300]], msg
    # D9: rank 1's trainer state (its optimizer shard) gone
    torch.distributed.barrier()
    if rank == 0:
        os.remove(os.path.join(out, "fsdp", "latest", "trainer_state_rank1.pt"))
    torch.distributed.barrier()
    (kind, _), msg = refused("d9", "--resume", os.path.join(out, "fsdp", "latest"), "--fsdp")
    res["d9_error"] = [kind, "missing" if "missing" in msg else msg[:300]]
    # and load_trainer_state itself: under FSDP, rank 1 does not take rank 0's optimizer
    lm, _ = ex.load_model(tiny_dir, dtype="float32", device="cpu")
    model = sft.wrap_model(lm, torch.device("cpu"), fsdp=True)
    opt = sft.make_optimizer(model.parameters(), 1e-3)
    try:
        sft.load_trainer_state(os.path.join(out, "fsdp", "latest"), opt)
        res["d9_load"] = "ok"
    except FileNotFoundError:
        res["d9_load"] = "FileNotFoundError"
    # D6: sync_policy under FSDP gathers one parameter at a time, already in the rollout dtype
    from torch.distributed.tensor import DTensor
    tok = tiny.make_tokenizer()
    lm = tiny.make_model(tok)
    want = {n: p.detach().to(torch.bfloat16) for n, p in lm.named_parameters()}
    model = sft.wrap_model(lm, torch.device("cpu"), fsdp=True)
    policy = tiny.make_model(tok, seed=1).to(torch.bfloat16)
    gathered, full_tensor = [], DTensor.full_tensor

    def spy(self, *a, **k):
        gathered.append(str(self.dtype))
        return full_tensor(self, *a, **k)

    DTensor.full_tensor = spy
    grpo.sync_policy(model, policy)
    DTensor.full_tensor = full_tensor
    res["d6_gathers"] = gathered
    res["d6_params"] = len(want)
    res["d6_equal"] = all(torch.equal(p, want[n]) for n, p in policy.named_parameters())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


# -----------------------------------------------------------------------------
# Non-finite steps (one process)


def test_nonfinite_gradient_skips_the_step_D10(tokenizer):
    """An inf in one gradient: the norm is inf, AdamW neither moves a weight nor keeps state."""
    lm = tiny.make_model(tokenizer)
    opt = sft.make_optimizer(lm.parameters(), 1e-2)
    before = [p.detach().clone() for p in lm.parameters()]
    for p in lm.parameters():
        p.grad = torch.ones_like(p)
    next(lm.parameters()).grad[0, 0] = float("inf")
    assert sft.optimizer_step(lm, opt, 1.0) == float("inf")
    assert all(torch.equal(a, p) for a, p in zip(before, lm.parameters())) and not opt.state
    assert all(p.grad is None for p in lm.parameters())
    for p in lm.parameters():  # a finite gradient afterwards steps as usual
        p.grad = torch.ones_like(p)
    assert sft.optimizer_step(lm, opt, 0.0) == pytest.approx(sum(p.numel() for p in lm.parameters()) ** 0.5)
    assert not torch.equal(before[0], next(lm.parameters()))


def test_run_of_nonfinite_steps_stops_and_keeps_the_last_good_checkpoint_D10(tiny_dir, tmp_path, monkeypatch,
                                                                               capsys):
    """Step 1 trains; from step 2 every advantage is inf (a NaN / inf loss and gradient): steps 2
    and 3 are skipped and logged (grad_norm None, skipped_in_a_row 1, 2), the run stops after
    --max-skipped-steps 2 with one line, and latest/ holds finite weights."""
    data = _write_problems(tmp_path / "p.jsonl", 4)
    out = str(tmp_path / "o")
    real, calls = grpo.compute_advantages, []

    def advantages(samples, rewards, G):
        calls.append(1)
        adv = real(samples, rewards, G)
        return adv if len(calls) == 1 else torch.full_like(adv, float("inf"))

    monkeypatch.setattr(grpo, "compute_advantages", advantages)
    with pytest.raises(SystemExit) as e:
        grpo.main(_cli(tiny_dir, data, out, "--steps", "5", "--max-skipped-steps", "2"), reward_fn=_alternate)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: 2 steps in a row had a non-finite gradient norm")
    rows = ex.read_jsonl_tolerant(os.path.join(out, "metrics.jsonl"))
    assert [(m["step"], m["skipped_in_a_row"]) for m in rows] == [(1, 0), (2, 1), (3, 2)]
    assert rows[0]["grad_norm"] > 0 and rows[1]["grad_norm"] is None and rows[2]["grad_norm"] is None
    w = load_file(os.path.join(out, "latest", "model.safetensors"))
    assert all(bool(v.isfinite().all()) for v in w.values())
    assert torch.load(os.path.join(out, "latest", "trainer_state_rank0.pt"), weights_only=False)["step"] == 2


def test_skips_are_logged_and_counted_per_update_L34(tiny_dir, tmp_path, monkeypatch):
    """--updates-per-step 2, the second mini-batch's advantages inf at every step: its update is
    skipped, the first applied. metrics.jsonl logs grad_norms [x, null], grad_norm x, and 1
    update skipped in a row after each step (the applied one breaks the run), so
    --max-skipped-steps 2 does not stop the run (before: every step logged as skipped, grad_norm
    null, and the run stopped after step 2 although half its updates were applied)."""
    data = _write_problems(tmp_path / "p.jsonl", 4)
    out = str(tmp_path / "o")
    real = grpo.compute_advantages

    def second_half_inf(samples, rewards, G):
        adv = real(samples, rewards, G)
        adv[len(adv) // 2:] = float("inf")  # update_policy's second mini-batch
        return adv

    monkeypatch.setattr(grpo, "compute_advantages", second_half_inf)
    grpo.main(_cli(tiny_dir, data, out, "--steps", "3", "--updates-per-step", "2", "--max-skipped-steps", "2"),
              reward_fn=_alternate)
    rows = ex.read_jsonl_tolerant(os.path.join(out, "metrics.jsonl"))
    assert [(m["step"], m["skipped_in_a_row"], m["optimizer_steps"]) for m in rows] == [(1, 1, 2), (2, 1, 2), (3, 1, 2)]
    for m in rows:
        assert m["grad_norms"][1] is None and m["grad_norms"][0] > 0 and m["grad_norm"] == m["grad_norms"][0]


def test_nonfinite_logit_in_the_update_skips_it_instead_of_raising_L34(tokenizer):
    """A NaN logit at a loss token in the trainer's forward: update_policy does not raise (on
    one rank, while the others wait in a collective); the update's gradient norm is NaN, the
    same on every rank, and it is skipped: weights and AdamW state unchanged."""
    from test_grpo import fake_sample
    lm = tiny.make_model(tokenizer).train()
    head = lm.get_output_embeddings()

    def nan_logit(module, inputs, out):
        out = out.clone()
        out[0, -1, 5] = float("nan")
        return out

    head.register_forward_hook(nan_logit)
    opt = sft.make_optimizer(lm.parameters(), 1e-2)
    before = [p.detach().clone() for p in lm.parameters()]
    samples = [fake_sample(3, 6, i, len(tokenizer)) for i in range(2)]
    out = grpo.update_policy(lm, opt, samples, torch.tensor([1.0, -1.0]), grpo.Dist(), micro_batch=2)
    assert len(out["grad_norms"]) == 1 and math.isnan(out["grad_norms"][0])
    assert all(torch.equal(a, p) for a, p in zip(before, lm.parameters())) and not opt.state


def test_checkpoint_is_never_written_from_nonfinite_weights_D11(tokenizer, tmp_path):
    """A NaN weight: save_checkpoint raises before writing; the checkpoint there stays."""
    lm = tiny.make_model(tokenizer)
    path = str(tmp_path / "latest")
    sft.save_checkpoint(path, lm, tokenizer, {"stage": "grpo"}, {"step": 1})
    good = load_file(os.path.join(path, "model.safetensors"))
    with torch.no_grad():
        next(lm.parameters())[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="1 weight tensors are not finite"):
        sft.save_checkpoint(path, lm, tokenizer, {"stage": "grpo"}, {"step": 2})
    kept = load_file(os.path.join(path, "model.safetensors"))
    assert kept.keys() == good.keys() and all(torch.equal(kept[k], good[k]) for k in good)
    assert not os.path.exists(path + ".tmp")


def test_sft_stops_after_nonfinite_steps_in_a_row_D10(tiny_dir, tmp_path, monkeypatch, capsys):
    """sft.py: every gradient norm inf (clip_grad_norm_ reporting inf), --max-skipped-steps 2:
    log.jsonl has steps 1 and 2 with grad_norm null and skipped_in_a_row 1, 2; exit status 1."""
    from test_sft import fake_trajectories, write_jsonl
    data = write_jsonl(tmp_path / "t.jsonl", fake_trajectories(4))
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(float("inf")))
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit) as e:
        sft.main(["--model", tiny_dir, "--data", data, "--out", out, "--global-batch", "2", "--max-steps", "4",
                  "--warmup", "0", "--no-progress", "--max-skipped-steps", "2"])
    assert e.value.code == 1 and "2 steps in a row had a non-finite gradient norm" in capsys.readouterr().err
    rows = ex.read_jsonl_tolerant(os.path.join(out, "log.jsonl"))
    assert [(r["step"], r["grad_norm"], r["skipped_in_a_row"]) for r in rows] == [(1, None, 1), (2, None, 2)]


# -----------------------------------------------------------------------------
# The memory plan (one process)


def test_kv_bytes_per_token_by_hand_D12(tokenizer):
    """2 (K, V) x layers x KV heads x head_dim x bytes: the tiny Qwen3 (2 layers, 2 KV heads,
    head_dim 16) in fp32 is 2 x 2 x 2 x 16 x 4 = 512; Qwen3-4B's shape in bf16 is
    2 x 36 x 8 x 128 x 2 = 147,456 (the README's figure)."""
    from transformers import Qwen3Config
    assert sft.kv_bytes_per_token(tiny.make_model(tokenizer).config, 4) == 512
    q4b = Qwen3Config(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      hidden_size=2560)
    assert sft.kv_bytes_per_token(q4b, 2) == 147_456


def test_memory_plan_caps_rows_to_the_budget_D12(tokenizer):
    """A row of 1,024 tokens at 512 bytes reaches 2^19 bytes of KV cache, and a multi-token
    forward over it (256 tokens fed, fp32) 256 x 1,024 x 9 (the bool mask, its float copy and
    an aligned one) + 256 x 4 x (4 x 64 + 3 x 128 + 3 x (4 + 2 x 2) x 16) (activations) + 4 x V
    (logits) bytes more: a budget of 5.5 rows admits 5 (of --max-num-seqs 32, or of 0 = all); 0
    on CPU admits --max-num-seqs; a budget under one row is refused. State per rank: 2^30
    parameters x 16 bytes over 8 FSDP ranks = 2 GiB, + 2 for a bf16 rollout copy; ZeRO on 8
    ranks: 8 + 1 = 9 GiB."""
    cfg, cpu = tiny.make_model(tokenizer).config, torch.device("cpu")
    feed = 256 * 1024 * 9 + 256 * 4 * (4 * 64 + 3 * 128 + 3 * 8 * 16) + 4 * len(tokenizer)
    assert sft.feed_transient_bytes(cfg, 4, 1024, 256) == feed
    row = (2 ** 19 + feed) / 2 ** 30  # GiB
    rows, line = sft.memory_plan(cfg, 4, 32, 1024, 5.5 * row, 4.0, cpu)
    assert rows == 5 and line == ("memory plan a rank: KV cache 512 bytes a token x 5 rows x 1,024 tokens = 0.0 GiB "
                                  "+ forward transient 0.02 GiB at most (budget 0.0 GiB); model + optimizer state "
                                  "4.0 GiB")
    assert sft.memory_plan(cfg, 4, 0, 1024, 5.5 * row, 0.0, cpu)[0] == 5
    assert sft.memory_plan(cfg, 4, 3, 1024, 5.5 * row, 0.0, cpu)[0] == 3
    assert sft.memory_plan(cfg, 4, 32, 1024, 0.0, 0.0, cpu)[0] == 32
    with pytest.raises(ex.InputError, match="one row of 1024 tokens needs 0.00 GiB"):
        sft.memory_plan(cfg, 4, 32, 1024, 0.5 * row, 0.0, cpu)
    assert sft.state_gib(2 ** 30, 8, fsdp=True, rollout_bytes=2) == 4.0
    assert sft.state_gib(2 ** 30, 8, shard=True) == 9.0 and sft.state_gib(2 ** 30) == 16.0


def test_paper_scale_plan_in_the_readme_D13():
    """The README's rows: Qwen3-4B (4.02e9 parameters; 147,456 bytes a token), FSDP-8 with a bf16
    rollout copy, the default budget (90% of the GPU less the state): H200 (139.8 GiB) and
    H100 80 GB (79.6 GiB) at 16K and 32K. A multi-token forward's transient (tests/faults.md G23)
    counted, a row reaches 2.30 GiB at 16K: the H100 admits 24 rows there, not 25."""
    from transformers import Qwen3Config
    q4b = Qwen3Config(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      hidden_size=2560, intermediate_size=9728, vocab_size=151936)
    state = sft.state_gib(4.02e9, 8, fsdp=True, rollout_bytes=2)
    assert round(state, 1) == 15.0
    rows = {(gpu, ctx): sft.memory_plan(q4b, 2, 32, ctx, 0.9 * total - state, state, torch.device("cpu"))[0]
            for gpu, total in (("H200", 139.8), ("H100", 79.6)) for ctx in (16384, 32768)}
    assert rows == {("H200", 16384): 32, ("H200", 32768): 24, ("H100", 16384): 24, ("H100", 32768): 12}
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "| H200 (139.8 GiB) | 16K | 2.25 | 110.8 | 32 (of 32) | 72.0 |" in readme


def test_stage_admits_rows_by_kv_budget_D12(tiny_dir, tmp_path, capsys):
    """grpo.py --kv-cache-gb: the tiny model (fp32, 512 bytes a token) at --max-context 2048
    reaches 2^20 bytes of KV cache a row and a multi-token forward's transient more; a budget
    of 3.5 rows admits 3 of --max-num-seqs 32, printed in one line and recorded in args.json."""
    data = _write_problems(tmp_path / "p.jsonl", 2)
    out = str(tmp_path / "o")
    cfg = ex.load_model(tiny_dir)[0].config
    row = (2 ** 20 + sft.feed_transient_bytes(cfg, 4, 2048, ex.FEED_CHUNK)) / 2 ** 30
    grpo.main(_cli(tiny_dir, data, out, "--steps", "1", "--max-context", "2048", "--kv-cache-gb", str(3.5 * row)),
              reward_fn=_alternate)
    assert "KV cache 512 bytes a token x 3 rows x 2,048 tokens" in capsys.readouterr().out
    assert json.load(open(os.path.join(out, "args.json")))["max_num_seqs"] == 3


# -----------------------------------------------------------------------------
# Versions and stages (one process)


@pytest.mark.parametrize("version, flags, device, refused", [
    ("2.5.1", ["--fsdp"], "cpu", "--fsdp needs torch >= 2.6"),
    ("2.12.0+cu126", ["--fsdp", "--grad-checkpointing"], "cuda", "in bf16 needs torch >= 2.13"),
    ("2.12.0", ["--fsdp", "--grad-checkpointing", "--fp32"], "cuda", None),
    ("2.12.0", ["--fsdp", "--grad-checkpointing"], "cpu", None),  # (fp32 on CPU)
    ("2.13.0", ["--fsdp", "--grad-checkpointing"], "cuda", None),
    ("2.5.1", [], "cuda", None)])
def test_torch_versions_refused_where_they_fail_D14(version, flags, device, refused):
    args = grpo.parse_args(["--out", "x", *flags])
    if refused:
        with pytest.raises(ex.InputError, match=refused):
            sft.check_torch(args, torch.device(device), version)
    else:
        sft.check_torch(args, torch.device(device), version)


def test_requirements_torch_floor_is_what_fsdp_needs_D14():
    line = next(x for x in open(os.path.join(ROOT, "requirements.txt")) if x.startswith("torch"))
    assert line.split()[0] == "torch>=2.6"


def test_drop_solved_naming_the_live_pass_rates_is_refused_L16(tiny_dir, tmp_path):
    """A resume of stage 2 with --drop-solved out/pass_rates.jsonl (the file the run appends to
    every step): one line, nothing run; a frozen copy of it is accepted."""
    data = _write_problems(tmp_path / "p.jsonl", 4)
    out = str(tmp_path / "o")
    grpo.main(_cli(tiny_dir, data, out, "--steps", "1"), reward_fn=_alternate)
    live = os.path.join(out, "pass_rates.jsonl")
    before = open(live).read()
    with pytest.raises(ex.InputError, match="this run's live pass rates"):
        grpo.main(_cli(tiny_dir, data, out, "--steps", "2", "--resume", os.path.join(out, "latest"),
                       "--drop-solved", live), reward_fn=_alternate)
    assert open(live).read() == before
    frozen = str(tmp_path / "stage1_pass_rates.jsonl")
    with open(frozen, "w") as f:
        f.write(before)
    grpo.main(_cli(tiny_dir, data, out, "--steps", "2", "--resume", os.path.join(out, "latest"),
                   "--drop-solved", frozen), reward_fn=_alternate)
    assert [m["step"] for m in ex.read_jsonl_tolerant(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def test_docstring_and_readme_state_one_drop_solved_rule_L16():
    assert "--drop-solved of stage 1's pass_rates.jsonl" in grpo.__doc__.replace("\n", " ")
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert readme.count("--drop-solved runs/rl_stage1_pass_rates.jsonl") == 2
    assert "stages 2 and 3 both drop the prompts solved G/G in stage 1's pass rates" in readme.replace("\n", " ")


if __name__ == "__main__" and "--worker" in sys.argv:
    torch.set_num_threads(1)
    i = sys.argv.index("--worker")
    _worker(*sys.argv[i + 1:i + 4])
    # the runs above share one process group (cleanup_distributed is off): a rank that exits without
    # destroying it aborts now and then ('terminate called without an active exception', tests/faults.md T3)
    torch.distributed.destroy_process_group()
