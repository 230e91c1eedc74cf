"""The GPU check's dry run (tests/benchmarks/gpu_check.py --dry-run): every row runs on CPU
with tiny shapes, so the script cannot rot between the rare GPU sessions, and its derived
figures (KV bytes per token, training-state bytes, the bandwidth bound) equal hand counts."""
import contextlib
import importlib.util
import io
import json
import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(HERE, "benchmarks", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

# tiny-b (the trained model of the dry run): vocab 512, hidden 96, 3 layers, 4 heads, 2 KV heads,
# head_dim 24, MLP 192, tied head. Per layer: q 96x96, k and v 96x48, o 96x96, q/k norms 24 each,
# gate/up/down 3 x 96x192, two RMSNorms of 96; plus the embedding 512x96 and the final norm.
LAYER = 96 * 96 + 2 * 96 * 48 + 96 * 96 + 2 * 24 + 3 * 96 * 192 + 2 * 96
TINY_B_PARAMS = 512 * 96 + 3 * LAYER + 96  # 298,800
TINY_B_TENSORS = 1 + 3 * 11 + 1
# tiny-a: vocab 512, hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, MLP 128
TINY_A_PARAMS = 512 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16 + 3 * 64 * 128 + 2 * 64) + 64


def run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        n_errors = gpu_check.main(argv)
    return n_errors, out.getvalue()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_check") / "check.json"
    n_errors, stdout = run(["--dry-run", "--device", "cpu", "--out", str(path)])
    return n_errors, json.loads(path.read_text()), stdout


def test_dry_run_runs_every_row_without_error(dry_run):
    n_errors, report, stdout = dry_run
    assert [r.get("error") for r in report["rows"] if "error" in r] == [] and n_errors == 0
    labels = [r["row"] for r in report["rows"]]
    assert labels == [label for label, *_ in gpu_check.plan(gpu_check.DRY)]
    assert len(labels) == 2 * 3 + 1 + 1 + 4 + 1 + 2 + 4 + 1 + 1
    for label in labels:
        assert any(line.startswith(label) for line in stdout.splitlines()), label
    assert report["dry_run"] is True and report["device"] == "cpu"


def test_decode_rows_against_the_bandwidth_bound(dry_run):
    _, report, _ = dry_run
    bw = report["copy_bandwidth_gb_s"] * 1e9
    P, T = gpu_check.DRY["prompt"], gpu_check.DRY["new"]
    # fp32 on CPU; KV bytes per token = 2 (K, V) x layers x KV heads x head_dim x 4 bytes
    shapes = {"tiny-a": (TINY_A_PARAMS * 4, 2 * 2 * 2 * 16 * 4), "tiny-b": (TINY_B_PARAMS * 4, 2 * 3 * 2 * 24 * 4)}
    rows = [r for r in report["rows"] if r["row"].startswith("decode")]
    for r in rows:
        _, model, b = r["row"].split()
        batch = int(b[1:])
        weights, kv = shapes[model]
        assert r["bound_tok_s"] == pytest.approx(batch * bw / (weights + batch * (P + T / 2) * kv), rel=1e-12)
        assert r["engine_of_bound"] == pytest.approx(r["engine_tok_s"] / r["bound_tok_s"], rel=1e-12)
        assert r["same_tokens"] is True and r["engine_tok_s"] > 0 and r["generate_tok_s"] > 0


def test_rollout_row_runs_three_tool_turns_identical_to_the_baseline(dry_run):
    _, report, _ = dry_run
    (r,) = [r for r in report["rows"] if r["row"].startswith("rollout")]
    # same_ids: every engine row equals the generate + re-prefill history token for token
    assert (r["rows"], r["tool_calls"], r["same_ids"]) == (16, 3, True)


def test_batching_row_compares_waves_and_continuous_on_the_same_samples(dry_run):
    _, report, _ = dry_run
    (r,) = [r for r in report["rows"] if r["row"].startswith("batching")]
    # 32 samples (4 prompts x G 8), 16 rows, a 32-token budget; a sample at the budget wrote 32
    # tokens, any other 2, 4, 6 or 8 and EOS; both sides drew the same samples (same seeds)
    assert (r["samples"], r["rows"], r["budget"], r["same_ids"]) == (32, 16, 32, True)
    short = r["model_tokens"] - 32 * r["at_budget"]
    assert 0 < r["at_budget"] < 32 and 3 * (32 - r["at_budget"]) <= short <= 9 * (32 - r["at_budget"])
    assert 0 < r["waves_occupancy"] < r["continuous_occupancy"] <= 1 and r["speedup"] > 0


def test_training_rows_count_their_loss_tokens(dry_run):
    _, report, _ = dry_run
    grpo_rows = [r for r in report["rows"] if r["row"].startswith("grpo")]
    # 2 sequences of L tokens: a prompt of L / 8, the rest model tokens (L <= 512: no output stretch)
    assert [r["loss_tokens"] for r in grpo_rows] == [2 * (64 - 8), 2 * (128 - 16)] * 2
    sft_rows = [r for r in report["rows"] if r["row"].startswith("sft")]
    assert [r["seq_tokens"] for r in sft_rows] == [128, 256, 128, 256]
    assert all(r["time_s"] > 0 and r["peak_gib"] is None for r in grpo_rows + sft_rows)
    # checkpointing really is off, on, off, on (the SFT rows come after the checkpointed GRPO rows)
    assert [r["checkpointing"] for r in grpo_rows + sft_rows] == [False, False, True, True] * 2


def test_fit_row_from_the_measured_training_state(dry_run):
    _, report, _ = dry_run
    (r,) = [r for r in report["rows"] if r["row"].startswith("fit")]
    kv = 2 * 3 * 2 * 24 * 4
    assert r["kv_bytes_per_token"] == kv
    # fp32 weights + AdamW's two moments + its per-tensor step counters + the rollout copy (fp32 on CPU);
    # no gradients (cleared to None between steps)
    resident = TINY_B_PARAMS * (4 + 8) + TINY_B_TENSORS * 4 + TINY_B_PARAMS * 4
    assert r["resident_gib"] * gpu_check.GiB == pytest.approx(resident, rel=1e-12)
    capacity = r["capacity_gib"] * gpu_check.GiB
    assert r["sequences"] == int((0.9 * capacity - resident) // (kv * 256))
    assert r["max_num_seqs"] == r["sequences"] and r["share_of_step"] == min(1.0, r["sequences"] / (16 * 8))


def test_a_failing_row_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(gpu_check.grpo, "update_policy", out_of_memory)
    path = tmp_path / "check.json"
    n_errors, stdout = run(["--dry-run", "--device", "cpu", "--rows", "grpo,fit", "--out", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["row"] for r in rows] == ["grpo 64 ckpt=0", "grpo 128 ckpt=0", "grpo 64 ckpt=1", "grpo 128 ckpt=1",
                                        "fit tiny-b @256"]
    assert n_errors == 4
    assert all(r["error"] == "OutOfMemoryError: CUDA out of memory (simulated)" for r in rows[:4])
    assert "error" not in rows[4] and rows[4]["kv_bytes_per_token"] == 2 * 3 * 2 * 24 * 4


def test_layout_rows_model_fsdp8_and_ddp8_per_rank_D13(dry_run):
    """tiny-b, fp32 on CPU (4 bytes a parameter): FSDP-8 holds 16 / 8 + 4 = 6 bytes a parameter
    a rank, DDP-8 16 + 4 = 20; rows = floor((0.9 x capacity - state) / (1,152 bytes x context)), at
    most 32; the plan's KV bytes a token equal a real cache's. A row also counts a multi-token
    forward's transient (tests/faults.md G23): 256 tokens x c x 9 bytes (mask) + 256 x 4 x
    (4 x 96 + 3 x 192 + 3 x 8 x 24) (activations) + 4 x 512 (logits)."""
    _, report, _ = dry_run
    rows = {r["row"].split()[-1]: r for r in report["rows"] if r["row"].startswith("layout")}
    assert sorted(rows) == ["DDP-8", "FSDP-8"]
    for name, per_param in (("FSDP-8", 6), ("DDP-8", 20)):
        r = rows[name]
        assert r["params"] == TINY_B_PARAMS and r["kv_bytes_per_token"] == 2 * 3 * 2 * 24 * 4
        assert r["kv_formula_matches"] is True
        assert r["state_gib"] * gpu_check.GiB == pytest.approx(TINY_B_PARAMS * per_param, rel=1e-12)
        for c in (256, 512):
            budget = 0.9 * r["capacity_gib"] - r["state_gib"]
            feed = 256 * c * 9 + 256 * 4 * (4 * 96 + 3 * 192 + 3 * 8 * 24) + 4 * 512
            assert r[f"rows_at_{c}"] == min(32, int(budget // ((1152 * c + feed) / gpu_check.GiB)))


def test_two_ranks_row_runs_grpo_under_torchrun(dry_run):
    _, report, _ = dry_run
    (r,) = [r for r in report["rows"] if r["row"].startswith("ranks2")]
    assert (r["ranks"], r["steps"], r["optimizer_steps"]) == (2, 2, 2)
    assert r["plan"].startswith("memory plan a rank: KV cache 512 bytes a token")


def test_feed_row_counts_the_plans_transient_G23(dry_run):
    """tiny-b (fp32 on CPU) at 512 positions (2 x the dry run's context), a 300-token block (two
    forwards: 44 + 256 tokens): the plan's figure is rows x the hand count at 812 positions;
    no peak on CPU (measured by the CPU test of tests/test_engine.py, G23)."""
    _, report, _ = dry_run
    (r,) = [r for r in report["rows"] if r["row"].startswith("feed")]
    assert (r["width"], r["block"], r["transient_gib"], r["within_plan"]) == (512, 300, None, None)
    feed = 256 * 812 * 9 + 256 * 4 * (4 * 96 + 3 * 192 + 3 * 8 * 24) + 4 * 512
    assert r["plan_gib"] * gpu_check.GiB == pytest.approx(r["rows"] * feed, rel=1e-12) and 1 <= r["rows"] <= 32
    assert r["repeat_kv_gib"] * gpu_check.GiB == pytest.approx(2 * r["rows"] * 4 * 812 * 24 * 4, rel=1e-12)
