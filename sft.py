"""Supervised fine-tuning on THINC trajectories: a plain-PyTorch masked SFT loop.

Every token of the assistant turn is supervised: the plan, the ```python blocks, the
```output blocks the interpreter wrote (m_k = 1, as in the paper's SFT stage) and the
end-of-turn token; the prompt never is. The objective of one optimizer step over the
trajectories i of its global batch is the token mean

    L(theta) = - 1 / (sum_i sum_k m_ik) * sum_i sum_k m_ik * log pi_theta(y_ik | q_i, y_i,<k)

with the normaliser counted over the whole step (every micro-batch and every rank), so the
gradient does not depend on how the batch is split. Paper defaults: AdamW, lr 7e-6 with a
cosine schedule, global batch 16, 3 epochs, 32K context.

Reads: a model directory or .gguf (`--model`), trajectory JSONL (`--data`; fields "problem"
and "completion", optional "blocks" [{"output": ...}]). Writes under `--out`: step_NNNNNN/
and final/ (Hugging Face directories: safetensors, config, tokenizer, args.json and
trainer_state_rank{r}.pt for `--resume`), log.jsonl (one line per step), args.json.

    python sft.py --model Qwen3-4B --data traj.jsonl --out runs/sft
    torchrun --standalone --nproc_per_node=8 sft.py --model Qwen3-4B --data traj.jsonl --out runs/sft --fsdp

Departures from the paper (which does not describe these details):
  1. Output blocks are tokenised alone, exactly as the engine inserts them, so SFT ids equal
     the ids a rollout of the same trajectory produces (not a re-tokenisation of the text).
  2. Trajectories longer than --max-len are dropped and counted, never truncated; each
     epoch drops its last partial global batch.
  3. Warmup share (--warmup, 3%), AdamW betas (0.9, 0.999), no weight decay, clip 1.0.
"""
import contextlib, datetime, glob, hashlib, math, os, pathlib, random, shutil, sys, time, zipfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

import executor
from executor import (ROLE_MODEL, ROLE_OUTPUT, ROLE_PAD, ROLE_PROMPT, fraction, input_file, model_path,
                      nonneg_float, nonneg_int, positive_int)

# -----------------------------------------------------------------------------
# Distributed setup


def setup_distributed(seed: int, backend: str | None = None, timeout=None):
    """Read RANK / LOCAL_RANK / WORLD_SIZE (torchrun) or fall back to one process.

    Initialises the process group when WORLD_SIZE > 1 (`backend`, default nccl on CUDA and
    gloo on CPU; `timeout` a datetime.timedelta for its collectives, default torch's), picks
    the device (cuda:LOCAL_RANK, else CPU) and seeds python, numpy and torch with seed + rank.
    Returns (rank, local_rank, world_size, device). Raises InputError for a RANK or
    WORLD_SIZE without MASTER_ADDR (left from another shell, not torchrun: tests/faults.md B38).
    """
    from transformers import set_seed
    if stale := [k for k in ("RANK", "WORLD_SIZE") if k in os.environ and "MASTER_ADDR" not in os.environ]:
        raise executor.InputError(f"{stale[0]}={os.environ[stale[0]]} is set but MASTER_ADDR is not (left from "
                                  f"another run?): unset {stale[0]}, or start the run with torchrun")
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"), timeout=timeout)
    set_seed(seed + rank)  # python, numpy, torch (CPU and CUDA)
    return rank, local_rank, world_size, device


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def print0(*a, **kw):
    """print on rank 0 only."""
    if _rank() == 0:
        print(*a, **kw, flush=True)


def cleanup_distributed():
    """Destroy the process group if one was created; release the run's --out (the run ends)."""
    executor.unlock_runs()
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier():
    """Wait for every rank (nothing to wait for on one process)."""
    if dist.is_initialized():
        dist.barrier()


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """KV cache bytes of one token: 2 (K, V) x layers x KV heads x head_dim x dtype bytes.
    Qwen3-4B in bf16: 2 x 36 x 8 x 128 x 2 = 147,456 (tests/faults.md D12)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes


def state_gib(n_params: int, world: int = 1, fsdp: bool = False, shard: bool = False,
              rollout_bytes: int = 0) -> float:
    """GiB a rank holds for `n_params` parameters: training (fp32 weights and gradients, 8
    bytes a parameter, sharded by FSDP; AdamW's two moments, 8, sharded by FSDP or ZeRO), and
    a rollout copy of `rollout_bytes` a parameter (whole on every rank; 0 = none)."""
    return n_params * (8 / (world if fsdp else 1) + 8 / (world if fsdp or shard else 1) + rollout_bytes) / 2 ** 30


def weights_gib(model) -> float:
    """GiB of `model`'s weights in their own dtype: the `state` of `memory_plan` for a stage
    that only samples (distill, evaluate)."""
    return model.num_parameters() * model.dtype.itemsize / 2 ** 30


def feed_transient_bytes(config, dtype_bytes: int, width: int, chunk: int) -> int:
    """Bytes one row adds to the peak of a multi-token engine forward (a prompt, an output
    block) of `chunk` tokens over a KV cache `width` positions wide, one layer at a time:
    transformers' bool mask, SDPA's float conversion of it and an aligned copy (CUDA's
    memory-efficient kernel pads the bias), chunk x width x (1 + 2 x dtype_bytes); the
    activations, chunk x dtype_bytes x (4 x hidden + 3 x MLP width + 3 x (H + 2 H_kv) x
    head_dim); the last position's fp32 logits. No copy of the KV heads (transformers'
    repeat_kv, 4x a layer's cache for Qwen3-4B): `executor._grouped_sdpa` (tests/faults.md G23)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 4 * config.hidden_size + 3 * config.intermediate_size + 3 * (heads + 2 * kv_heads) * head_dim
    return chunk * width * (1 + 2 * dtype_bytes) + chunk * dtype_bytes * per_token + 4 * config.vocab_size


def memory_plan(config, dtype_bytes: int, max_num_seqs: int, max_context: int, kv_cache_gb: float, state: float,
                device) -> tuple:
    """The rows a rank decodes at once (the engine's --max-num-seqs) so that what they can
    reach fits the budget: the KV cache, rows x max_context tokens x `kv_bytes_per_token`, and
    the transient of a multi-token forward over it (`feed_transient_bytes` at max_context
    wide, `executor.FEED_CHUNK` tokens). The budget: `kv_cache_gb` GiB, or with 0 on CUDA 90%
    of the GPU's memory less `state` GiB (the model and optimizer state a rank holds; vLLM's
    gpu_memory_utilization), on CPU no limit.
    Returns (rows, 0 = all; the plan in one line). Raises InputError when no row fits."""
    bpt = kv_bytes_per_token(config, dtype_bytes)
    kv = bpt * max_context / 2 ** 30  # GiB of KV cache a row can reach
    feed = feed_transient_bytes(config, dtype_bytes, max_context, executor.FEED_CHUNK) / 2 ** 30  # GiB a row
    row = kv + feed
    total = torch.cuda.mem_get_info(device)[1] / 2 ** 30 if device.type == "cuda" else 0.0  # GiB
    budget = kv_cache_gb or 0.9 * total - state  # GiB; <= 0 when the state fills the GPU: no row fits
    rows = max_num_seqs
    if kv_cache_gb or total:
        if budget < row:
            raise executor.InputError(f"--kv-cache-gb: one row of {max_context} tokens needs {row:.2f} GiB of KV "
                                      f"cache and forward transient, over the budget of {budget:.2f} GiB: lower "
                                      f"--max-context")
        rows = min(max_num_seqs or 1 << 30, int(budget // row))
    cache = f"{rows * kv:.1f} GiB + forward transient {rows * feed:.2f} GiB" if rows else "no cap"
    return rows, (f"memory plan a rank: KV cache {bpt:,} bytes a token x {rows or 'all'} rows x {max_context:,} tokens"
                  f" = {cache} at most (budget {f'{budget:.1f} GiB' if kv_cache_gb or total else 'none'}); "
                  f"model + optimizer state {state:.1f} GiB")


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce a tensor over ranks (`op`: sum by default); returns a new tensor, a copy on
    one process. The one all-reduce helper of every stage."""
    x = x.clone()
    if dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


class LogprobModel(nn.Module):
    """The unit that DDP / FSDP wrap: forward = the causal LM's body once, then the chunked
    head (`token_logprobs` documents the arguments). Everything that touches parameters
    runs inside this forward, so DDP's reducer and FSDP's unshard hooks see it. `.lm` is the
    Hugging Face model."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids, chunk_size, temperature, entropy, start, check_finite):
        assert not getattr(getattr(self.lm, "config", None), "final_logit_softcapping", None), \
            "token_logprobs: final logit soft-capping is not supported"
        body = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else self.lm.model
        head = self.lm.get_output_embeddings() if hasattr(self.lm, "get_output_embeddings") else self.lm.lm_head
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state  # (B, T, H)
        B, T = input_ids.shape
        first = min(max(start, 1), T - 1) if T > 1 else 1  # position 0 predicts nothing
        zero = torch.zeros(B, first, device=hidden.device)
        chunks = [(zero, zero)]  # (logprobs, entropies) of columns [0, first), then of each chunk
        for s in range(first - 1, T - 1, chunk_size):  # hidden[:, s] predicts token s + 1: column `first` starts it
            e = min(s + chunk_size, T - 1)
            h, tgt = hidden[:, s:e], input_ids[:, s + 1:e + 1]  # (B, C, H), (B, C): h at t predicts t + 1
            # recompute the chunk's (B, C, V) logits in backward instead of keeping them
            chunks.append(torch.utils.checkpoint.checkpoint(_head_logprobs, head, h, tgt, temperature, entropy,
                                                            check_finite, use_reentrant=False))
        logps, ents = zip(*chunks)
        return torch.cat(logps, dim=1), torch.cat(ents, dim=1)  # (B, T), (B, T)


def _is_ddp(model) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a DDP / FSDP / LogprobModel wrapper (for rollouts and
    saving). Under FSDP its parameters are sharded DTensors."""
    model = model.module if _is_ddp(model) else model
    return model.lm if isinstance(model, LogprobModel) else model


def disable_dropout(model: nn.Module) -> nn.Module:
    """Dropout off everywhere, the model staying in train mode otherwise (as TRL does):
    the trainer's logprobs must be the sampler's (eval) logprobs, so that GRPO's ratio is
    exactly 1 before an update (tests/faults.md L9). Covers nn.Dropout modules and the
    `attention_dropout` attribute Hugging Face attention reads in train mode."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def wrap_model(model: nn.Module, device, fsdp: bool = False, grad_checkpointing: bool = False) -> nn.Module:
    """Prepare a Hugging Face causal LM for training on this rank.

    Moves it to `device`, turns dropout off (`disable_dropout`), enables (non-reentrant)
    gradient checkpointing if asked, and with more than one rank wraps it: DDP, or with
    `fsdp` PyTorch's `fully_shard` on every decoder layer and on the root (bf16 compute, fp32
    reduce on CUDA). With one rank it returns the model itself. Call `token_logprobs` on the
    result; `unwrap_model` gets the HF model back.
    """
    device = torch.device(device)
    model = disable_dropout(model.to(device)).train()
    if grad_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    if not fsdp:
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets instead of a
        # second copy (one model's worth of memory; the 2-rank CPU demo needs it)
        return nn.parallel.DistributedDataParallel(
            LogprobModel(model), device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    layers = [m for m in model.modules() if type(m).__name__ in set(model._no_split_modules or [])]
    assert layers, f"--fsdp: no decoder layers found in {type(model).__name__} (_no_split_modules)"
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(LogprobModel(model), mesh=mesh, mp_policy=mp)  # root: embeddings, final norm, lm_head


def grad_sync(model: nn.Module, sync: bool):
    """Context for one micro-step's forward and backward. Under DDP with sync=False,
    gradients are only accumulated locally: all-reducing on every micro-step would send the
    same bytes `accum` times for nothing, so we sync once, on the last micro-step. FSDP
    reduce-scatters every micro-step (skipping it would keep full unsharded gradients in
    memory, which is what FSDP is used to avoid). Without a wrapper it does nothing."""
    return model.no_sync() if _is_ddp(model) and not sync else contextlib.nullcontext()

# -----------------------------------------------------------------------------
# Logprobs and loss


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, T) long position ids: cumsum(mask) - 1, so the first real token
    of every row is at position 0 whatever the padding (left or right); pads get 0. The
    sampler uses the same rule (tests/faults.md G2)."""
    return (torch.cumsum(attention_mask.long(), dim=-1) - 1).clamp(min=0)


def _head_logprobs(head, hidden, targets, temperature, entropy, check_finite=True):
    """(B, C, H), (B, C) -> (B, C), (B, C): logprob of each target and the entropy (or 0), fp32.
    check_finite: raise on a non-finite row of logits (`executor.check_finite_logits`)."""
    logits = head(hidden).float()  # (B, C, V)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (B, C)
    if check_finite:
        executor.check_finite_logits(lse.detach(), "token_logprobs")
    logp = logits.gather(-1, targets[..., None]).squeeze(-1) - lse  # (B, C)
    if not entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.exp(logits - lse[..., None])  # (B, C, V)
    # a masked (-inf) token adds 0; its logit is replaced before the product, whose backward
    # would otherwise keep 0 * -inf = NaN (tests/faults.md G22)
    plogits = probs * torch.where(probs > 0, logits, 0.0)  # (B, C, V)
    return logp, lse - plogits.sum(-1)  # (B, C) each


def token_logprobs(model, input_ids, attention_mask, position_ids=None, chunk_size: int = 1024,
                   temperature: float = 1.0, return_entropy: bool = False, start: int = 0, check_finite: bool = True):
    """Logprob of every token given the tokens before it, without materialising (B, T, V).

    Runs the model's body once (hidden states), then the output projection and log-softmax
    in chunks of `chunk_size` positions, each chunk recomputed in backward (only (B, T)
    floats are kept per chunk).

    Args:
        model: a Hugging Face causal LM, or what `wrap_model` returned (DDP / FSDP).
        input_ids: (B, T) long. attention_mask: (B, T) 0/1 (padding on either side).
        position_ids: (B, T) long; default `position_ids_from_mask(attention_mask)`.
        temperature: logits are divided by it (> 0); <= 0 means raw logits, like the sampler.
        start: first column to compute (clamped to [1, T - 1]); columns before it are 0. The
            body still reads every token, but the (B, C, V) head, its log-softmax and their
            recomputation in backward skip the prompt (`first_loss_column`).
        check_finite: a ValueError naming the row for a NaN, +inf or all -inf row of logits
            (tests/faults.md G11); False lets it through as NaN (GRPO's update skips it on
            every rank together, L34).
    Returns:
        logprobs (B, T) fp32 aligned with input_ids (the same layout as Sample.ids / .roles /
        .logprobs): logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]); column 0 is 0.
        With return_entropy, also entropy (B, T) of the distribution that predicted token t.
        Values at padding positions are meaningless (mask them, never multiply NaN by 0).
    """
    position_ids = position_ids_from_mask(attention_mask) if position_ids is None else position_ids
    if not (_is_ddp(model) or isinstance(model, LogprobModel)):
        model = LogprobModel(model)  # a bare Hugging Face model
    logp, ent = model(input_ids, attention_mask, position_ids, chunk_size, temperature, return_entropy, start,
                      check_finite)
    return (logp, ent) if return_entropy else logp


def first_loss_column(loss_mask: torch.Tensor) -> int:
    """(B, T) bool -> the first column holding a loss token in any row (0 if none): the
    `start` of `token_logprobs` for a batch."""
    return int(loss_mask.any(dim=0).int().argmax())  # argmax: the first maximum, 0 if all are 0


def masked_token_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, normaliser):
    """Sum of token NLL over loss tokens divided by a normaliser fixed outside.

    (B, T) float, (B, T) bool, scalar -> (scalar loss, {"nll_sum", "n_tokens"}).
    The normaliser is the number of loss tokens in the whole optimizer step (all micro-
    batches, all ranks), so summing this loss over micro-steps and ranks gives exactly the
    token mean of the step (style rule 8). Masked positions contribute exactly 0 (where, not
    multiply, so a NaN there cannot leak); an all-masked batch gives 0, not NaN (tests/faults.md F5).
    """
    nll_sum = torch.where(loss_mask.bool(), -logprobs, torch.zeros_like(logprobs)).sum()
    return nll_sum / max(float(normaliser), 1.0), {"nll_sum": nll_sum.detach(), "n_tokens": loss_mask.sum().detach()}


# -----------------------------------------------------------------------------
# Data: trajectory JSONL -> ids and roles

def build_example(tokenizer, problem: str, completion: str, outputs=None, eot: int | None = None,
                  **prompt_kwargs) -> dict:
    """Token ids and per-token roles of one trajectory, exactly as the engine feeds them.

    The prompt is `executor.stage_prompt_ids(tokenizer, problem, **prompt_kwargs)`
    (ROLE_PROMPT), generation prompt included (Qwen3-Thinking's ends in `<think>\n`: the
    trajectory is written inside the think block). Then the completion's segments
    (`executor.split_completion`, with the blocks' `outputs` when known): each run of model
    text tokenised alone, as a policy that writes it samples it (ROLE_MODEL), each output
    block tokenised alone, as the engine inserts it (ROLE_OUTPUT); then the end-of-turn id
    `eot` (default `executor.end_of_turn_id`; ROLE_MODEL: the model must learn to stop). The
    assistant turn is never rendered through the chat template, which may render a past
    turn differently (strip reasoning, add an empty think block) from the turn generated.
    Raises ValueError when `outputs` do not match the completion.
    """
    runs = [["", ROLE_MODEL]]  # [text, role]: model text, an output block, model text, ...
    for seg in executor.split_completion(completion, outputs):
        if seg.kind == "output":
            runs += [[seg.text, ROLE_OUTPUT], ["", ROLE_MODEL]]
        else:
            runs[-1][0] += seg.text
    for model, output in zip(runs[::2], runs[1::2]):
        # The engine stops right after the token holding the fence's last backtick; when this
        # tokenizer merges the newline after a fence into that token (Qwen2.5: "`\n"), the
        # newline is the model's and the output block has no leading newline.
        last = executor.decode_text(tokenizer, executor.encode_text(tokenizer, model[0] + "\n")[-1:])
        if output[0].startswith("\n") and last.endswith("\n") and last != "\n":
            model[0], output[0] = model[0] + "\n", output[0][1:]
    ids = executor.stage_prompt_ids(tokenizer, problem, **prompt_kwargs)
    roles = [ROLE_PROMPT] * len(ids)
    for text, role in runs:
        t = executor.encode_text(tokenizer, text)   # plain text: no forged control ids (tests/faults.md G14)
        ids += t
        roles += [role] * len(t)
    eot = executor.end_of_turn_id(tokenizer) if eot is None else eot
    return {"ids": ids + [eot], "roles": roles + [ROLE_MODEL]}


def read_trajectories(path: str):
    """Yield the rows of a trajectory JSONL as (where, problem, completion, outputs or
    None), checked without a tokenizer. Raises InputError naming file:line for a bad row."""
    for n, row in executor.read_jsonl(path):
        where = f"{path}:{n}"
        problem = row.get("problem", row.get("question"))
        if problem is None or row.get("completion") is None:
            raise executor.InputError(f"{where}: needs 'problem' and 'completion'")
        for key, value in (("problem", problem), ("completion", row["completion"])):
            if not isinstance(value, str):
                raise executor.InputError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
        blocks = row.get("blocks")
        if blocks is not None and not (isinstance(blocks, list) and all(
                isinstance(b, dict) and isinstance(b.get("output"), str) for b in blocks)):
            raise executor.InputError(f"{where}: field 'blocks' must be a list of objects with a string 'output'")
        outputs = [b["output"] for b in blocks] if blocks else None
        try:  # the blocks' outputs against the completion's, before any model loads (tests/faults.md B51)
            executor.split_completion(row["completion"], outputs)
        except ValueError as e:
            raise executor.InputError(f"{where}: {e}") from e
        yield where, problem, row["completion"], outputs


def load_sft_data(data, tokenizer, max_len: int, stateful: bool = False):
    """Build the examples of a trajectory JSONL (a path, or `read_trajectories` rows) under
    the prompt of `executor.stage_prompt_ids` (the stateful one for trajectories distilled
    with --stateful).
    Returns (examples, n_dropped): examples longer than `max_len` tokens are dropped and
    counted, never truncated. Raises InputError naming file:line for a bad row."""
    eot = executor.end_of_turn_id(tokenizer)
    examples = [build_example(tokenizer, problem, completion, outputs, eot, stateful=stateful)
                for _, problem, completion, outputs in (read_trajectories(data) if isinstance(data, str) else data)]
    kept = [e for e in examples if len(e["ids"]) <= max_len]
    return kept, len(examples) - len(kept)


def loss_mask_from_roles(roles: torch.Tensor, mask_outputs: bool = False) -> torch.Tensor:
    """(B, T) roles -> (B, T) bool: model tokens, plus interpreter-output tokens unless
    `mask_outputs` (the ablation). Never derived from token ids (pad may equal EOS)."""
    return (roles == ROLE_MODEL) | ((roles == ROLE_OUTPUT) & (not mask_outputs))


def collate(examples: list, pad_id: int, device="cpu") -> dict:
    """Right-pad examples into input_ids, attention_mask, position_ids and roles, all (B, T);
    padding has role ROLE_PAD and mask 0."""
    ids = pad_sequence([torch.tensor(e["ids"]) for e in examples], batch_first=True, padding_value=pad_id)  # (B, T)
    roles = pad_sequence([torch.tensor(e["roles"]) for e in examples], batch_first=True, padding_value=ROLE_PAD)
    mask = (roles != ROLE_PAD).long()  # (B, T) from lengths
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "position_ids": position_ids_from_mask(mask).to(device), "roles": roles.to(device)}


def step_indices(step: int, n_examples: int, global_batch: int, seed: int) -> list:
    """The examples of optimizer step `step`: each epoch is a permutation seeded by
    (seed, epoch), cut into global batches, the last partial one dropped. Depends on
    nothing else (not the world size), so a resumed or re-split run sees the same data."""
    epoch, k = divmod(step, n_examples // global_batch)  # (n_examples // global_batch steps an epoch)
    perm = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
    return perm[k * global_batch:(k + 1) * global_batch]


def micro_batches_for_rank(idx: list, lengths: list, micro: int, accum: int, world: int, rank: int) -> list:
    """Length-grouped split of one global batch: sort by length, cut into world * accum
    micro-batches of `micro` sequences; micro-batch c goes to rank c % world at micro-step
    c // world, so ranks run similar lengths in lockstep and padding stays small.
    Returns this rank's `accum` lists of example indices."""
    order = sorted(idx, key=lambda i: (lengths[i], i))
    chunks = [order[c * micro:(c + 1) * micro] for c in range(world * accum)]
    return [chunks[k * world + rank] for k in range(accum)]


# -----------------------------------------------------------------------------
# One optimizer step's backward


def backward_step(model, micro_batches: list, *, mask_outputs: bool = False, chunk_size: int = 1024,
                  autocast_dtype=None) -> dict:
    """Accumulate the gradient of one optimizer step over this rank's micro-batches.

    micro_batches: collated dicts (see `collate`) already on the model's device.
    The loss normaliser (loss tokens of the whole step) is all-reduced once, before the
    loop; each micro-loss is multiplied by the world size because DDP / FSDP *average*
    gradients over ranks, and we want their sum. Returns {"nll_sum", "n_loss_tokens",
    "n_tokens"} summed over ranks (floats).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = micro_batches[0]["input_ids"].device
    masks = [loss_mask_from_roles(mb["roles"], mask_outputs) for mb in micro_batches]
    n_local = [sum(float(m.sum()) for m in masks), sum(float(mb["attention_mask"].sum()) for mb in micro_batches)]
    n_loss, n_tok = all_reduce(torch.tensor(n_local, device=device)).tolist()
    nll_sum = torch.zeros((), device=device)
    for k, (mb, mask) in enumerate(zip(micro_batches, masks)):
        with grad_sync(model, sync=k == len(micro_batches) - 1), \
                torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            logp = token_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], chunk_size,
                                  start=first_loss_column(mask))
            loss, m = masked_token_loss(logp, mask, n_loss)
            (loss * world).backward()
        nll_sum += m["nll_sum"]
    return {"nll_sum": float(all_reduce(nll_sum)), "n_loss_tokens": n_loss, "n_tokens": n_tok}


def optimizer_step(model, optimizer, grad_clip: float) -> float:
    """Clip the global gradient norm to `grad_clip` (0 = no clipping), step, and clear the
    gradients. Returns the norm before clipping; when it is not finite (an inf or NaN
    gradient, or loss) the step is skipped: weights and AdamW state stay as they were.
    Under DDP the gradients are views into its all-reduce buckets (`gradient_as_bucket_view`)
    and are zeroed in place: set to None, the next micro-steps under no_sync would allocate
    a second full copy of them."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
    if math.isfinite(norm):  # the same norm on every rank: all skip together (tests/faults.md D10)
        optimizer.step()
    optimizer.zero_grad(set_to_none=not _is_ddp(model))
    return norm


def stop_after_skips(streak: int, limit: int):
    """End the run (exit status 1, one line) once `streak` steps in a row were skipped for a
    non-finite gradient norm and `limit` (> 0) is reached: a run that only skips learns nothing."""
    if limit and streak >= limit:
        print0(f"error: {streak} steps in a row had a non-finite gradient norm and were skipped "
               f"(--max-skipped-steps {limit}); the last checkpoint is kept", file=sys.stderr)
        raise SystemExit(1)


def cosine_schedule(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    """LR multiplier: linear warmup over `warmup` steps (first step at 1/warmup), then
    cosine from 1 to `min_ratio` at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# -----------------------------------------------------------------------------
# Save / resume


def _is_sharded(params) -> bool:
    return any(type(p).__name__ == "DTensor" for p in params)  # FSDP's parameters


def full_state_dict(model) -> dict:
    """The Hugging Face model's full (unsharded) state dict. Without FSDP, the module's own.
    Under FSDP every rank must call it (it gathers the shards) and rank 0 alone gets the
    tensors, on CPU."""
    lm = unwrap_model(model)
    if not _is_sharded(lm.parameters()):
        return lm.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = {k.removeprefix("lm."): v for k, v in get_model_state_dict(model, options=opts).items()}
    first = {}  # tied weights (embeddings / lm_head) gathered as two copies: share one again,
    for name, p in lm.named_parameters(remove_duplicate=False):  # so save_pretrained keeps the tie
        if id(p) in first and name in sd:
            sd[name] = sd[first[id(p)]]
        first.setdefault(id(p), name)
    return sd


def save_checkpoint(out_dir: str, model, tokenizer, args: dict, trainer_state: dict, optimizer=None):
    """Write a Hugging Face model directory atomically (temp dir, then rename).

    out_dir gets *.safetensors, config.json, the tokenizer files, args.json and this
    rank's `trainer_state` (the stage's entries: step, data position) as
    trainer_state_rank{r}.pt, to which `optimizer` adds its state ("optimizer": the full
    state dict, written by rank 0 under DDP; or under ZeRO "optimizer_shard": this rank's
    share), this process's python / numpy / torch / CUDA RNG states and the world size (all
    that `load_trainer_state` restores). Call on every rank (FSDP gathers the full state
    dict; the ranks synchronise); rank 0 writes the model. A model loaded from GGUF (dense
    weights, GGUF quantizer marker still attached) saves as plain safetensors.
    """
    rank, tmp, old = _rank(), out_dir.rstrip("/") + ".tmp", out_dir.rstrip("/") + ".old"
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # FSDP: this rank's shard
    bad = all_reduce(torch.tensor(float(sum(not bool(p.isfinite().all()) for p in params)), device=params[0].device))
    if bad > 0:  # never over the last good checkpoint (tests/faults.md D11)
        raise RuntimeError(f"{out_dir} not written: {int(bad)} weight tensors are not finite; "
                           "the last checkpoint stays")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    try:  # a full disk or Ctrl-C leaves no partial <dir>.tmp behind
        sd = full_state_dict(model)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
        state = {**trainer_state, "rng": rng, "world_size": world}
        if optimizer is not None and _is_zero(optimizer):
            # each rank writes its own share: consolidating on rank 0 would bring back the
            # memory that sharding saves
            state["optimizer_shard"] = optimizer.optim.state_dict()
        elif optimizer is not None and (rank == 0 or _is_sharded(model.parameters())):
            # DDP replicates the optimizer: rank 0's copy serves every rank (a model's worth of
            # memory and disk three times over saved per extra rank); RNG stays per rank
            state["optimizer"] = optimizer.state_dict()
        torch.save(state, os.path.join(tmp, f"trainer_state_rank{rank}.pt"))
        if rank == 0:
            lm = unwrap_model(model)
            executor.drop_gguf_marker(lm)  # (a model given here, not loaded by executor.load_model)
            lm.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            executor.write_json_atomic(os.path.join(tmp, "args.json"),
                                       {**args, "checkpoint": True, "world_size": world})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()  # every rank's trainer state is written before the directory is published
    if rank == 0:
        if os.path.exists(out_dir):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def newest_checkpoint(out: str) -> str | None:
    """The checkpoint folder in `out` written last (step_N, latest, final, or the `<dir>.old`
    a crash during a save leaves), or None; never a half-written `<dir>.tmp`."""
    found = [d for d in glob.glob(os.path.join(glob.escape(out), "*", "config.json")) if ".tmp" not in d]
    return os.path.dirname(max(found, key=os.path.getmtime)) if found else None


def check_run_dirs(prog: str, args, run_files: tuple, same: tuple = ()) -> str | None:
    """Check --out and --resume (of `args`) before a run loads or writes anything. Returns
    the checkpoint to resume from, or None. A crash between save_checkpoint's two renames
    leaves the last checkpoint as `<dir>.old`: that one is used then.

    Raises:
        InputError (one line naming the path): --out fails `executor.check_out` (its inputs:
            --model, --data, --drop-solved); --resume is not a checkpoint of this stage
            (no trainer state, or another stage's), or its args.json differs in one of
            `same` (what decides the run's data and loss) or in a --model given (the
            checkpoint's own then stays in args.model), or its trainer state is cut, or a
            log in --out has a bad line (tests/faults.md B20); --out is a live run's (locked,
            B16); or --out already holds a run
            (one of `run_files`) and no --resume was given: a fresh run there would
            overwrite its checkpoints and repeat its steps in the logs (the message names
            the newest checkpoint to resume from).
    """
    out, resume, stage = args.out, args.resume, prog.removesuffix(".py")
    executor.check_out(out, stage, (args.model, args.data, getattr(args, "drop_solved", None)),
                       [os.path.join(out, f) for f in ("args.json", *run_files)])
    if os.path.isdir(out):  # a live run there holds it (tests/faults.md B16)
        executor.lock_run(out)
    if resume:
        if not os.path.isdir(resume) and os.path.isdir(resume.rstrip("/") + ".old"):
            print0(f"{prog}: {resume} is missing (a crash while it was replaced): resuming from {resume}.old")
            resume = resume.rstrip("/") + ".old"
        if not os.path.isfile(os.path.join(resume, "trainer_state_rank0.pt")):
            raise executor.InputError(f"--resume {resume}: not a checkpoint directory (no trainer_state_rank0.pt; "
                                      "start from a model with --model)")
        saved = executor.read_json(os.path.join(resume, "args.json"))
        if (other := saved.get("stage", "grpo" if "group_size" in saved else "sft")) != stage:
            raise executor.InputError(f"--resume {resume}: a checkpoint of {other}.py, not of {prog}: start from "
                                      f"its weights with --model {resume}")
        # the weights are the checkpoint's: args.json names the model they grew from (tests/faults.md B46)
        given = (("model",) if args.model != executor.DEFAULT_POLICY else ())
        executor.check_same_args(os.path.join(resume, "args.json"), args, (*same, *given), f"the steps of {resume}")
        args.model = saved.get("model", args.model)
        check_optimizer_layout(resume, saved, args)
        for log in glob.glob(os.path.join(glob.escape(out), "*.jsonl")):  # a bad line: refused before any write
            executor.read_jsonl_tolerant(log)
        for state in glob.glob(os.path.join(glob.escape(resume), "trainer_state_rank*.pt")):
            if not zipfile.is_zipfile(state):  # (torch.save writes a zip: a cut file has no end record)
                raise executor.InputError(f"{state}: a damaged trainer state (a cut file?): resume from another "
                                          "checkpoint, or start from its weights with --model")
        return resume
    if found := [f for f in run_files if os.path.exists(os.path.join(out, f))]:
        ckpt = newest_checkpoint(out)
        advice = f"continue it with --resume {ckpt}" if ckpt else "it saved no checkpoint yet: delete it"
        raise executor.InputError(f"--out {out} already holds a run ({found[0]}); {advice}, or give a new --out")


def start_run(args_path: str, stage: str, args, lock: str):
    """A run's first write, on rank 0 once every check has passed: hold the run's lock
    (`executor.lock_run` on `lock`, its --out) and write `args_path` ({"stage", **args}),
    its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(args_path)), exist_ok=True)
    executor.lock_run(lock)
    executor.write_json_atomic(args_path, {"stage": stage, **vars(args)})


def check_torch(args, device, version: str = torch.__version__):
    """Refuse flags this torch cannot run (tests/faults.md D14): --fsdp needs
    torch.distributed.fsdp.fully_shard (torch >= 2.6); bf16 FSDP with --grad-checkpointing (on
    CUDA without --fp32) hits a recompute error in backward before torch 2.13. Raises InputError."""
    have = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    if args.fsdp and have < (2, 6):
        raise executor.InputError(f"--fsdp needs torch >= 2.6 (fully_shard), this is {version}: upgrade, or use DDP")
    if args.fsdp and args.grad_checkpointing and device.type == "cuda" and not args.fp32 and have < (2, 13):
        raise executor.InputError(f"--fsdp --grad-checkpointing in bf16 needs torch >= 2.13 (a recompute error in "
                                  f"backward before it), this is {version}: upgrade, or drop --grad-checkpointing")


def optimizer_layout(fsdp: bool, shard: bool, world: int) -> str:
    """How a run splits AdamW's state over its ranks: 'full' (one rank, or DDP: any number
    of ranks loads it), else 'FSDP over N ranks' or 'ZeRO over N ranks' (N files, one a rank)."""
    return "full" if world == 1 or not (fsdp or shard) else f"{'FSDP' if fsdp else 'ZeRO'} over {world} ranks"


def check_optimizer_layout(resume: str, saved: dict, args):
    """Refuse, before anything loads, a resume whose optimizer state cannot fit this run
    (tests/faults.md D7-D9): `saved` (its args.json) sharded by FSDP or ZeRO over other
    ranks, --fsdp toggled, or a rank's own shard missing. Raises InputError (one line)."""
    if not saved.get("save_optimizer", True):
        return  # weights only: any layout starts AdamW afresh
    files = glob.glob(os.path.join(glob.escape(resume), "trainer_state_rank*.pt"))
    n = saved.get("world_size", len(files))
    was = optimizer_layout(saved.get("fsdp", False), saved.get("shard_optimizer", False), n)
    now = optimizer_layout(args.fsdp, args.shard_optimizer, dist.get_world_size() if dist.is_initialized() else 1)
    if was != now and (was != "full" or now.startswith("FSDP")):  # (a full state loads into DDP, ZeRO or 1 rank)
        raise executor.InputError(f"--resume {resume}: its optimizer state is {was}, this run's {now}: resume with "
                                  f"the same ranks and --fsdp / --shard-optimizer, or from its weights with --model")
    if was != "full" and len(files) < n:
        raise executor.InputError(f"--resume {resume}: {n - len(files)} of its {n} ranks' trainer_state_rank*.pt are "
                                  f"missing ({was}: each rank's shard is its own)")


def interrupted_note(out: str) -> str:
    """The line a Ctrl-C prints for a training run: the newest checkpoint and the command
    that continues from it."""
    ckpt = newest_checkpoint(out)
    return f"kept {ckpt}; resume: {executor.command_line('--resume', ckpt)}" if ckpt else "no checkpoint was saved"


def load_trainer_state(ckpt_dir: str, optimizer=None, logs=()) -> dict:
    """This rank's trainer state from a checkpoint (rank 0's if the run had fewer ranks:
    exact for DDP's replicated optimizer, except per-rank RNG). With `optimizer` (made by
    `make_optimizer`), resumes a run: restores the optimizer (`load_optimizer_state`) and
    this process's RNG, says so, and (rank 0) drops the records after the checkpoint's step
    from the run's JSONL `logs`, so that a resumed run never logs a step twice.

    Raises:
        FileNotFoundError: no trainer state in `ckpt_dir`; ValueError: see `load_optimizer_state`.
    """
    rank0, own = (os.path.join(ckpt_dir, f"trainer_state_rank{r}.pt") for r in (0, _rank()))
    sharded = optimizer is not None and _is_sharded(p for g in optimizer.param_groups for p in g["params"])
    path = own if os.path.exists(own) else rank0  # torch.load: FileNotFoundError naming it if absent
    state = torch.load(path, map_location="cpu", weights_only=False)
    if sharded and path != own and ("optimizer" in state or "optimizer_shard" in state):
        # FSDP's shards are each rank's own (tests/faults.md D9); a weights-only checkpoint (no
        # optimizer) resumes on any number of ranks from rank 0's state (D17)
        raise FileNotFoundError(f"{own}: this rank's optimizer shard is missing")
    if "optimizer" not in state and "optimizer_shard" not in state and path != rank0:
        # a DDP rank > 0: the optimizer is rank 0's
        state["optimizer"] = torch.load(rank0, map_location="cpu", weights_only=False, mmap=True).get("optimizer")
    if optimizer is not None:
        if state.get("optimizer") is None and "optimizer_shard" not in state:
            print0(f"{ckpt_dir} holds no optimizer state (--no-save-optimizer): AdamW starts fresh")
        else:
            load_optimizer_state(optimizer, state, ckpt_dir)
        rng = state["rng"]
        random.setstate(rng["python"])
        if "numpy" in rng:  # (grpo checkpoints of before it was saved)
            np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        print0(f"resumed from {ckpt_dir} at step {state['step']}")
        for path in logs if _rank() == 0 else ():
            executor.trim_jsonl_steps(path, state["step"])
    return state


def make_optimizer(params, lr: float, weight_decay: float = 0.0, shard: bool = False):
    """AdamW over those of `params` that require grad, the paper's optimizer (its lr is the
    caller's); betas (0.9, 0.999) and eps 1e-8 are ours (departure 3 above).

    With `shard` and several DDP ranks: ZeRO stage 1 (torch's ZeroRedundancyOptimizer). Each
    rank keeps AdamW's two moments for only its share of the parameters, updates that share
    and broadcasts it; the update is the same as unsharded AdamW's. This saves
    (1 - 1/world) x 8 bytes per fp32 parameter a rank: 2.5 GB a rank for the 630M-parameter
    Qwen2.5-0.5B (untied head) on 2 ranks. Ignored with one rank or FSDP (whose optimizer
    state is sharded with the weights).

    Returns:
        a torch.optim.AdamW, or a ZeroRedundancyOptimizer wrapping one (its `param_groups`
        are the ones to schedule; save and restore with `save_checkpoint` /
        `load_trainer_state`, not `state_dict`).
    """
    params = [p for p in params if p.requires_grad]
    kw = dict(lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    if shard and dist.is_initialized() and dist.get_world_size() > 1 and not _is_sharded(params):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)
    return torch.optim.AdamW(params, **kw)


def _is_zero(opt) -> bool:
    return type(opt).__name__ == "ZeroRedundancyOptimizer"


def load_optimizer_state(opt, state: dict, where: str):
    """Restore the optimizer entry of a trainer state (`state`, with "world_size"): a full
    state dict ("optimizer"), or under ZeRO this rank's share ("optimizer_shard") into
    `opt`, made by `make_optimizer`. A full state loads into either kind; a ZeRO share only
    into ZeRO on as many ranks. ZeRO's share restores the moments only: its exposed param
    groups (lr and the rest) stay the caller's, which the local optimizer copies at each step,
    so the lr must be set again after a resume (`sft.main` sets it at every step).

    Raises:
        ValueError naming `where` (the checkpoint) when the shares do not fit this run.
    """
    if "optimizer_shard" not in state:
        opt.load_state_dict(state["optimizer"])  # ZeRO keeps its own share of a full state
        return
    n = state["world_size"]
    if not _is_zero(opt) or n != dist.get_world_size():
        raise ValueError(f"{where}: the optimizer state is sharded over {n} ranks (--shard-optimizer); "
                         f"resume with --shard-optimizer on {n} ranks, or start afresh from its weights with --model")
    opt.optim.load_state_dict(state["optimizer_shard"])


# -----------------------------------------------------------------------------
# Config


def parse_args(argv=None):
    p = executor.ArgumentParser(description="THINC SFT: masked full-token SFT on trajectories.")
    # model and data
    p.add_argument("--model", type=model_path, default=executor.DEFAULT_POLICY, help="HF dir, .gguf or packaged name")
    p.add_argument("--data", type=input_file, required=True, help="trajectory JSONL (problem, completion[, blocks])")
    p.add_argument("--out", required=True, help="output directory (checkpoints, log.jsonl)")
    p.add_argument("--resume", help="checkpoint directory to continue from exactly (its weights replace --model)")
    p.add_argument("--max-len", type=positive_int, default=32768, help="tokens per trajectory; longer ones are dropped")
    p.add_argument("--mask-outputs", action="store_true", help="ablation: no loss on ```output tokens")
    p.add_argument("--stateful", action="store_true", help="trajectories distilled with --stateful (its system prompt)")
    # optimisation
    p.add_argument("--lr", type=executor.unit_float, default=7e-6, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=fraction, default=0.0, help="cosine floor, fraction of --lr")
    p.add_argument("--warmup", type=fraction, default=0.03, help="warmup share of all steps (0 = none)")
    p.add_argument("--epochs", type=positive_int, default=3, help="passes over the data")
    p.add_argument("--max-steps", type=nonneg_int, default=0, help="optimizer steps; 0 = epochs decide")
    p.add_argument("--global-batch", type=positive_int, default=16, help="sequences per optimizer step, all ranks")
    p.add_argument("--save-every", type=nonneg_int, default=0, help="checkpoint every N steps; 0 = only at the end")
    add_training_args(p)
    return p.parse_args(argv)


def add_training_args(p):
    """The optimisation and system flags of sft.py and grpo.py (the same meaning in both)."""
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per forward, per rank")
    p.add_argument("--weight-decay", type=nonneg_float, default=0.0, help="AdamW decoupled weight decay")
    p.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="max global grad norm; 0 = off")
    p.add_argument("--max-skipped-steps", type=nonneg_int, default=5,
                   help="stop after N steps (grpo: updates) in a row skipped for a non-finite gradient; 0 = never")
    p.add_argument("--chunk-size", type=positive_int, default=1024, help="positions per lm_head/log-softmax chunk")
    # system
    p.add_argument("--seed", type=executor.seed_int, default=0, help="data order and RNG seed (rank r uses seed + r)")
    p.add_argument("--fsdp", action="store_true", help="shard with torch fully_shard instead of DDP")
    p.add_argument("--dist-timeout", type=executor.bounded(float, 0, 8760, low_open=True), default=24.0,
                   help="hours (<= 8760) a collective waits for the slowest rank (rollouts, a save); torch's: 10 min")
    p.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1 (DDP): a rank keeps 1/world of AdamW's state")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute layer activations in backward")
    p.add_argument("--fp32", action="store_true", help="no bf16 on CUDA (autocast; grpo's rollout copy); CPU is fp32")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")


# -----------------------------------------------------------------------------
# Training loop


# what decides an SFT run's data order and loss: a resume with other values is refused (the
# budgets and the lr may change; they apply from the resumed step)
RESUME_SAME = ("data_sha256", "max_len", "mask_outputs", "stateful", "global_batch", "seed")


def main(argv=None):
    args = parse_args(argv)
    # the trajectories' identity: another file of the same size is another run
    args.data_sha256 = hashlib.sha256(pathlib.Path(args.data).read_bytes()).hexdigest()[:16]
    rank, _, world, device = setup_distributed(args.seed, timeout=datetime.timedelta(hours=args.dist_timeout))
    args.resume = check_run_dirs("sft.py", args, ("log.jsonl", "final"), RESUME_SAME)
    check_torch(args, device)
    # derived sizes: global batch = micro-batch x accumulation steps x ranks
    accum, rest = divmod(args.global_batch, args.micro_batch * world)
    if rest:
        raise executor.InputError(f"--global-batch {args.global_batch} is not a multiple of --micro-batch "
                                  f"{args.micro_batch} x {world} ranks")
    print0(f"global batch {args.global_batch} = micro-batch {args.micro_batch} x accumulation {accum} x {world} ranks")
    rows = list(read_trajectories(args.data))  # bad rows end the run before the model loads
    if not rows:
        raise executor.InputError(f"{args.data}: no trajectories in the file")
    # distill.py's <stem>.args.json, when it is there, says which interpreter policy made the rows
    executor.check_same_args(args.data.removesuffix(".jsonl") + ".args.json", args, ("stateful",),
                             f"the trajectories in {args.data}")

    # 1) model (fp32 master weights) and data
    lm, tokenizer = executor.load_model(args.resume or args.model, dtype="float32", device="cpu")
    examples, dropped = load_sft_data(rows, tokenizer, args.max_len, args.stateful)
    lengths = [len(e["ids"]) for e in examples]
    n_sup = sum(sum(r in (ROLE_MODEL, ROLE_OUTPUT) for r in e["roles"]) for e in examples)
    print0(f"{len(examples)} trajectories, {sum(lengths)} tokens ({n_sup} supervised); "
           f"{dropped} dropped as longer than --max-len {args.max_len}")
    steps_per_epoch = len(examples) // args.global_batch
    if steps_per_epoch == 0:
        raise executor.InputError(f"{len(examples)} trajectories within --max-len {args.max_len}: fewer than one "
                                  f"global batch ({args.global_batch})")
    total = args.max_steps or args.epochs * steps_per_epoch
    warmup = int(args.warmup * total)
    print0(f"{steps_per_epoch} steps per epoch, {total} steps, {warmup} warmup")
    if rank == 0:  # every check passed: the run's first write
        start_run(os.path.join(args.out, "args.json"), "sft", args, lock=args.out)
    model = wrap_model(lm, device, fsdp=args.fsdp, grad_checkpointing=args.grad_checkpointing)
    print0(f"memory plan a rank: model + optimizer state "
           f"{state_gib(sum(p.numel() for p in lm.parameters()), world, args.fsdp, args.shard_optimizer):.1f} GiB")

    # 2) optimizer and resume (lr and weight decay are set at every step from this run's flags: new ones apply)
    opt = make_optimizer(model.parameters(), args.lr, args.weight_decay, shard=args.shard_optimizer)
    step, skipped = 0, 0
    if args.resume:
        step = load_trainer_state(args.resume, opt, logs=[os.path.join(args.out, "log.jsonl")])["step"]

    def save(name):
        save_checkpoint(os.path.join(args.out, name), model, tokenizer, {"stage": "sft", **vars(args)},
                        {"step": step}, opt)

    # 3) the loop: one optimizer step per global batch
    bar = executor.progress_bar(total=total, initial=step, disable=rank != 0 or args.no_progress, desc="sft",
                                unit="step")
    while step < total:
        t0 = time.perf_counter()
        idx = step_indices(step, len(examples), args.global_batch, args.seed)
        mbs = [collate([examples[i] for i in c], tokenizer.pad_token_id, device)
               for c in micro_batches_for_rank(idx, lengths, args.micro_batch, accum, world, rank)]
        m = backward_step(model, mbs, mask_outputs=args.mask_outputs, chunk_size=args.chunk_size,
                          autocast_dtype=torch.bfloat16 if device.type == "cuda" and not args.fp32 else None)
        lr = args.lr * cosine_schedule(step, total, warmup, args.min_lr_ratio)
        for group in opt.param_groups:  # this run's flags, after a resume too (ZeRO's local optimizer copies them)
            group["lr"], group["weight_decay"] = lr, args.weight_decay
        grad_norm = optimizer_step(model, opt, args.grad_clip)
        skipped = 0 if math.isfinite(grad_norm) else skipped + 1  # steps in a row skipped (tests/faults.md D10)
        step, dt = step + 1, time.perf_counter() - t0
        rec = {"step": step, "epoch": (step - 1) // steps_per_epoch, "lr": lr,
               "grad_norm": grad_norm if not skipped else None, "skipped_in_a_row": skipped,
               "loss": m["nll_sum"] / max(1.0, m["n_loss_tokens"]), "loss_tokens": int(m["n_loss_tokens"]),
               "tokens": int(m["n_tokens"]), "tokens_per_s": m["n_tokens"] / dt, "step_s": dt}
        if rank == 0:
            executor.append_jsonl(os.path.join(args.out, "log.jsonl"), [rec])
        bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{lr:.2e}", refresh=False)
        bar.update(1)
        stop_after_skips(skipped, args.max_skipped_steps)
        if args.save_every and step % args.save_every == 0 and step < total:
            save(f"step_{step:06d}")
    bar.close()
    save("final")
    print0(f"saved {os.path.join(args.out, 'final')}")
    cleanup_distributed()


if __name__ == "__main__":
    sys.exit(executor.cli(main, interrupted=lambda: interrupted_note(parse_args().out)))
