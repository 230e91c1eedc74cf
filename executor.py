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
