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

    python executor.py block.py          # run a file through the sandbox, print what a model sees

Departures from the paper (it does not describe its executor):
  1. Each block is a complete program run alone in a fresh process (no state carried
     between blocks); the prompt tells the model so.
  2. The sandbox guards against accidents (infinite loops, memory and fork bombs, huge
     output, exit()), not against an adversary: blocks run as the caller's user. Run the
     whole job in a container when the model is untrusted in that sense.
"""
import argparse
import inspect
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass

# -----------------------------------------------------------------------------
# Sandbox: a fork server of pre-imported workers

SANDBOX_STATUSES = ("ok", "error", "timeout", "memory", "killed")


class SandboxError(RuntimeError):
    """The sandbox itself failed (cannot start, template died twice). Never shown to the
    model as if its code failed, never scored: the caller must stop or retry."""


@dataclass
class ExecResult:
    """What one code block produced.

    output: stdout and stderr interleaved in write order, capped to head + tail with a
        marker of how much was cut; ends with a status line for a timeout / kill / exit code.
    status: 'ok' | 'error' (an exception or a non-zero exit) | 'timeout' | 'memory'
        (MemoryError or the address-space limit) | 'killed' (a signal, e.g. a segfault).
    seconds: wall time of the block.
    """
    output: str
    status: str
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _template_main(slot_fds, preimports):  # runs in the template process, stdlib only
    """The fork server. It imports numpy, scipy and sympy once, then for each request on a
    slot socket forks a child that runs one block. Requests carry the code, the limits, a
    fresh working directory and (as SCM_RIGHTS) the write ends of the output and status
    pipes. The template reaps every child (it is a child subreaper, so orphans of a block
    come back to it) and reports each block's exit status on the slot it came from."""
    import ctypes
    import importlib
    import json
    import os
    import resource
    import select
    import signal
    import socket

    os.chdir("/")
    for name in preimports:
        try:
            importlib.import_module(name)
        except Exception:  # a missing package surfaces as an ImportError inside the block
            pass
    try:  # PR_SET_CHILD_SUBREAPER: orphaned grandchildren are reparented here and reaped
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except Exception:
        pass
    slots = [socket.socket(fileno=fd) for fd in slot_fds]
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    running = {}  # pid -> slot socket
    slots[0].sendall(b'{"ready": true}\n')

    def child(req, out_w, status_w):
        os.setsid()  # own session and process group: killed as a group
        for s in slots:
            s.close()
        os.close(wake_r)
        os.close(wake_w)
        os.chdir(req["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(out_w, 2)
        for fd in (devnull, out_w):
            os.close(fd)
        mem = req["memory_mb"] * 1024 * 1024
        for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, req["cpu_s"]),
                         (resource.RLIMIT_FSIZE, req["fsize_mb"] * 1024 * 1024),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, req["nproc"])):
            try:
                resource.setrlimit(lim, (val, val))
            except (ValueError, OSError):
                pass
        if os.geteuid() == 0:
            _drop_root_caps()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the timeout notice
        os.environ["HOME"] = os.environ["MPLCONFIGDIR"] = req["cwd"]
        os.set_inheritable(status_w, False)
        _run_block(req["code"], status_w)

    def _drop_root_caps():
        # Root ignores RLIMIT_NPROC while it holds CAP_SYS_ADMIN / CAP_SYS_RESOURCE, so a
        # fork bomb would not fail fast. Drop them from the bounding set and from the
        # effective / permitted / inheritable sets (capset, header version 3).
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (21, 24):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()
        if libc.capget(hdr, data) == 0:
            keep = ~((1 << 21) | (1 << 24)) & 0xFFFFFFFF
            for i in range(0, 6, 3):
                mask = keep if i == 0 else 0xFFFFFFFF
                for j in range(3):
                    data[i + j] &= mask
            libc.capset(hdr, data)

    def _run_block(code, status_w):
        import io
        import linecache
        import sys
        import traceback
        # One buffered text stream for both stdout and stderr keeps their interleaving
        # exact; it is flushed on every way out, os._exit included.
        stream = io.TextIOWrapper(os.fdopen(1, "wb", buffering=1 << 16), encoding="utf-8",
                                  errors="replace", line_buffering=False)
        sys.stdout = sys.stderr = sys.__stdout__ = sys.__stderr__ = stream

        class NoStdin(io.TextIOBase):  # input() fails at once instead of waiting out the timeout
            def read(self, *a):
                raise EOFError("no input is available: the block runs without stdin")
            readline = read

        sys.stdin = sys.__stdin__ = NoStdin()
        real_exit, block_pid = os._exit, os.getpid()

        def finish(kind, detail=""):
            try:
                stream.flush()
            except Exception:
                pass
            if os.getpid() == block_pid:  # processes the block forked say nothing
                os.write(status_w, json.dumps({"kind": kind, "detail": detail}).encode())
            real_exit(0)

        os._exit = lambda n=0: finish("os_exit", str(n))
        fname = "<code>"
        linecache.cache[fname] = (len(code), None, code.splitlines(True), fname)
        try:
            compiled = compile(code, fname, "exec")
            exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            code_ = e.code
            finish("exit", "" if code_ is None else str(code_))
        except BaseException as e:  # the block's own error: show its traceback, our frames cut
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != fname:
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb if not isinstance(e, SyntaxError) else None)
            kind = {"KeyboardInterrupt": "timeout", "MemoryError": "memory"}.get(type(e).__name__, "error")
            finish(kind, type(e).__name__)
        finish("ok")

    while True:
        try:
            ready, _, _ = select.select(slots + [wake_r], [], [])
        except InterruptedError:
            ready = []
        for s in ready:
            if s == wake_r:
                os.read(wake_r, 4096)
                continue
            msg, fds, _, _ = socket.recv_fds(s, 1 << 20, 2)
            if not msg:  # the caller closed its end: shut down
                return
            req = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                try:
                    child(req, fds[0], fds[1])
                finally:
                    os._exit(70)
            for fd in fds:
                os.close(fd)
            running[pid] = s
            s.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while True:  # reap every exited child, block processes and orphans alike
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            s = running.pop(pid, None)
            if s is not None:
                s.sendall(json.dumps({"exit": status}).encode() + b"\n")


def _count_user_processes() -> int:
    uid = os.getuid()
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                pass
    return n


class Sandbox:
    """A pool of sandboxed Python workers: each code block runs alone in a fresh process.

    Every block is a complete program: nothing (variables, imports, files) carries over
    from one block to the next. It runs in a process forked from a template that has
    already imported numpy, scipy and sympy (milliseconds per block instead of the ~1 s a
    fresh interpreter needs for sympy), in its own session / process group, with:
    a wall-clock timeout (first a KeyboardInterrupt so the block's traceback shows where it
    was, then SIGKILL to the whole group); rlimits on address space, CPU seconds, process
    count (fork bombs fail fast) and file size; a fresh empty working directory removed
    afterwards; stdin from /dev/null; a scrubbed environment (MPLBACKEND=Agg, no DISPLAY,
    none of the caller's variables). Output (stdout + stderr in write order) is read with
    bounded memory and returned as head + tail.

    Args:
        workers: blocks run at once (default: CPU count).
        timeout: wall-clock seconds per block.
        memory_mb: address-space limit per block, MiB.
        max_output_chars: output cap, characters (head and tail halves kept).
        max_file_mb: largest file a block may write, MiB.
        python: interpreter for the template (numpy / scipy / sympy importable there).
    Raises:
        SandboxError: the template cannot start, or died and cannot be restarted.
    Use as a context manager, or call close(); nothing is left running afterwards.
    """

    PREIMPORTS = ("math", "fractions", "itertools", "functools", "collections", "decimal",
                  "numpy", "sympy", "scipy", "scipy.special", "scipy.optimize", "scipy.linalg",
                  "scipy.integrate")

    def __init__(self, workers: int | None = None, timeout: float = 10.0, memory_mb: int = 4096,
                 max_output_chars: int = 2000, max_file_mb: int = 64, python: str = sys.executable):
        self.workers = workers or os.cpu_count() or 1
        self.timeout, self.memory_mb, self.python = timeout, memory_mb, python
        self.max_output_chars, self.max_file_mb = max_output_chars, max_file_mb
        self._lock = threading.Lock()
        self._proc = None
        self._generation = 0
        self._start()

    # -- template lifecycle -------------------------------------------------------
    def _start(self):
        ours, theirs = zip(*(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                             for _ in range(self.workers)))
        src = inspect.getsource(_template_main)
        fds = [s.fileno() for s in theirs]
        cmd = [self.python, "-I", "-c", f"{src}\n_template_main({fds!r}, {list(self.PREIMPORTS)!r})"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "MPLBACKEND": "Agg",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        try:
            proc = subprocess.Popen(cmd, pass_fds=fds, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as e:
            for s in ours + theirs:
                s.close()
            raise SandboxError(f"sandbox cannot start {self.python!r}: {e}") from e
        for s in theirs:
            s.close()
        ready, _, _ = select.select([ours[0]], [], [], 60)
        hello = ours[0].recv(4096) if ready else b""
        if b"ready" not in hello:
            proc.kill()
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.wait() is not None else ""
            for s in ours:
                s.close()
            raise SandboxError(f"sandbox template failed to start with {self.python!r}: {err.strip()}")
        proc.stderr.close()
        # Blocks as root: RLIMIT_NPROC counts every process of the user, so the limit is
        # what is running now plus headroom for the blocks themselves.
        self._nproc = _count_user_processes() + 64 * self.workers
        self._proc = proc
        self._slots = queue.Queue()
        for s in ours:
            self._slots.put(s)
        self._generation += 1

    def _restart(self, generation):
        with self._lock:
            if generation != self._generation:  # another thread already restarted it
                return
            self._stop()
            self._start()

    def _stop(self):
        if self._proc is None:
            return
        while not self._slots.empty():
            self._slots.get_nowait().close()
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        self._proc = None

    def close(self):
        """Stop the template and every worker. Idempotent."""
        with self._lock:
            self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- running blocks -----------------------------------------------------------
    def run(self, code: str) -> ExecResult:
        """Run one block (a complete program) and return what the model should see.
        Thread-safe. Raises SandboxError if the sandbox itself fails twice in a row."""
        for attempt in range(2):
            generation = self._generation
            if self._proc is None:
                raise SandboxError("sandbox is closed")
            slot = self._slots.get()
            try:
                return self._run_on_slot(slot, code)
            except (OSError, _TemplateDied) as e:
                if attempt == 1:
                    raise SandboxError(f"sandbox template died: {e}") from e
                self._restart(generation)
            finally:
                if generation == self._generation:
                    self._slots.put(slot)
                else:  # the template was restarted under us: this slot is dead
                    slot.close()

    def run_many(self, codes: list[str]) -> list[ExecResult]:
        """Run blocks in parallel (up to `workers` at once); results in input order."""
        if not codes:
            return []
        results = [None] * len(codes)
        errors = []

        def work(i):
            try:
                results[i] = self.run(codes[i])
            except SandboxError as e:
                errors.append(e)

        threads = []
        todo = queue.Queue()
        for i in range(len(codes)):
            todo.put(i)

        def drain():
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                work(i)

        for _ in range(min(self.workers, len(codes))):
            threads.append(threading.Thread(target=drain, daemon=True))
            threads[-1].start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def _run_on_slot(self, slot, code) -> ExecResult:
        t0 = time.monotonic()
        cwd = tempfile.mkdtemp(prefix="thinc_block_")
        out_r, out_w = os.pipe()
        st_r, st_w = os.pipe()
        try:
            req = {"code": code, "cwd": cwd, "memory_mb": self.memory_mb,
                   "cpu_s": int(self.timeout) + 2, "fsize_mb": self.max_file_mb, "nproc": self._nproc}
            socket.send_fds(slot, [json.dumps(req).encode()], [out_w, st_w])
            os.close(out_w)
            os.close(st_w)
            out_w = st_w = None
            pid = _recv_json(slot, 10)["pid"]
            capture, exit_status, timed_out = _read_block(out_r, slot, pid, self.timeout,
                                                          self.max_output_chars)
            os.set_blocking(st_r, False)
            try:
                status_msg = os.read(st_r, 4096)
            except BlockingIOError:  # killed before it could say anything
                status_msg = b""
        finally:
            for fd in (out_r, out_w, st_r, st_w):
                if fd is not None:
                    os.close(fd)
            shutil.rmtree(cwd, ignore_errors=True)
        info = json.loads(status_msg) if status_msg else None
        note, status = _describe(info, exit_status, timed_out, self.timeout)
        return ExecResult(output=_join_output(capture, note, self.max_output_chars),
                          status=status, seconds=time.monotonic() - t0)


class _TemplateDied(Exception):
    pass


def _recv_json(sock, timeout):
    ready, _, _ = select.select([sock], [], [], timeout)
    msg = sock.recv(4096) if ready else b""
    if not msg:
        raise _TemplateDied("no answer from the template")
    return json.loads(msg)


class _HeadTail:
    """Keeps the first and last `half` bytes of a stream and counts what it drops."""

    def __init__(self, half):
        self.half, self.head, self.tail, self.total = half, bytearray(), deque(), 0
        self.tail_len = 0

    def add(self, data):
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail.append(data)
            self.tail_len += len(data)
            while self.tail_len - len(self.tail[0]) >= self.half:
                self.tail_len -= len(self.tail.popleft())

    @property
    def cut(self):
        return max(0, self.total - len(self.head) - min(self.tail_len, self.half))

    def text(self):
        tail = b"".join(self.tail)[-self.half:] if self.tail else b""
        if self.cut:
            return (self.head.decode("utf-8", "replace"), tail.decode("utf-8", "replace"))
        return (self.head + tail).decode("utf-8", "replace")


def _read_block(out_r, slot, pid, timeout, max_chars):
    """Read a running block's output until it exits (or the deadline), with bounded memory.
    Returns (capture, wait status or None, timed_out)."""
    capture = _HeadTail(max(64, max_chars))  # bytes; trimmed to characters later
    deadline = time.monotonic() + timeout
    exit_status, timed_out, interrupted, out_open = None, False, False, True
    while exit_status is None:
        now = time.monotonic()
        if now >= deadline:
            if not interrupted:
                # First a KeyboardInterrupt, so the traceback shows the line it was stuck on;
                # a block that swallows it is killed after a short grace.
                timed_out, interrupted = True, True
                _signal_group(pid, signal.SIGINT)
                deadline = now + 0.5
            else:
                _signal_group(pid, signal.SIGKILL)
                deadline = now + 5
        fds = ([out_r] if out_open else []) + [slot]
        ready, _, _ = select.select(fds, [], [], max(0.0, deadline - time.monotonic()))
        if out_r in ready:
            data = os.read(out_r, 1 << 16)
            if data:
                capture.add(data)
            else:
                out_open = False
        if slot in ready:
            msg = slot.recv(4096)
            if not msg:
                raise _TemplateDied("template closed the slot")
            exit_status = json.loads(msg)["exit"]
    # The block's process is gone; whatever it started in its group goes too. Processes
    # forked while a kill is delivered can escape one killpg, so repeat until the group is
    # empty (the template, as subreaper, reaps them).
    for _ in range(200):
        _signal_group(pid, signal.SIGKILL)
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.005)
    os.set_blocking(out_r, False)
    end = time.monotonic() + 0.2  # drain what is buffered (escaped writers may hold it open)
    while time.monotonic() < end:
        ready, _, _ = select.select([out_r], [], [], end - time.monotonic())
        if not ready:
            break
        try:
            data = os.read(out_r, 1 << 16)
        except BlockingIOError:
            continue
        if not data:
            break
        capture.add(data)
    return capture, exit_status, timed_out


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(info, exit_status, timed_out, timeout):
    """The status of a finished block and a last line that says, in words a model can act
    on, why it stopped (empty for a normal finish). Returns (note, status)."""
    kind = info["kind"] if info else None
    if timed_out:
        return f"TimeoutError: the block ran longer than {timeout:g} s and was stopped.", "timeout"
    if kind == "ok":
        return "", "ok"
    if kind in ("error", "timeout"):
        return "", "error"
    if kind == "memory":
        return "(The block hit its memory limit.)", "memory"
    if kind in ("exit", "os_exit"):
        code = 0 if info["detail"] in ("", "0", "None") else info["detail"]
        fn = "os._exit" if kind == "os_exit" else "sys.exit"
        return f"[{fn}({code}) called: the program stopped here]", "ok" if code == 0 else "error"
    # No status line from the block: the process died without running our exit path.
    if exit_status is not None and os.WIFSIGNALED(exit_status):
        sig = os.WTERMSIG(exit_status)
        name = signal.Signals(sig).name if sig in {s.value for s in signal.Signals} else str(sig)
        if sig == signal.SIGKILL:
            return "Process killed by SIGKILL (possibly out of memory).", "memory"
        if sig == signal.SIGXCPU:
            return "Process killed: CPU time limit exceeded.", "timeout"
        return f"Process killed by signal {name} ({signal.strsignal(sig)}).", "killed"
    code = os.WEXITSTATUS(exit_status) if exit_status is not None else "unknown"
    return f"Process exited abruptly with code {code}.", "error"


def _join_output(capture, note, max_chars):
    """The block's output capped at max_chars (head + a marker of what was cut + tail),
    then the status note."""
    half = max_chars // 2
    text = capture.text()
    if isinstance(text, tuple):  # cut while reading: sizes are in bytes
        head, tail = text
        body = f"{head[:half]}\n... [{capture.cut} bytes of output cut] ...\n{tail[-half:]}"
    elif len(text) > max_chars:
        body = f"{text[:half]}\n... [{len(text) - 2 * half} characters of output cut] ...\n{text[-half:]}"
    else:
        body = text
    if note:
        body += ("" if not body or body.endswith("\n") else "\n") + note
    return body


# -----------------------------------------------------------------------------
# Prompt and model loading

SYSTEM_PROMPT = """You solve math problems by thinking in code.
First write a short plan in plain words (a few sentences). Then write only Python code blocks, each in ```python ... ```.
After each block the system runs it and shows what it printed in an ```output block; use it to decide the next block.
Every block is a complete program run on its own: nothing (variables, imports, functions) carries over, so each block imports and defines what it needs.
numpy, scipy and sympy are available. Print every result you rely on. Check your work inside code (asserts, a second independent method), not in prose.
When a block has printed the answer, finish with \\boxed{answer} and nothing else."""

ROLE_PAD, ROLE_PROMPT, ROLE_MODEL, ROLE_OUTPUT = 0, 1, 2, 3


def load_model(path: str, dtype: str | None = None, device="cpu"):
    """Load a causal LM and its tokenizer for inference or training.

    Args:
        path: a local Hugging Face model directory, or a `.gguf` file (dequantized by
            transformers to dense weights; needs the `gguf` and `accelerate` packages).
        dtype: 'float32' | 'bfloat16' | 'float16'; default fp32 on CPU, bf16 on CUDA.
        device: torch device to place the model on.
    Returns:
        (model in eval mode, tokenizer). A GGUF model has its quantizer marker cleared so
        `save_pretrained` writes plain safetensors (its weights are already dense).
    Raises:
        FileNotFoundError: no such path. ImportError: a .gguf without gguf / accelerate.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(path):
        raise FileNotFoundError(f"model path not found: {path}")
    device = torch.device(device)
    if dtype is None:
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    kw = {}
    if path.endswith(".gguf"):
        for pkg in ("gguf", "accelerate"):
            try:
                __import__(pkg)
            except ImportError as e:
                raise ImportError(f"loading {path} needs the '{pkg}' package: pip install gguf accelerate") from e
        path, kw["gguf_file"] = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa", **kw)
    if kw:  # transformers keeps a GGUF quantizer on the model, which blocks save_pretrained
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def build_prompt_ids(tokenizer, problem: str, fewshot=(), system: str = SYSTEM_PROMPT) -> list[int]:
    """Token ids of the prompt, built with the tokenizer's own chat template: the system
    message, then each (problem, completion) few-shot pair as prior user / assistant
    turns, then the problem, then the assistant header (generation prompt)."""
    msgs = [{"role": "system", "content": system}]
    for q, a in fewshot:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": problem})
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """Every id that ends a turn (case G4): the tokenizer's EOS, every generation-config
    EOS id (an int or a list), and the chat end-of-turn tokens the vocabulary has."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    vocab = tokenizer.get_vocab()
    for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>"):
        if t in vocab:
            ids.add(vocab[t])
    return ids


# -----------------------------------------------------------------------------
# Sampling: small pure functions over (B, V) logits

def sample_next_token(logits, generator, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0):
    """Draw one token per row.

    Args:
        logits: (B, V) float, any dtype (computed in fp32).
        generator: torch.Generator on the logits' device (the only randomness).
        temperature: 0 = argmax (deterministic, no division); > 0 scales logits by 1/T.
        top_p: keep the smallest prefix of tokens (by probability) whose mass is >= top_p,
            never fewer than one; 1.0 = no-op.
        top_k: keep the k most likely tokens; 0 = no-op.
    Returns:
        tokens (B,) long and logprobs (B,) float32: log-softmax of logits / T at the
        token (raw logits at T = 0), *before* top-p / top-k, which is what the trainer
        recomputes.
    """
    import torch
    logits = logits.float()
    scaled = logits / temperature if temperature > 0 else logits  # (B, V)
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    if temperature <= 0:
        tokens = torch.argmax(logits, dim=-1)  # (B,)
    else:
        probs = filter_top_p_top_k(torch.softmax(scaled, dim=-1), top_p, top_k)  # (B, V)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def filter_top_p_top_k(probs, top_p: float = 1.0, top_k: int = 0):
    """Zero out tokens outside top-k and outside the top-p nucleus. probs: (B, V), rows
    sum to 1. Returns (B, V), not renormalised (multinomial does not need it)."""
    import torch
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]  # (B, 1)
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)  # (B, V)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop = before >= top_p
        drop[:, 0] = False  # at least one token survives
        probs = probs.scatter(1, idx, sorted_p.masked_fill(drop, 0.0))
    return probs


# -----------------------------------------------------------------------------
# Code-fence detection on the decoded text of the stream

_PY_LANGS = ("python", "py", "python3")


class _FenceScanner:
    """Finds, in a row's model text since its last output block, the closing fence of a
    ```python block (or an ```output fence the model wrote itself). Works on decoded
    text, so it does not matter how the tokenizer splits backticks (case G5). A fence
    counts only at the start of a line, so ``` inside a string literal does not stop."""

    def __init__(self):
        self.text, self.line_start, self.in_code = "", 0, False
        self.code_start = self.code_end = None  # the block's code: text[code_start:code_end]

    def feed(self, piece: str):
        """Append decoded text; return ('close' | 'fake_output', cut) where cut is the
        index in self.text just after the fence to keep, or None."""
        self.text += piece
        while True:
            line = self.text[self.line_start:]
            nl = line.find("\n")
            if line.startswith("```"):
                if self.in_code:
                    self.code_end = self.line_start
                    return "close", self.line_start + 3
                if line.startswith("```output"):
                    return "fake_output", self.line_start
                if nl >= 0 and line[3:nl].strip().lower() in _PY_LANGS:
                    self.in_code, self.code_start = True, self.line_start + nl + 1
            elif len(line) < 3 and "```".startswith(line) and nl < 0:
                return None  # maybe the start of a fence: wait for more text
            if nl < 0:
                return None
            self.line_start += nl + 1


# -----------------------------------------------------------------------------
# Rollout: batched, KV-cached decoding alternating with the sandbox

@dataclass
class Sample:
    """One trajectory, token-in / token-out.

    ids: (P + C,) prompt ids then every completion id exactly as fed to the model.
    roles: (P + C,) ROLE_PROMPT / ROLE_MODEL / ROLE_OUTPUT per token (output = environment).
    logprobs: (P + C,) the sampler's logprob of each model token (log-softmax of logits / T,
        raw logits at T = 0); NaN at prompt and output positions.
    text: the completion decoded (plan, blocks, outputs, answer), without a final EOS.
    blocks: one {"code", "output", "status"} per executed block.
    finish_reason: 'stop' (EOS) | 'length' (context or new-token budget) | 'tool_budget'.
    pred: the answer extracted from the model's own text after its last output block.
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
    final_text: str = ""

    @property
    def n_model_tokens(self):
        return sum(r == ROLE_MODEL for r in self.roles)

    @property
    def n_output_tokens(self):
        return sum(r == ROLE_OUTPUT for r in self.roles)


class _Row:
    """Per-sample decoding state (plain data; the loop in `rollout` drives it)."""

    def __init__(self, prompt_ids):
        self.ids, self.roles = list(prompt_ids), [ROLE_PROMPT] * len(prompt_ids)
        self.logprobs = [float("nan")] * len(prompt_ids)
        self.prompt_len = self.n_fed = len(prompt_ids)  # n_fed: ids already in the KV cache
        self.scanner = _FenceScanner()
        self.seg_start = len(self.ids)  # first id of the current model segment
        self.blocks, self.tool_calls, self.n_model = [], 0, 0
        self.finish, self.code = None, None  # finish reason; code waiting to run
        self.plan_text = None


def _pad_left(seqs, pad_id, device):
    """Left-pad a list of id lists into (B, L) ids and a (B, L) 0/1 mask."""
    import torch
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, L - len(s):] = torch.tensor(s)
            mask[i, L - len(s):] = 1
    return ids.to(device), mask.to(device)


def _forward_chunk(model, cache, past_mask, feeds, n_real, pad_id):
    """Append one ragged chunk per row to the KV cache and return the last logits.

    feeds: list of B id lists (possibly empty: the row waits); they are left-padded, so a
        row's pads sit in the *middle* of its mask, after its history.
    past_mask: (B, S) 0/1 mask of what the cache holds. n_real: (B,) real tokens so far.
    Returns (logits (B, V) at each row's last fed position, new mask (B, S + L), n_real).
    Position ids count real tokens only (case G1), and the causal mask is built by
    transformers from the cache length, aligned bottom-right (case G8).
    """
    import torch
    ids, mask = _pad_left(feeds, pad_id, past_mask.device)  # (B, L), (B, L)
    pos = n_real[:, None] + torch.cumsum(mask, dim=1) - 1  # (B, L)
    pos = pos.clamp(min=0) * mask
    full_mask = torch.cat([past_mask, mask], dim=1)  # (B, S + L)
    out = model(input_ids=ids, attention_mask=full_mask, position_ids=pos, cache=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :], full_mask, n_real + mask.sum(dim=1)


def rollout(model, tokenizer, prompts, sandbox, *, n: int = 1, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, max_context: int = 16384, max_new_tokens: int = 0,
            max_tool_calls: int = 20, seed: int = 0, progress: bool = False) -> list:
    """Sample THINC trajectories: decode, run each closed ```python block, append its
    ```output block, continue from the KV cache, until EOS or a budget.

    Args:
        prompts: list of prompt id lists (from `build_prompt_ids`), ragged.
        sandbox: a `Sandbox`; all blocks paused at the same time run in parallel.
        n: samples per prompt (a GRPO group); the prompt is prefilled once and its cache
            shared, every row's first token drawn independently (case G7).
        temperature, top_p, top_k: see `sample_next_token`.
        max_context: tokens of prompt + completion; reaching it ends a row with 'length'.
        max_new_tokens: model tokens per sample; 0 = no limit beyond max_context.
        max_tool_calls: executed blocks per sample; one more closed block ends the row
            with 'tool_budget' (that block is not run).
        seed: seeds the single torch.Generator of this call; the same seed, prompts and
            batch reproduce the same samples.
    Returns:
        len(prompts) * n `Sample`s, prompt-major (result[i * n + j]).
    Raises:
        SandboxError: the sandbox itself failed.
    """
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    stops = stop_token_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = [_Row(p) for p in prompts for _ in range(n)]
    pieces = {}  # token id -> decoded text, for the fence scanner

    def piece(t):
        if t not in pieces:
            pieces[t] = tokenizer.decode([t])
        return pieces[t]

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(rows), desc="rollout", unit="sample", leave=False)

    def finish(r, reason):
        r.finish = reason
        if bar is not None:
            bar.update(1)

    with torch.inference_mode():
        # 1) prefill each distinct prompt once, then give every sample its own cache rows
        cache = DynamicCache(config=model.config)
        n_real = torch.zeros(len(prompts), dtype=torch.long, device=device)
        mask = torch.zeros((len(prompts), 0), dtype=torch.long, device=device)
        logits, mask, n_real = _forward_chunk(model, cache, mask, [list(p) for p in prompts], n_real, pad_id)
        if n > 1:
            cache.batch_repeat_interleave(n)
            mask, n_real = mask.repeat_interleave(n, 0), n_real.repeat_interleave(n, 0)
            logits = logits.repeat_interleave(n, 0)
        live = list(range(len(rows)))  # batch position -> row index
        for i in live:
            if len(rows[i].ids) >= max_context:
                finish(rows[i], "length")
        need = [rows[i].finish is None for i in live]  # rows that sample from `logits`

        while True:
            # 2) sample for every row that was fed something, and check its stops
            idx = [b for b, w in enumerate(need) if w]
            if idx:
                sel = torch.tensor(idx, device=device)
                tokens, logps = sample_next_token(logits[sel], gen, temperature, top_p, top_k)
                for b, t, lp in zip(idx, tokens.tolist(), logps.tolist()):
                    _accept_token(rows[live[b]], t, lp, stops, piece, max_context, max_new_tokens,
                                  max_tool_calls, tokenizer, finish)
            # 3) finished rows leave the batch (their cache rows are freed)
            keep = [b for b, i in enumerate(live) if rows[i].finish is None]
            if len(keep) < len(live):
                if not keep:
                    break
                k = torch.tensor(keep, device=device)
                cache.batch_select_indices(k)
                mask, n_real, live = mask[k], n_real[k], [live[b] for b in keep]
            # 4) when every live row waits on a block, run them all at once
            if all(rows[i].code is not None for i in live):
                _run_pending([rows[i] for i in live], sandbox, tokenizer, max_context, finish)
                if all(rows[i].finish is not None for i in live):
                    break
            # each row feeds what the cache lacks: its last sampled token, or the fence and
            # the output block after a run; a row still waiting on its block feeds nothing
            feeds = [[] if rows[i].code is not None or rows[i].finish is not None
                     else rows[i].ids[rows[i].n_fed:] for i in live]
            for f, i in zip(feeds, live):
                rows[i].n_fed += len(f)
            need = [len(f) > 0 for f in feeds]
            # 5) one forward over the ragged chunk (a token, or an output block)
            logits, mask, n_real = _forward_chunk(model, cache, mask, feeds, n_real, pad_id)
    if bar is not None:
        bar.close()
    return [_to_sample(r, tokenizer, stops, seed) for r in rows]


def _accept_token(r, t, lp, stops, piece, max_context, max_new_tokens, max_tool_calls, tokenizer, finish):
    """Append a sampled token to a row and apply the stop rules, in order: EOS, the
    closing fence of a python block (or a fake ```output), then the budgets."""
    r.ids.append(t)
    r.roles.append(ROLE_MODEL)
    r.logprobs.append(lp)
    r.n_model += 1
    if t in stops:
        return finish(r, "stop")
    hit = r.scanner.feed(piece(t))
    if hit is not None:
        kind, cut = hit
        _trim_to_fence(r, cut, tokenizer)
        if kind == "fake_output":  # the model wrote an output block itself: end the turn there
            return finish(r, "stop")
        if r.tool_calls >= max_tool_calls:
            return finish(r, "tool_budget")
        r.code = r.scanner.text[r.scanner.code_start:r.scanner.code_end]
        return
    if len(r.ids) >= max_context or (max_new_tokens and r.n_model >= max_new_tokens):
        finish(r, "length")


def _trim_to_fence(r, cut, tokenizer):
    """Text after a fence inside the fence's own token (e.g. '```\\nThe') is not kept:
    that token is replaced by the environment's tokens for the text up to the fence."""
    sc = r.scanner
    tail = sc.text[cut:]
    if not tail.strip():
        return
    last = tokenizer.decode([r.ids[-1]])
    kept = sc.text[len(sc.text) - len(last):cut] if len(last) <= len(sc.text) else sc.text[:cut]
    for lst in (r.ids, r.roles, r.logprobs):
        lst.pop()
    r.n_model -= 1
    new = tokenizer.encode(kept, add_special_tokens=False) if kept else []
    r.ids += new
    r.roles += [ROLE_OUTPUT] * len(new)
    r.logprobs += [float("nan")] * len(new)
    sc.text = sc.text[:cut]


def _run_pending(batch_rows, sandbox, tokenizer, max_context, finish):
    """Run every waiting block at once and append each row's ```output block."""
    results = sandbox.run_many([r.code for r in batch_rows])
    for r, res in zip(batch_rows, results):
        r.tool_calls += 1
        r.blocks.append({"code": r.code, "output": res.output, "status": res.status})
        r.code = None
        if r.plan_text is None:
            r.plan_text = r.scanner.text[:r.scanner.text.find("```")]
        lead = "" if r.scanner.text.endswith("\n") else "\n"
        chunk = tokenizer.encode(f"{lead}```output\n{res.output.rstrip(chr(10))}\n```\n",
                                 add_special_tokens=False)
        if len(r.ids) + len(chunk) >= max_context:
            finish(r, "length")
            continue
        r.ids += chunk
        r.roles += [ROLE_OUTPUT] * len(chunk)
        r.logprobs += [float("nan")] * len(chunk)
        r.scanner = _FenceScanner()
        r.seg_start = len(r.ids)


def _to_sample(r, tokenizer, stops, seed) -> "Sample":
    comp = r.ids[r.prompt_len:]
    if comp and comp[-1] in stops and r.finish == "stop":
        comp = comp[:-1]
    final = [t for t, role in zip(r.ids[r.seg_start:], r.roles[r.seg_start:])
             if role == ROLE_MODEL and t not in stops]
    final_text = tokenizer.decode(final)
    text = tokenizer.decode(comp)
    plan = r.plan_text
    if plan is None:  # no block ran: the plan is the text before the first fence, if any
        i = text.find("```")
        plan = text if i < 0 else text[:i]
    return Sample(prompt_ids=r.ids[:r.prompt_len], ids=r.ids, roles=r.roles, logprobs=r.logprobs,
                  text=text, blocks=r.blocks, finish_reason=r.finish,
                  pred=extract_answer(final_text), seed=seed, plan_text=plan, final_text=final_text)


# -----------------------------------------------------------------------------
# Files: problems in, samples out (shared by every stage)

_PROBLEM_KEYS, _ANSWER_KEYS = ("problem", "question"), ("answer", "ground_truth", "solution")


def read_problems(path: str) -> list:
    """Read a problems JSONL: one {"id", "problem", "answer"} object per line; extra fields
    are kept. `question` and `ground_truth` / `solution` are accepted as the problem and
    answer fields. A missing id becomes "<file stem>-<line>". Blank lines are skipped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object, or has no problem or no answer;
            the message names the file, the line number and the field.
    """
    out = []
    stem = os.path.splitext(os.path.basename(path))[0]
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for field, keys in (("problem", _PROBLEM_KEYS), ("answer", _ANSWER_KEYS)):
                key = next((k for k in keys if row.get(k) not in (None, "")), None)
                if key is None:
                    raise ValueError(f"{path}:{lineno}: missing field '{field}' (or one of {keys[1:]})")
                row[field] = str(row[key])
            row["id"] = str(row.get("id", f"{stem}-{lineno}"))
            out.append(row)
    return out


def append_jsonl(path: str, rows) -> None:
    """Append whole lines and fsync, so a kill never leaves a half-written line behind
    (each row is written with one write call of its full line)."""
    if not rows:
        return
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_tolerant(path: str) -> list:
    """Read a JSONL this project appended to, ignoring a torn last line (a run killed in
    the middle of a write); any other bad line raises ValueError naming file and line."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if lineno == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON") from None
    return rows


def write_json_atomic(path: str, obj) -> None:
    """Write JSON (or a str) to path via a temp file in the same folder and a rename."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp_")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2, ensure_ascii=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sample_record(problem: dict, sample, tokenizer) -> dict:
    """The trajectory / sample JSONL row of the design card: the problem's fields, then
    completion, pred, correct, finish_reason, n_code_blocks, n_exec_errors,
    completion_tokens (model + output tokens), model_tokens, plan_tokens (plan text
    re-encoded with this tokenizer), blocks and the rollout seed."""
    row = dict(problem)
    comp_tokens = len(sample.ids) - len(sample.prompt_ids)
    row.update(completion=sample.text, pred=sample.pred, correct=grade(sample.pred, problem["answer"]),
               finish_reason=sample.finish_reason, n_code_blocks=len(sample.blocks),
               n_exec_errors=sum(b["status"] != "ok" for b in sample.blocks),
               completion_tokens=comp_tokens, model_tokens=sample.n_model_tokens,
               plan_tokens=len(tokenizer.encode(sample.plan_text, add_special_tokens=False)),
               blocks=sample.blocks, seed=sample.seed)
    return row


# -----------------------------------------------------------------------------
# Answers and grading

def extract_answer(text):  # TEMP until grading lands
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    j = text.find("}", i)
    return text[i + 7:j] if j > 0 else None


def main():
    p = argparse.ArgumentParser(description="Run a Python file through the THINC sandbox and "
                                "print what the model would see.")
    p.add_argument("file", help="Python file, run as one block")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds, wall clock")
    p.add_argument("--memory-mb", type=int, default=4096, help="address-space limit, MiB")
    p.add_argument("--max-output-chars", type=int, default=2000, help="output cap, characters")
    args = p.parse_args()
    with open(args.file) as f:
        code = f.read()
    with Sandbox(workers=1, timeout=args.timeout, memory_mb=args.memory_mb,
                 max_output_chars=args.max_output_chars) as sb:
        r = sb.run(code)
    print(r.output)
    print(f"[status: {r.status}, {r.seconds * 1000:.1f} ms]", file=sys.stderr)


if __name__ == "__main__":
    main()
