"""The sandbox (executor.Sandbox): the S faults of tests/faults.md, plain correctness, a
block as a fresh Python program (S10), containment of files, threads, detached processes
and temp space (S12-S16), stateful mode (S17), the command line (B6), and
1,000 blocks in parallel. Every test has a hard outer timeout so a broken sandbox cannot
hang CI.

Processes are checked through /proc: every process of a block descends from the template
(as root through the `cat` init of the block's PID namespace), so "nothing left" means the
template has no descendants, alive or zombie. Without containment (not root), temporary
directories are made in a private tempfile.tempdir set for this module, so other test runs
on the machine cannot disturb the count.
"""
import glob
import json
import importlib.util
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

import executor as ex
from executor import ExecResult, Sandbox, SandboxError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIMEOUT = 3.0  # the shared sandbox's timeout, seconds
SANDBOX_FRAMES = ("executor", "_template_main", "<thinc-sandbox>", "NoStdin")
CUT = re.compile(r"\.\.\. \[(\d+) (bytes|characters) of output cut\] \.\.\.")


# -----------------------------------------------------------------------------
# /proc helpers

def _proc_table():
    """pid -> (state, ppid, pgid) for every process now."""
    table = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rfind(")") + 2:].split()
        table[int(d)] = (rest[0], int(rest[1]), int(rest[2]))
    return table


def _descendants(root):
    """[(pid, state, pgid)] of every descendant of root, zombies included."""
    table = _proc_table()
    kids = {}
    for pid, (state, ppid, pgid) in table.items():
        kids.setdefault(ppid, []).append((pid, state, pgid))
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c[0])
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    return s[s.rfind(")") + 2:].split()[0]


def _pids_with_cmdline(marker):
    """Live (non-zombie) processes whose command line contains marker."""
    m = marker.encode()
    return [p for p, (state, _, _) in _proc_table().items()
            if state != "Z" and m in _cmdline(p)]


def _is_init(pid):
    """Whether pid is pid 1 of a PID namespace of its own (a block's init, forked from the template)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return re.search(r"NSpid:[\t\d]*\t1\n", f.read()) is not None
    except OSError:
        return False


def _alive_block_processes(pids):
    """Those of pids that are still a live process forked from a sandbox template (not an init)."""
    return [p for p in pids if _state(p) not in (None, "Z") and b"_template_main" in _cmdline(p) and not _is_init(p)]


def _vm_kb(key):
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1))


def _reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def _assert_clean(sb, grace=10.0):
    """Nothing a block started is left: the template has no descendants at all. A block
    that reported itself done and closed its output is returned before its process has
    finished exiting, so a descendant may take a few ms to go; one still there after
    `grace` seconds is a leak (a bound that returns as soon as the template is clean, long
    enough for a loaded machine: tests/faults.md T2)."""
    end = time.monotonic() + grace
    while (left := _descendants(sb._proc.pid)) and time.monotonic() < end:
        time.sleep(0.01)
    assert left == [], f"processes left under the template: {left}"


def _frames(output):
    return re.findall(r'File "([^"]*)"', output)


def _no_sandbox_frames(output):
    for name in SANDBOX_FRAMES:
        assert name not in output, f"sandbox frame {name!r} shown to the model:\n{output}"


def _marker():
    return f"300.{random.randrange(10**6, 10**7)}"


# -----------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="module")
def tmpdir_for_blocks(tmp_path_factory):
    """Blocks' working directories go to a private temp dir, checked at the end."""
    d = str(tmp_path_factory.mktemp("sandbox_tmp"))
    old = tempfile.tempdir
    tempfile.tempdir = d
    yield d
    tempfile.tempdir = old
    assert glob.glob(os.path.join(d, "thinc_block_*")) == [], "leftover block directories"


@pytest.fixture(scope="module")
def sb(tmpdir_for_blocks):
    """The shared sandbox: 2 workers, 3 s timeout. Started with a secret and a DISPLAY in
    the caller's environment, which the blocks must not see."""
    saved = {k: os.environ.get(k) for k in ("THINC_TEST_SECRET", "DISPLAY")}
    os.environ["THINC_TEST_SECRET"] = "hunter2"
    os.environ["DISPLAY"] = ":0"
    try:
        box = Sandbox(workers=2, timeout=TIMEOUT)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield box
    pid = box._proc.pid
    box.close()
    assert _state(pid) is None, "template still running after close()"


@pytest.fixture(scope="module")
def sb_quick(tmpdir_for_blocks):
    """For blocks meant to time out: 2 workers, 1 s timeout."""
    box = Sandbox(workers=2, timeout=1.0)
    yield box
    box.close()


# -----------------------------------------------------------------------------
# Plain correctness

@pytest.mark.timeout(30)
def test_print(sb):
    r = sb.run("print('hello')")
    assert isinstance(r, ExecResult)
    assert (r.output, r.status, r.ok) == ("hello\n", "ok", True)
    assert 0 < r.seconds < TIMEOUT


@pytest.mark.timeout(30)
def test_exception_shows_user_lines_only(sb):
    code = "def f(x):\n    return 1 / x\n\ny = 3\nf(0)\nprint('not reached')\n"
    r = sb.run(code)
    assert r.status == "error" and not r.ok
    assert "ZeroDivisionError: division by zero" in r.output
    assert 'File "<code>", line 5, in <module>' in r.output
    assert 'File "<code>", line 2, in f' in r.output
    assert "return 1 / x" in r.output  # the user's source line is shown
    assert set(_frames(r.output)) == {"<code>"}
    assert "not reached" not in r.output
    _no_sandbox_frames(r.output)


@pytest.mark.timeout(30)
def test_exception_after_output_keeps_the_output(sb):
    r = sb.run("print('partial')\nraise ValueError('bad value')")
    assert r.status == "error"
    assert r.output.startswith("partial\n")
    assert r.output.rstrip().endswith("ValueError: bad value")
    assert 'File "<code>", line 2' in r.output
    _no_sandbox_frames(r.output)


@pytest.mark.timeout(30)
def test_exception_inside_a_library_starts_at_the_users_line(sb):
    r = sb.run("import numpy as np\n\nnp.linalg.inv(np.zeros((2, 2)))\n")
    assert r.status == "error"
    assert "LinAlgError: Singular matrix" in r.output
    frames = _frames(r.output)
    assert len(frames) > 1 and frames[0] == "<code>"  # then numpy's own frames
    assert 'File "<code>", line 3' in r.output
    _no_sandbox_frames(r.output)


@pytest.mark.timeout(30)
def test_syntax_error_gives_the_users_line(sb):
    r = sb.run("x = 1\nif x\n    print(x)\n")
    assert r.status == "error"
    assert "SyntaxError" in r.output and "line 2" in r.output
    _no_sandbox_frames(r.output)


@pytest.mark.timeout(30)
def test_numpy_scipy_sympy_usable(sb):
    r = sb.run_many([
        "import numpy as np\nprint(int(np.arange(10).sum()), np.linalg.det(np.eye(3)))",
        "from scipy.integrate import quad\nprint(round(quad(lambda x: x**2, 0, 3)[0], 6))",
        "import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**2 - 1))\n"
        "print(sp.factorint(2**64 + 1))",
        "from scipy.special import comb\nprint(int(comb(10, 3, exact=True)))",
    ])
    assert [x.status for x in r] == ["ok"] * 4, [x.output for x in r]
    assert r[0].output == "45 1.0\n"
    assert r[1].output == "9.0\n"
    assert r[2].output == "(x - 1)*(x + 1)\n{274177: 1, 67280421310721: 1}\n"
    assert r[3].output == "120\n"


@pytest.mark.timeout(30)
def test_unicode_output(sb):
    text = "π ≈ 3.14159 — ✓ 你好 🙂 ∑_{k=1}^{n} k²"
    r = sb.run(f"print({text!r})")
    assert r.ok and r.output == text + "\n"


@pytest.mark.timeout(30)
def test_large_integers(sb):
    r = sb.run("n = 2**10000\nprint(len(str(n)))\nprint(n % 10**9)")
    assert r.ok and r.output == f"3011\n{2**10000 % 10**9}\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", ["", "\n\n", "# just a comment\n"])
def test_empty_block(sb, code):
    r = sb.run(code)
    assert (r.output, r.status) == ("", "ok")


@pytest.mark.timeout(30)
def test_block_only_defining_functions(sb):
    r = sb.run("def f(x):\n    return x + 1\n\nclass A:\n    def g(self):\n        return 2\n")
    assert (r.output, r.status) == ("", "ok")


@pytest.mark.timeout(30)
def test_main_guard_runs(sb):
    r = sb.run("def main():\n    print('in main')\n\nif __name__ == '__main__':\n    main()\n")
    assert (r.output, r.status) == ("in main\n", "ok")


@pytest.mark.timeout(30)
def test_stdout_stderr_interleaving_kept(sb):
    r = sb.run("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')\n"
               "sys.stderr.write('d\\n')\nsys.stdout.write('e\\n')\n")
    assert r.ok and r.output == "a\nb\nc\nd\ne\n"


@pytest.mark.timeout(30)
def test_each_block_runs_alone(sb):
    r1 = sb.run("x = 41\nimport sympy\nsympy.THINC_MARK = 1\nprint(x)")
    assert r1.output == "41\n"
    r2 = sb.run("print(x + 1)")
    assert r2.status == "error" and "NameError" in r2.output and "'x'" in r2.output
    r3 = sb.run("import sympy\nprint(hasattr(sympy, 'THINC_MARK'))")
    assert r3.output == "False\n"


@pytest.mark.timeout(30)
def test_environment_is_scrubbed(sb):
    r = sb.run("import os\nprint(os.environ.get('THINC_TEST_SECRET'), os.environ.get('DISPLAY'),"
               " os.environ.get('MPLBACKEND'))")
    assert r.ok and r.output == "None None Agg\n"


@pytest.mark.timeout(30)
def test_file_size_limit(sb):
    r = sb.run("with open('big.bin', 'wb') as f:\n    f.write(b'0' * (65 * 2**20))\nprint('wrote')")
    assert r.status == "error" and "wrote" not in r.output
    assert "File too large" in r.output or "OSError" in r.output
    _assert_clean(sb)


@pytest.mark.timeout(30)
def test_run_many_empty(sb):
    assert sb.run_many([]) == []


# -----------------------------------------------------------------------------
# S1: infinite loop, then the next block

@pytest.mark.timeout(40)
def test_s1_timeout_then_next_block(tmpdir_for_blocks):
    with Sandbox(workers=2, timeout=5) as sb5:
        t0 = time.monotonic()
        r = sb5.run("while True: pass")
        dt = time.monotonic() - t0
        assert r.status == "timeout" and not r.ok
        assert 4.9 <= dt < 15, dt  # (the upper bound only tells a stop from none, on a loaded machine)
        assert "TimeoutError" in r.output and "5 s" in r.output, r.output
        assert 'File "<code>", line 1' in r.output  # where it was stuck
        _no_sandbox_frames(r.output)
        r2 = sb5.run("print(1+1)")
        assert (r2.output, r2.status) == ("2\n", "ok")
        rs = sb5.run_many([f"print({i} * {i})" for i in range(8)])  # the pool is healthy
        assert [x.output for x in rs] == [f"{i * i}\n" for i in range(8)]
        _assert_clean(sb5)


@pytest.mark.timeout(60)
def test_s1_blocks_get_the_interrupt_when_the_caller_ignores_sigint(tmpdir_for_blocks):
    """A trainer started as a background job or under nohup has SIGINT ignored, and its blocks
    inherited that: a timed-out block got no KeyboardInterrupt (no traceback, SIGKILL after the
    grace) and a stateful replay ran past a thread's os._exit. A block's SIGINT is Python's own."""
    caller = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Sandbox(workers=1, timeout=1.0) as box:
            code = "import signal\nprint(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
            assert box.run(code).output == "True\n"
            r = box.run("import time\ntime.sleep(100)")
            assert r.status == "timeout" and 'File "<code>", line 2' in r.output, r.output
            rs = _trajectory(box, ["import os, threading\nx = 1\nt = threading.Thread(target=os._exit, args=(0,))\n"
                                   "t.start()\nt.join()\nx = 2", "print(x)"])
            assert [r.output for r in rs] == ["[os._exit(0) called: the program stopped here]", "1\n"]
    finally:
        signal.signal(signal.SIGINT, caller)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", [
    "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",
    "import time\nwhile True:\n    try:\n        time.sleep(10)\n    except KeyboardInterrupt:\n"
    "        print('ignored', flush=True)",
], ids=["sigint-ignored", "keyboardinterrupt-swallowed"])
def test_s1_stubborn_loop_still_stopped(sb_quick, code):
    t0 = time.monotonic()
    r = sb_quick.run(code)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < 1.0 + 10  # (stopped, on a loaded machine too; never stopped: the 30 s mark)
    assert "TimeoutError" in r.output
    assert sb_quick.run("print(1+1)").output == "2\n"
    _assert_clean(sb_quick)


# -----------------------------------------------------------------------------
# S2: background processes, forks, fork bombs

@pytest.mark.timeout(30)
@pytest.mark.parametrize("template,status", [
    ("import subprocess\nsubprocess.Popen(['sleep', '{m}'])\nprint('started')", "ok"),
    ("import subprocess\np = subprocess.Popen(['sleep', '{m}'])\nprint('started', flush=True)\n"
     "p.wait()", "timeout"),
    ("import os\nos.system('sleep {m} &')\nprint('started')", "ok"),
], ids=["popen-return", "popen-wait", "shell-background"])
def test_s2_background_subprocess_killed(sb_quick, template, status):
    m = _marker()
    r = sb_quick.run(template.format(m=m))
    assert r.status == status, r.output
    assert "started" in r.output
    assert _pids_with_cmdline(m) == []
    _assert_clean(sb_quick)


@pytest.mark.timeout(30)
def test_s2_background_subprocess_in_new_session_killed(sb):
    """A child that leaves the block's session (start_new_session=True) is still a thing
    the block started: it is reparented to the template (subreaper) when the block ends
    and must not outlive the block."""
    m = _marker()
    try:
        r = sb.run(f"import subprocess\nsubprocess.Popen(['sleep', '{m}'], start_new_session=True)\n"
                   "print('started')")
        assert r.ok and "started" in r.output
        assert _pids_with_cmdline(m) == []
        _assert_clean(sb)
    finally:  # do not leave it running for the rest of the suite
        for p in _pids_with_cmdline(m):
            os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_s2_three_forks_then_sleep(sb_quick):
    # (one os.write a line: unbuffered print() writes its pieces one by one, as `python -u`)
    r = sb_quick.run("import os, time\nfor _ in range(3):\n    os.fork()\n"
                     "os.write(1, f'pid {os.getpid()}\\n'.encode())\ntime.sleep(300)\n")
    assert r.status == "timeout"
    pids = [int(p) for p in re.findall(r"pid (\d+)", r.output)]
    assert len(set(pids)) == 8, r.output
    if not sb_quick.contained:  # (contained, these are pids of the block's own namespace)
        assert _alive_block_processes(pids) == []
    _assert_clean(sb_quick)
    assert sb_quick.run("print(1+1)").output == "2\n"


@pytest.mark.timeout(30)
def test_s2_forked_children_outliving_the_block_are_killed(sb):
    r = sb.run("import os, time\np0 = os.getpid()\nfor _ in range(3):\n    os.fork()\n"
               "os.write(1, f'pid {os.getpid()}\\n'.encode())\nif os.getpid() != p0:\n    time.sleep(300)\n")
    assert r.ok, r.output
    pids = [int(p) for p in re.findall(r"pid (\d+)", r.output)]
    assert pids
    if not sb.contained:
        assert _alive_block_processes(pids) == []
    _assert_clean(sb)


@pytest.mark.timeout(40)
def test_s2_fork_bomb_ends_and_sandbox_survives(sb):
    # (A shell bomb, os.system('b(){ b|b& }; b'), is left out: it reaches thousands of
    # processes within a second on a shared CI machine, whatever the sandbox does.)
    m = "_template_main"  # every process of a Python fork bomb has the template's cmdline
    t0 = time.monotonic()
    try:
        r = sb.run("import os\nwhile True:\n    os.fork()")
        dt = time.monotonic() - t0
        # It may run to the timeout, but it must end about then, with a status, and leave
        # nothing behind. (As root the kernel ignores RLIMIT_NPROC, so the rlimit alone
        # does not stop it.)
        assert r.status in ("timeout", "error", "ok", "killed", "memory")
        assert dt <= TIMEOUT + 10, f"fork bomb took {dt:.1f} s with a {TIMEOUT:g} s timeout"
        _assert_clean(sb)
        rs = sb.run_many(["print(1+1)", "import subprocess\nprint(subprocess.run(['echo', 'hi'], "
                          "capture_output=True, text=True).stdout.strip())"])
        assert [x.output for x in rs] == ["2\n", "hi\n"]
    finally:  # whatever happened, do not leave the bomb loose on the machine
        end = time.monotonic() + 10
        while time.monotonic() < end:
            pids = [p for p, _, _ in _descendants(sb._proc.pid)]
            if not pids:
                break
            for p in pids:
                if m.encode() in _cmdline(p):
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.05)


# -----------------------------------------------------------------------------
# S3: memory

@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", ["bytearray(8 * 1024**3)", "[0] * 10**10", '"x" * 10**11'])
def test_s3_huge_allocation_fails_fast(sb, code):
    rss0 = _vm_kb("VmRSS")
    r = sb.run(code)
    assert r.status == "memory", r.output
    assert r.seconds < 3.0
    assert "MemoryError" in r.output or "memory" in r.output.lower()
    assert 'File "<code>", line 1' in r.output
    _no_sandbox_frames(r.output)
    assert _vm_kb("VmRSS") - rss0 < 20 * 1024  # the caller's memory is unaffected
    assert sb.run("print(1+1)").output == "2\n"


@pytest.mark.timeout(30)
def test_s3_growing_allocation_hits_the_memory_flag(tmpdir_for_blocks):
    with Sandbox(workers=1, timeout=10, memory_mb=512) as small:
        rss0 = _vm_kb("VmRSS")
        r = small.run("x = []\nwhile True:\n    x.append(bytearray(10**7))\n")
        assert r.status == "memory", r.output
        assert r.seconds < 3.0
        assert _vm_kb("VmRSS") - rss0 < 20 * 1024
        assert small.run("import numpy\nprint('fine')").output == "fine\n"


# -----------------------------------------------------------------------------
# S4: huge output

@pytest.fixture(scope="module")
def sb_long(tmpdir_for_blocks):
    box = Sandbox(workers=1, timeout=30)
    yield box
    box.close()


def _cut_amount(output):
    m = CUT.search(output)
    assert m, f"no cut marker in: {output[:200]!r} ... {output[-200:]!r}"
    return int(m.group(1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code,head,tail,total", [
    ('print("x" * 10**8)', "x" * 900, "x" * 900 + "\n", 10**8 + 1),
    # (in ten writes: output is unbuffered as in `python -u`, 10**7 prints would be 2 * 10**7 syscalls)
    ("import sys\nfor k in range(10):\n"
     "    sys.stdout.write(''.join(f'{i}\\n' for i in range(k * 10**6, (k + 1) * 10**6)))",
     "0\n1\n2\n3\n", "9999998\n9999999\n",
     sum(len(str(i)) + 1 for i in range(10**7))),
    ('print("A" * 10**6); print("FINAL=42")', "A" * 900, "A" * 900 + "\nFINAL=42\n", 10**6 + 10),
], ids=["one-huge-line", "ten-million-lines", "final-after-big"])
def test_s4_huge_output_bounded_head_and_tail(sb_long, code, head, tail, total):
    _reset_peak_rss()
    hwm0, rss0 = _vm_kb("VmHWM"), _vm_kb("VmRSS")
    r = sb_long.run(code)
    assert _vm_kb("VmHWM") - hwm0 < 50 * 1024, "caller's peak memory grew while reading"
    assert _vm_kb("VmRSS") - rss0 < 50 * 1024
    assert r.ok, r.output[-500:]
    assert len(r.output) <= 2000 + 100
    assert r.output.startswith(head)
    assert r.output.endswith(tail)
    cut = _cut_amount(r.output)
    kept = len(r.output) - len(CUT.search(r.output).group(0)) - 2
    assert abs(cut + kept - total) <= 2, (cut, kept, total)  # the marker says how much was cut


@pytest.mark.timeout(30)
def test_s4_final_answer_visible_in_shared_sandbox(sb):
    r = sb.run('print("A" * 10**6); print("FINAL=42")')
    assert r.ok and "FINAL=42" in r.output and CUT.search(r.output)


@pytest.mark.timeout(30)
def test_cut_inside_multibyte_characters(sb):
    r = sb.run("print('é' * 10**5 + '✓' * 10**5)")
    assert r.ok and r.output.startswith("é" * 500) and r.output.endswith("✓" * 500 + "\n")
    assert CUT.search(r.output)


# -----------------------------------------------------------------------------
# S5: stdin

@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", ["int(input())", "input('x? ')"])
def test_s5_input_gives_eoferror_at_once_without_sandbox_frames(sb, code):
    r = sb.run(code)
    assert r.status == "error" and r.output.endswith("EOFError: EOF when reading a line\n"), r.output
    assert r.seconds < 1.0, "waited for input"
    assert set(_frames(r.output)) == {"<code>"}, r.output
    _no_sandbox_frames(r.output)


@pytest.mark.timeout(30)
def test_s5_stdin_is_an_empty_stdin_as_in_python(sb):
    code = ("import sys\nprint(repr(sys.stdin.read()), repr(sys.stdin.readline()), list(sys.stdin))\n"
            "print(sys.stdin.buffer.read(), sys.stdin.fileno(), sys.stdin.encoding, sys.stdin is sys.__stdin__)\n")
    r = sb.run(code)
    assert (r.status, r.output) == ("ok", "'' '' []\nb'' 0 utf-8 True\n")
    assert r.output == _python_u(code).stdout


# -----------------------------------------------------------------------------
# S6: matplotlib

@pytest.mark.timeout(30)
def test_s6_matplotlib_show_does_not_hang(sb):
    r = sb.run('import matplotlib.pyplot as plt; plt.plot([1,2]); plt.show(); print("done")')
    assert r.seconds < TIMEOUT and r.status != "timeout"
    if importlib.util.find_spec("matplotlib") is not None:
        assert (r.status, r.output) == ("ok", "done\n"), r.output
    else:
        assert r.status == "error"
        assert "ModuleNotFoundError" in r.output or "ImportError" in r.output
        assert "done\n" not in r.output.splitlines(True)  # (the source line shows print("done"))
    # what makes show() return where matplotlib is installed (CI has none since --plot went): its
    # backend is the non-interactive Agg, set in the block's environment
    assert sb.run('import os; print(os.environ.get("MPLBACKEND"))').output == "Agg\n"


# -----------------------------------------------------------------------------
# S7: the sandbox itself fails

@pytest.mark.timeout(30)
@pytest.mark.parametrize("python", ["/nonexistent/python", "/bin/false"])
def test_s7_sandbox_cannot_start_raises(tmpdir_for_blocks, python):
    t0 = time.monotonic()
    with pytest.raises(SandboxError):
        Sandbox(workers=1, timeout=3, python=python)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_s7_dead_template_is_restarted(tmpdir_for_blocks):
    with Sandbox(workers=2, timeout=3) as box:
        assert box.run("print(1)").output == "1\n"
        for _ in range(2):
            old = box._proc.pid
            os.killpg(old, signal.SIGKILL)
            r = box.run("print(1+1)")
            assert (r.output, r.status) == ("2\n", "ok")
            assert box._proc.pid != old
            rs = box.run_many([f"print({i})" for i in range(6)])
            assert [x.output for x in rs] == [f"{i}\n" for i in range(6)]
        _assert_clean(box)


@pytest.mark.timeout(60)
def test_s7_template_killed_mid_block_leaves_no_block_running(tmpdir_for_blocks):
    blocks = []
    with Sandbox(workers=1, timeout=5) as box:  # (5 s: the block is seen running on a loaded machine too)
        out = {}

        def go():
            try:
                out["r"] = box.run("import time\nprint('go', flush=True)\ntime.sleep(30)")
            except SandboxError as e:
                out["e"] = e

        t = threading.Thread(target=go, daemon=True)
        t.start()
        try:
            deadline = time.monotonic() + 10
            while not blocks and time.monotonic() < deadline:
                time.sleep(0.05)
                blocks = [p for p, s, _ in _descendants(box._proc.pid) if s != "Z"]
            assert blocks, "the block never started"
            os.killpg(box._proc.pid, signal.SIGKILL)
            t.join(20)
            assert not t.is_alive()
            assert "r" in out or "e" in out  # a result (the block was re-run) or a loud error
            deadline = time.monotonic() + 10  # (a killed process may take a moment to go; no fixed sleep)
            while _alive_block_processes(blocks) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _alive_block_processes(blocks) == [], "the block outlived its template"
            assert box.run("print(1+1)").output == "2\n"
        finally:
            for p in _alive_block_processes(blocks):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_s7_template_cannot_restart_raises(tmpdir_for_blocks):
    box = Sandbox(workers=1, timeout=3)
    try:
        assert box.run("print(1)").output == "1\n"
        box.python = "/nonexistent/python"  # the restart will fail
        os.killpg(box._proc.pid, signal.SIGKILL)
        with pytest.raises(SandboxError):
            box.run("print(1+1)")
        with pytest.raises(SandboxError):
            box.run_many(["print(1)", "print(2)"])
    finally:
        box.close()


@pytest.mark.timeout(30)
def test_close_leaves_nothing_running_even_mid_block(tmpdir_for_blocks):
    box = Sandbox(workers=2, timeout=5)
    template = box._proc.pid
    out = []

    def go():
        try:
            out.append(box.run("import time\ntime.sleep(4)"))
        except SandboxError as e:
            out.append(e)

    threads = [threading.Thread(target=go, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    blocks = []
    try:
        deadline = time.monotonic() + 10
        while len(blocks) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            blocks = _alive_block_processes([p for p, _, _ in _descendants(template)])
        assert len(blocks) == 2
        box.close()
        assert _state(template) is None
        # the template's death kills its blocks (SIGKILL); a killed process may take a moment
        # to leave /proc on a loaded machine: a bound on a leak, not a wait (tests/faults.md T2)
        end = time.monotonic() + 10
        while _alive_block_processes(blocks) and time.monotonic() < end:
            time.sleep(0.01)
        assert _alive_block_processes(blocks) == [], "close() left blocks running"
        for t in threads:
            t.join(15)
        assert box._proc is None, "close() was undone: a template runs again"
        assert _alive_block_processes(blocks) == []
        with pytest.raises(SandboxError):
            box.run("print(1)")
    finally:
        box.close()
        for p in _alive_block_processes(blocks):
            os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_context_manager_leaves_no_process(tmpdir_for_blocks):
    with Sandbox(workers=2, timeout=3) as box:
        pid = box._proc.pid
        box.run_many(["print(1)", "import time; time.sleep(0.2)"])
    assert _state(pid) is None
    with pytest.raises(SandboxError):
        box.run("print(1)")


# -----------------------------------------------------------------------------
# S8: fresh directories

@pytest.mark.timeout(120)
def test_s8_each_run_in_a_fresh_directory(tmpdir_for_blocks):
    caller_cwd = os.getcwd()
    kinds = ["timeout" if i % 10 == 3 else "error" if i % 10 in (1, 6) else "ok"
             for i in range(200)]
    tails = {"ok": "", "error": "raise RuntimeError('boom {i}')\n",
             "timeout": "while True:\n    pass\n"}
    codes = [("import os\nprint('before', sorted(os.listdir('.')))\n"
              "with open('f.txt', 'w') as f:\n    f.write('{i}')\n"
              "print('after', sorted(os.listdir('.')), open('f.txt').read())\n"
              "print('cwd', os.getcwd(), flush=True)\n" + tails[k]).replace("{i}", str(i))
             for i, k in enumerate(kinds)]
    with Sandbox(workers=2, timeout=1.0) as fast:  # (an ok block must end within it on a loaded machine)
        results = fast.run_many(codes)
        _assert_clean(fast)
    cwds = []
    for i, (k, r) in enumerate(zip(kinds, results)):
        assert r.status == k, (i, r.output)
        assert f"before []\nafter ['f.txt'] {i}\n" in r.output, (i, r.output)
        cwd = re.search(r"cwd (\S+)", r.output).group(1)
        cwds.append(cwd)
        if fast.contained:  # in its own tmpfs at /tmp, gone with its mount namespace
            assert cwd == "/tmp/thinc_block"
            continue
        assert os.path.dirname(os.path.dirname(cwd)) == tmpdir_for_blocks  # (the block's file beside it)
        assert not os.path.exists(os.path.dirname(cwd)), "a block's directory was left behind"
        if k == "error":
            assert f"RuntimeError: boom {i}" in r.output
        if k == "timeout":
            assert "TimeoutError" in r.output
    assert len(set(cwds)) == (1 if fast.contained else 200)
    assert os.getcwd() == caller_cwd
    assert glob.glob(os.path.join(tmpdir_for_blocks, "thinc_block_*")) == []


# -----------------------------------------------------------------------------
# S9: ways out

@pytest.mark.timeout(30)
@pytest.mark.parametrize("code,status,says", [
    ("exit()", "ok", "exit(0)"),
    ("import sys\nsys.exit(0)", "ok", "exit(0)"),
    ("import sys\nsys.exit(3)", "error", "exit(3)"),
    ("import os\nos._exit(0)", "ok", "_exit(0)"),
    ("import os\nos._exit(5)", "error", "_exit(5)"),
    ("raise SystemExit", "ok", "exit(0)"),
    ("import ctypes\nctypes.string_at(0)", "killed", "SIGSEGV"),
    ("import os\nos.abort()", "killed", "SIGABRT"),
    ("import signal, time\ndef h(*a):\n    raise TimeoutError('alarm went off')\n"
     "signal.signal(signal.SIGALRM, h)\nsignal.alarm(1)\nwhile True:\n    pass\n",
     "error", "TimeoutError: alarm went off"),
    ("import signal\nfired = []\nsignal.signal(signal.SIGALRM, lambda *a: fired.append(1))\n"
     "signal.alarm(1)\nwhile not fired:\n    pass\nprint('after alarm')\n", "ok", "after alarm"),
    ("import signal, time\nsignal.alarm(1)\ntime.sleep(10)\n", "killed", "SIGALRM"),
], ids=["exit", "sys.exit0", "sys.exit3", "os._exit0", "os._exit5", "SystemExit", "segfault",
        "abort", "alarm-raises", "alarm-handler", "alarm-default"])
def test_s9_ways_out(sb, code, status, says):
    # What was printed before is kept: flushed by every Python way out; a process killed by
    # a signal loses its unflushed buffer (as in any Python), so there it is flushed by hand.
    flush = status == "killed"
    r = sb.run(f"print('hi', flush={flush})\n" + code)
    assert r.status == status, r.output
    assert r.output.startswith("hi\n"), r.output
    assert says in r.output, r.output
    assert r.seconds < TIMEOUT
    _no_sandbox_frames(r.output)
    assert sb.run("print(1+1)").output == "2\n"  # the caller and the pool survive
    _assert_clean(sb)


# -----------------------------------------------------------------------------
# 1,000 blocks in parallel

@pytest.mark.timeout(120)
def test_thousand_blocks_in_parallel(tmpdir_for_blocks):
    def kind(i):
        return "timeout" if i % 50 == 7 else "error" if i % 5 == 1 else "ok"

    codes = []
    for i in range(1000):
        k = kind(i)
        if k == "ok":
            codes.append(f"import sympy\nprint({i}, sympy.isprime({i}))" if i % 7 == 0
                         else f"print({i})")
        elif k == "error":
            codes.append(f"print({i})\nraise ValueError('bad {i}')")
        else:
            codes.append(f"print({i}, flush=True)\nwhile True:\n    pass")
    me = os.getpid()
    children0 = sorted(p for p, (_, ppid, _) in _proc_table().items() if ppid == me)
    with Sandbox(workers=2, timeout=1.0) as box:  # (an ok block must end within it on a loaded machine)
        children_with_template = sorted(p for p, (_, ppid, _) in _proc_table().items() if ppid == me)
        groups, done = set(), threading.Event()

        def sample():  # the process groups the blocks run in
            while not done.is_set():
                # (a block has the template's group for a moment, between fork and setsid)
                groups.update(pgid for _, _, pgid in _descendants(box._proc.pid)
                              if pgid != box._proc.pid)
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            results = box.run_many(codes)
        finally:
            done.set()
            sampler.join()
        left = _descendants(box._proc.pid)
        assert left == [], f"leaked processes: {left}"
        assert len(groups) > 10  # the sampler saw blocks running, each in its own group
        alive_groups = {pgid for _, _, pgid in _proc_table().values()} & groups
        assert alive_groups == set(), f"process groups of blocks still alive: {alive_groups}"
    assert len(children_with_template) == len(children0) + 1
    assert sorted(p for p, (_, ppid, _) in _proc_table().items() if ppid == me) == children0
    assert glob.glob(os.path.join(tmpdir_for_blocks, "thinc_block_*")) == []
    from sympy import isprime
    for i, r in enumerate(results):
        k = kind(i)
        assert r.status == k, (i, r.status, r.output)
        if k == "ok":
            want = f"{i} {isprime(i)}\n" if i % 7 == 0 else f"{i}\n"
            assert r.output == want, (i, r.output)
        else:
            assert r.output.startswith(f"{i}\n"), (i, r.output)
            assert (f"ValueError: bad {i}" if k == "error" else "TimeoutError") in r.output


@pytest.mark.timeout(30)
def test_oversized_block_is_an_error_result_not_a_sandbox_failure(sb):
    r = sb.run("x = 1\n" + "# " + "é" * 200_000 + "\nprint(x)")
    assert r.status == "error" and "limit" in r.output
    assert sb.run("print(3)").output == "3\n"


@pytest.mark.timeout(30)
def test_block_that_closes_its_stdout_is_reported_plainly(sb):
    r = sb.run("import sys\nsys.stdout.close()\nprint('x')")
    assert r.status == "error"
    assert "os._exit" not in r.output


# -----------------------------------------------------------------------------
# A block is a fresh Python program (tests/faults.md S10)

@pytest.mark.timeout(30)
def test_random_streams_differ_from_block_to_block(sb):
    code = ("import random, numpy as np, sympy\n"
            "print(random.random(), np.random.rand(), sympy.randprime(10**20, 10**21))")
    outs = [r.output for r in sb.run_many([code] * 6)]
    assert all(r.count(" ") == 2 for r in outs), outs
    for column in range(3):  # each stream on its own: 6 different draws
        assert len({o.split()[column] for o in outs}) == 6, outs
    seeded = sb.run_many(["import numpy as np\nnp.random.seed(7)\nprint(np.random.rand())"] * 2)
    assert seeded[0].output == seeded[1].output == f"{np.random.RandomState(7).rand()}\n"


@pytest.mark.timeout(30)
def test_block_is_main_for_pickle_and_multiprocessing(sb):
    r = sb.run("import multiprocessing as mp, pickle\n"
               "def square(x):\n    return x * x\n"
               "class Point:\n    def __init__(self, x):\n        self.x = x\n"
               "assert pickle.loads(pickle.dumps(Point(3))).x == 3\n"
               "assert pickle.loads(pickle.dumps(square))(4) == 16\n"
               "if __name__ == '__main__':\n"
               "    with mp.get_context('fork').Pool(2) as pool:\n"
               "        print(pool.map(square, range(6)))\n")
    assert (r.status, r.output) == ("ok", "[0, 1, 4, 9, 16, 25]\n"), r.output


@pytest.mark.timeout(30)
def test_output_before_a_swallowed_timeout_is_kept(sb_quick):
    r = sb_quick.run("print('before the loop')\nimport time\nwhile True:\n    try:\n"
                     "        time.sleep(10)\n    except KeyboardInterrupt:\n        pass\n")
    assert r.status == "timeout"
    assert r.output.startswith("before the loop\n") and "TimeoutError" in r.output, r.output


@pytest.mark.timeout(30)
def test_output_before_a_segfault_is_kept(sb):
    r = sb.run("print('before the crash')\nimport ctypes\nctypes.string_at(0)\n")
    assert r.status == "killed"
    assert r.output.startswith("before the crash\n") and "SIGSEGV" in r.output, r.output


@pytest.mark.timeout(30)
def test_child_process_output_interleaved_in_write_order(sb):
    r = sb.run("import os, subprocess, sys\nprint('a')\nsubprocess.run(['echo', 'b'])\nprint('c')\n"
               "os.system('echo d >&2')\nprint('e', file=sys.stderr)\n"
               "subprocess.run([sys.executable, '-c', 'print(6)'])\n")
    assert (r.status, r.output) == ("ok", "a\nb\nc\nd\ne\n6\n"), r.output


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code,status,output", [
    ("import sys\nsys.exit(False)", "ok", "[sys.exit(0) called: the program stopped here]"),
    ("import sys\nsys.exit(None)", "ok", "[sys.exit(0) called: the program stopped here]"),
    ("import sys\nsys.exit(1)", "error", "[sys.exit(1) called: the program stopped here]"),
    ("import sys\nsys.exit('no solution')", "error", "no solution\n[sys.exit(1) called: the program stopped here]"),
    ("import sys\nsys.exit(True)", "error", "[sys.exit(1) called: the program stopped here]"),
], ids=["False", "None", "1", "message", "True"])
def test_exit_codes_mean_what_python_means(sb, code, status, output):
    r = sb.run(code)
    assert (r.status, r.output) == (status, output)


@pytest.mark.timeout(30)
def test_signals_a_block_sends_itself_act_as_in_python(sb):
    r = sb.run("import os, signal\nprint('up')\nos.kill(os.getpid(), signal.SIGTERM)\nprint('not reached')")
    assert (r.status, r.output) == ("killed", "up\nProcess killed by signal SIGTERM (Terminated).")


# -----------------------------------------------------------------------------
# Containment of files as root (tests/faults.md S12)

@pytest.mark.timeout(30)
@pytest.mark.skipif(os.geteuid() != 0, reason="containment is for a root caller (CI runs as root)")
def test_root_block_cannot_delete_or_change_files_outside_its_directory(sb):
    assert sb.contained
    fd, in_tmp = tempfile.mkstemp(dir="/tmp", prefix="thinc_sentinel_")  # the system temp directory
    os.write(fd, b"keep")
    os.close(fd)
    run_dir = tempfile.mkdtemp(dir=ROOT, prefix=".thinc_run_")  # (not in the block's root either: S27)
    in_run = os.path.join(run_dir, "args.json")
    with open(in_run, "w") as f:
        f.write("keep")
    try:
        for target in (in_tmp, in_run):
            r = sb.run(f"import os, shutil, tempfile\np = {target!r}\n"
                       "shutil.rmtree(tempfile.gettempdir(), ignore_errors=True)\n"
                       "shutil.rmtree(os.path.dirname(p), ignore_errors=True)\n"
                       "for act in (lambda: os.remove(p), lambda: open(p, 'w').write('gone'),\n"
                       "            lambda: os.chmod(p, 0), lambda: os.rename(p, p + '.x')):\n"
                       "    try:\n        act()\n    except OSError as e:\n        print(e.strerror)\n")
            if target == in_run:  # (/tmp is the block's own tmpfs: there it sees no sentinel at all)
                assert r.output.splitlines() == ["No such file or directory"] * 4, r.output
            assert open(target).read() == "keep" and os.stat(target).st_mode & 0o777 != 0
        r = sb.run("import subprocess\nprint(subprocess.run(['mount', '-o', 'remount,rw', '/'],"
                   " capture_output=True).returncode != 0, open('/tmp/mine', 'w').write('ok'))")
        assert r.output == "True 2\n", r.output  # no remounting; its own /tmp is writable
    finally:
        os.remove(in_tmp)
        shutil.rmtree(run_dir)


# -----------------------------------------------------------------------------
# Threads, detached processes, temp space, CPU affinity (tests/faults.md S13-S16)

@pytest.mark.timeout(30)
@pytest.mark.parametrize("code,output", [
    ("import threading, time\ndef work():\n    time.sleep(0.3)\n    print('work done')\n"
     "threading.Thread(target=work).start()\nprint('main done')\n", "main done\nwork done\n"),
    ("import sys, threading\ndef main():\n    print(sum(range(10)))\n"
     "sys.setrecursionlimit(10**6)\nthreading.stack_size(2**26)\nthreading.Thread(target=main).start()\n", "45\n"),
    ("import atexit\natexit.register(print, 'at exit')\nprint('body')\n", "body\nat exit\n"),
], ids=["non-daemon-thread", "main-in-big-stack-thread", "atexit"])
def test_block_ends_like_python_shutdown(sb, code, output):
    r = sb.run(code)
    assert (r.status, r.output) == ("ok", output)


@pytest.mark.timeout(30)
def test_thread_that_never_ends_times_out_with_its_output(sb_quick):
    r = sb_quick.run("import threading, time\ndef spin():\n    print('spinning', flush=True)\n"
                     "    while True:\n        time.sleep(0.01)\nthreading.Thread(target=spin).start()\n")
    assert r.status == "timeout" and r.output.startswith("spinning\n"), r.output
    _assert_clean(sb_quick)


@pytest.mark.timeout(30)
def test_twice_detached_grandchild_does_not_outlive_the_block(tmpdir_for_blocks):
    m = _marker()
    try:
        with Sandbox(workers=1, timeout=3) as box:
            # (the parent ends once the grandchild is about to exec, not after a fixed sleep)
            r = box.run("import os\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                        "        os.setsid()\n        os.write(w, b'x')\n"
                        f"        os.execvp('sleep', ['sleep', '{m}'])\n    os._exit(0)\n"
                        "os.read(r, 1)\nprint('parent done')\n")
            assert (r.status, r.output) == ("ok", "parent done\n")
            if box.contained:
                assert _pids_with_cmdline(m) == []  # gone with the block, not only with close()
        assert _pids_with_cmdline(m) == [] or not box.contained
    finally:
        for p in _pids_with_cmdline(m):
            os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_each_block_has_its_own_temp_space_and_shm(sb):
    name = f"thinc_shm_{random.randrange(10**9)}"
    r = sb.run("import os, tempfile\nfrom multiprocessing import shared_memory, resource_tracker\n"
               "with tempfile.NamedTemporaryFile(delete=False) as f:\n    f.write(b'secret')\n"
               f"shm = shared_memory.SharedMemory(name={name!r}, create=True, size=50 * 2**20)\n"
               "resource_tracker.unregister(shm._name, 'shared_memory')  # left behind on purpose\n"
               "print(f.name)\nprint(tempfile.gettempdir() == os.getcwd())\n")
    assert r.ok, r.output
    leftover, same = r.output.split()
    assert same == "True"
    r2 = sb.run(f"import os\nprint(os.path.exists({leftover!r}), os.path.exists('/dev/shm/{name}'))")
    assert r2.output == "False False\n"
    assert not os.path.exists(leftover) and not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.timeout(60)
def test_a_venv_under_the_system_tmp_stays_usable_but_not_the_project_around_it(tmp_path):
    """CI may clone the project and make its venv under /tmp: a contained block's private
    /tmp still shows the venv (read-only; every lazy import from site-packages needs it),
    but not the project folder around it (tests/faults.md S27)."""
    if os.geteuid() != 0:
        pytest.skip("containment (a private /tmp) is root-only")
    shutil.copy(os.path.join(ROOT, "executor.py"), tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True, timeout=50)
    probe = glob.glob(str(tmp_path / ".venv/lib/python*/site-packages"))[0] + "/thinc_probe.py"
    with open(probe, "w") as f:
        f.write("VALUE = 42\n")
    os.chmod(probe, 0o666)  # (writable by nobody too: only the read-only mount refuses the write)
    target = str(tmp_path / "executor.py")
    read = f"import os, thinc_probe\nprint(thinc_probe.VALUE, os.path.exists({target!r}))"
    write = f"open({probe!r}, 'a')"
    code = ("import executor\nwith executor.Sandbox(timeout=10) as sb:\n"
            f"    r, w = sb.run({read!r}), sb.run({write!r})\n"
            "    print(sb.contained, r.status, r.output.strip(), w.status, w.output.splitlines()[-1])\n")
    p = subprocess.run([str(tmp_path / ".venv/bin/python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=50)
    want = f"True ok 42 False error OSError: [Errno 30] Read-only file system: {probe!r}\n"
    assert p.stdout == want, p.stdout + p.stderr
    assert open(probe).read() == "VALUE = 42\n"


@pytest.mark.timeout(240)
def test_a_project_inside_a_bound_folder_is_covered_there_S36(tmp_path):
    """A project under /usr/src (a common container layout), imported by its real path or
    through a symlink: its data and run folders were readable from a block (the symlinked
    path was not recognised as the project, so /usr was bound whole), or the template died
    (/usr left out of the block's root: no /bin/bash, no stdlib). Now /usr is bound and an
    empty tmpfs covers the project there: a block that walks /usr/src for the answer finds
    nothing, sees an empty project folder, and numpy still imports."""
    if os.geteuid() != 0:
        pytest.skip("containment (a root of its own) is root-only")
    project = f"/usr/src/thinc-s36-{os.getpid()}"
    try:
        os.makedirs(f"{project}/data")
        os.makedirs(f"{project}/runs/r")
        shutil.copy(os.path.join(ROOT, "executor.py"), project)
        with open(f"{project}/data/p.jsonl", "w") as f:
            f.write('{"id": "p1", "problem": "6*7?", "answer": "SECRET_S36_4242"}\n')
        with open(f"{project}/runs/r/args.json", "w") as f:
            f.write('{"data": "data/p.jsonl"}\n')
        os.symlink(project, tmp_path / "app")
        search = ("import os, numpy\nfound = [os.path.join(r, f) for r, _, fs in os.walk('/usr/src') for f in fs\n"
                  "         if b'SECRET_S36' in open(os.path.join(r, f), 'rb').read()]\n"
                  f"print(found, os.listdir({project!r}), int(numpy.int64(6) * 7))")
        code = ("import executor\nwith executor.Sandbox(timeout=60) as sb:\n"
                f"    r = sb.run({search!r})\n    print(sb.contained, r.status, r.output.strip())\n")
        for cwd, env in ((project, {}), (str(tmp_path), {"PYTHONPATH": str(tmp_path / "app")})):
            p = subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                               text=True, timeout=200)
            assert p.stdout == "True ok [] [] 42\n", (cwd, p.stdout + p.stderr[-3000:])
    finally:
        shutil.rmtree(project, ignore_errors=True)


@pytest.mark.timeout(240)
def test_a_project_that_is_a_sys_path_folder_is_not_bound_S36(tmp_path):
    """`pip install -e .` puts the project folder itself on sys.path (a .pth file): it was
    bound whole into the block's root, data and all. Now a folder that is the project (or
    the working folder) is never bound: the block finds neither its data nor its folder."""
    if os.geteuid() != 0:
        pytest.skip("containment (a root of its own) is root-only")
    project = tmp_path / "proj"
    (project / "data").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "executor.py"), project)
    (project / "data" / "p.jsonl").write_text('{"id": "p1", "problem": "6*7?", "answer": "SECRET_S36_PTH"}\n')
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(tmp_path / "venv")],
                   check=True, timeout=50)
    site = glob.glob(str(tmp_path / "venv/lib/python*/site-packages"))[0]
    with open(f"{site}/__editable__.thinc_s36.pth", "w") as f:
        f.write(f"{project}\n")
    probe = f"import os\nprint(os.path.exists({str(project)!r}), os.path.exists({str(project / 'data/p.jsonl')!r}))"
    code = ("import executor\nwith executor.Sandbox(timeout=30) as sb:\n"
            f"    r = sb.run({probe!r})\n    print(sb.contained, r.status, r.output.strip())\n")
    p = subprocess.run([str(tmp_path / "venv/bin/python"), "-c", code], cwd="/", capture_output=True, text=True,
                       timeout=200)
    assert p.stdout == "True ok False False\n", p.stdout + p.stderr[-3000:]


@pytest.mark.timeout(120)
def test_a_deleted_working_folder_still_gives_contained_blocks_S38(tmp_path):
    """A caller whose working folder was deleted: os.getcwd() failed while the root was built,
    the template gave up containment, and with THINC_ALLOW_UNCONTAINED=1 blocks ran as root
    (otherwise a SandboxError). Now the folder is simply not there to hide."""
    if os.geteuid() != 0:
        pytest.skip("containment is root-only")
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (f"import os, sys\nsys.path.insert(0, {ROOT!r})\nimport executor\nos.chdir({str(gone)!r})\n"
            f"os.rmdir({str(gone)!r})\nwith executor.Sandbox(timeout=10) as sb:\n"
            "    print(sb.contained, sb.run('import os; print(os.getuid())').output.strip())\n")
    p = subprocess.run([sys.executable, "-c", code], cwd="/", env={**os.environ, "THINC_ALLOW_UNCONTAINED": "1"},
                       capture_output=True, text=True, timeout=100)
    assert p.stdout == "True 65534\n", p.stdout + p.stderr[-3000:]


def test_a_sandbox_that_cannot_start_is_one_line_S37(capsys):
    """A SandboxError (a template that died, containment refused) ended a stage in a
    traceback; now one line with its first and last lines (the cause), exit 1."""
    def main(argv):
        raise ex.SandboxError("sandbox template failed to start with 'python': Traceback (most recent call last):\n"
                              "  File \"<string>\", line 5\nFileNotFoundError: [Errno 2] No such file: '/bin/bash'\n")

    main.__module__ = "executor"
    assert ex.cli(main, []) == 1
    assert capsys.readouterr().err == ("executor.py: error: sandbox template failed to start with 'python': Traceback "
                                       "(most recent call last): (FileNotFoundError: [Errno 2] No such file: "
                                       "'/bin/bash')\n")


@pytest.mark.timeout(60)
def test_worker_count_follows_cpu_affinity(tmpdir_for_blocks):
    code = ("import os, executor\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "with executor.Sandbox(timeout=3) as sb:\n    print(sb.workers)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert p.stdout == "1\n", p.stderr
    # torchrun's LOCAL_WORLD_SIZE ranks on a node share its CPUs (every stage's default; distill
    # divided by the WORLD_SIZE of all nodes): 2 CPUs, 2 ranks here -> 1 each; 1 rank -> 2
    two = sorted(os.sched_getaffinity(0))[:2]
    assert len(two) == 2  # (CI's machine has 2 cores)
    code = (f"import os, executor\nos.sched_setaffinity(0, {set(two)})\n"
            "with executor.Sandbox(timeout=3) as sb:\n    print(sb.workers)\n")
    for ranks_here, workers in ((None, "2"), ("1", "2"), ("2", "1"), ("4", "1")):
        env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
        env.update({"LOCAL_WORLD_SIZE": ranks_here} if ranks_here else {})
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50, env=env)
        assert p.stdout == workers + "\n", (ranks_here, p.stderr)


# -----------------------------------------------------------------------------
# Stateful mode (tests/faults.md S17): earlier blocks of the same trajectory are replayed

def _trajectory(sandbox, codes):
    """Run codes as the successive blocks of one stateful trajectory -> their results."""
    history, results = [], []
    for code in codes:
        r = sandbox.run(code, history=list(history))
        history.append({"code": code, "output": r.output, "status": r.status})
        results.append(r)
    return results


@pytest.mark.timeout(30)
def test_stateful_variables_functions_imports_carry_over_without_repeated_output(sb):
    rs = _trajectory(sb, ["import math\nx = 41\ndef f(y):\n    return y + 1\nprint('one')",
                          "print(f(x), math.isqrt(17))", "print('three')"])
    assert [(r.status, r.output) for r in rs] == [("ok", "one\n"), ("ok", "42 4\n"), ("ok", "three\n")]


@pytest.mark.timeout(30)
def test_stateful_failed_block_keeps_what_it_did_before_the_error(sb):
    rs = _trajectory(sb, ["a = 1\nraise ValueError('boom')\nb = 2", "import sys\nsys.exit(0)\nc = 3",
                          "print(a, 'b' in dir(), 'c' in dir())"])
    assert [r.status for r in rs] == ["error", "ok", "ok"]
    assert rs[2].output == "1 False False\n"


@pytest.mark.timeout(30)
def test_stateful_timed_out_block_is_not_part_of_the_state(sb_quick):
    rs = _trajectory(sb_quick, ["x = 1", "x = 2\nwhile True:\n    pass", "print(x)"])
    assert [r.status for r in rs] == ["ok", "timeout", "ok"]
    assert rs[2].output == "1\n"


@pytest.mark.timeout(30)
def test_stateful_trajectories_never_see_each_other(sb):
    a, b = [], []
    for code_a, code_b in [("x = 'A'", "x = 'B'"), ("y = x * 2", "z = x * 3")]:
        for h, code in ((a, code_a), (b, code_b)):
            h.append({"code": code, "status": sb.run(code, history=list(h)).status})
    ra, rb = sb.run("print(x, y, 'z' in dir())", history=a), sb.run("print(x, z, 'y' in dir())", history=b)
    assert (ra.output, rb.output) == ("A AA False\n", "B BBB False\n")
    assert "NameError" in sb.run("print(x)", history=[]).output


@pytest.mark.timeout(30)
def test_stateful_replay_draws_the_same_random_numbers(sb):
    rs = _trajectory(sb, ["import random, numpy as np\nx = np.random.rand()\nu = random.random()\nprint(x, u)",
                          "print(x, u)", "print(np.random.rand())"])
    assert rs[1].output == rs[0].output
    assert rs[2].output != rs[0].output.split()[0] + "\n"


@pytest.mark.timeout(30)
def test_stateful_replay_time_is_not_the_blocks_time(sb):
    # each block sleeps 2 s of the 3 s limit (1 s to spare on a loaded machine), 4 s with the replay
    rs = _trajectory(sb, ["import time\ntime.sleep(2)", "import time\ntime.sleep(2)\nprint('in time')"])
    assert [(r.status, r.output) for r in rs] == [("ok", ""), ("ok", "in time\n")]  # 4 s > the 3 s limit


@pytest.mark.timeout(40)
@pytest.mark.parametrize("code,status,says", [
    ("while True:\n    pass", "timeout", "TimeoutError"),
    ("bytearray(8 * 1024**3)", "memory", "MemoryError"),
    ("input()", "error", "EOFError"),
    ("print('y' * 10**6)", "ok", "bytes of output cut"),
    ("import os\nos.system('sleep 300 &')\nprint(os.getcwd())", "ok", "/tmp" if os.geteuid() == 0 else "thinc_block_"),
    ("import ctypes\nctypes.string_at(0)", "killed", "SIGSEGV"),
], ids=["timeout", "memory", "stdin", "output-cap", "background", "segfault"])
def test_stateful_block_keeps_every_single_block_guarantee(sb_quick, code, status, says):
    history = [{"code": "import numpy as np\nw = 3\nprint('earlier')", "status": "ok"}]
    r = sb_quick.run(code, history=history)
    assert r.status == status and says in r.output, r.output
    assert "earlier" not in r.output
    _assert_clean(sb_quick)


@pytest.mark.timeout(60)
def test_stateless_is_the_default_and_unchanged(sb):
    first, second = sb.run("x = 41\nprint(x)"), sb.run("print(x + 1)")
    assert first.output == "41\n"
    assert second.status == "error" and second.output.endswith("NameError: name 'x' is not defined\n")
    assert sb.run("print(x + 1)", history=None).output == second.output


@pytest.mark.timeout(60)
def test_exemplars_run_unchanged_under_both_policies(sb):
    import distill
    for e in distill.load_exemplars(os.path.join(ROOT, "data", "exemplars.jsonl")):
        _, blocks, _ = distill.split_completion(e["completion"])
        stateful = _trajectory(sb, [code for code, _ in blocks])
        stateless = sb.run_many([code for code, _ in blocks])
        for (code, recorded), a, b in zip(blocks, stateful, stateless):
            assert a.status == b.status == "ok", (e["id"], a.output, b.output)
            assert a.output.rstrip("\n") == b.output.rstrip("\n") == recorded, e["id"]


@pytest.mark.timeout(120)
def test_rollout_stateful_rows_of_a_group_each_keep_their_own_state(tokenizer, sb):
    from test_engine import Scripted, enc
    import tiny
    tok = tokenizer
    prompt = ex.build_prompt_ids(tok, "Define x, then use it.")
    seg1 = enc(tok, "Plan.\n```python\nx = 20\n```")
    seg2 = enc(tok, "```python\nprint(x+1)\n```")
    full = (prompt + seg1 + enc(tok, ex.output_block("")) + seg2 + enc(tok, ex.output_block("21\n"))
            + enc(tok, "\\boxed{21}") + [tok.eos_token_id])
    model = Scripted(tiny.make_model(tok), [full], tok.eos_token_id)
    samples = ex.rollout(model, tok, [prompt], sb, n=2, temperature=0.0, max_new_tokens=300, stateful=True)
    assert [[(b["output"], b["status"]) for b in s.blocks] for s in samples] == [[("", "ok"), ("21\n", "ok")]] * 2
    assert [(s.pred, s.finish_reason) for s in samples] == [("21", "stop")] * 2
    for s in ex.rollout(model, tok, [prompt], sb, n=2, temperature=0.0, max_new_tokens=300):  # stateless
        assert s.blocks[1]["status"] == "error" and "NameError" in s.blocks[1]["output"]


def test_a_closed_sandbox_refuses_blocks_and_leaks_no_descriptor():
    sb = Sandbox(workers=1, timeout=5)
    assert sb.run("print(1)").output == "1\n"
    sb.close()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(SandboxError, match="sandbox is closed"):
            sb.run("print(2)")
    assert len(os.listdir("/proc/self/fd")) == before


# -----------------------------------------------------------------------------
# One-way trust, IPC, keys and user namespaces (faults S18-S22), Python's semantics (S23)

def _python_u(code, tmp_path=None):
    """What `python -u block.py` prints (stdout and stderr interleaved) and its exit code,
    run with an empty stdin in a fresh directory."""
    d = tmp_path or tempfile.mkdtemp()
    path = os.path.join(d, "block.py")
    with open(path, "w") as f:
        f.write(code)
    try:
        return subprocess.run([sys.executable, "-u", path], cwd=d, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    finally:
        if tmp_path is None:
            shutil.rmtree(d)


FORGE = ("import os, time\nfor fd in range(3, 5000):  # every descriptor it holds, the caller's too if any\n"
         "    try:\n        os.write(fd, {msg!r})\n    except OSError:\n        pass\n")


@pytest.mark.timeout(30)
def test_s18_block_holds_no_descriptor_of_the_caller_or_template(sb):
    r = sb.run("import os\nfds = sorted(int(f) for f in os.listdir('/proc/self/fd'))  # (listdir's own is closed now)\n"
               "print([(min(fd, 1024), os.readlink(f'/proc/self/fd/{fd}').split(':')[0]) for fd in fds\n"
               "       if os.path.lexists(f'/proc/self/fd/{fd}')])")
    assert r.output == "[(0, '/dev/null'), (1, 'pipe'), (2, 'pipe'), (1024, 'pipe')]\n", r.output  # 1024+: its report
    if sb.contained:  # its namespace's init (bash) holds its pipe from the template and /dev/null
        result = []
        t = threading.Thread(target=lambda: result.append(sb.run("import time\ntime.sleep(30)")))  # (ends at TIMEOUT)
        t.start()
        deadline, inits = time.monotonic() + TIMEOUT, []  # until the block's init is seen, not a fixed sleep
        while not inits and time.monotonic() < deadline:
            time.sleep(0.05)
            inits = [p for p, _, _ in _descendants(sb._proc.pid) if _is_init(p)]
        held = [sorted((f, os.readlink(f"/proc/{p}/fd/{f}").split(":")[0]) for f in os.listdir(f"/proc/{p}/fd"))
                for p in inits]
        t.join()
        assert held == [[("0", "pipe"), ("1", "/dev/null"), ("2", "/dev/null")]], held


@pytest.mark.timeout(30)
def test_s18_forged_pid_kills_nothing_outside_the_block(sb_quick):
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        for msg in (f'{{"pid": {victim.pid}}}', '{"pid": 0}', '{"started": true}'):
            r = sb_quick.run(FORGE.format(msg=msg.encode()) + "time.sleep(5)\n")
            assert r.status == "timeout", r.output
            assert victim.poll() is None, f"{msg} let the block kill another process group"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("msg", [b'{"code": 0, "error": null}', b'{"exit": 0}', b"{not json",
                                 b"[1]", b'{"exit": "x", "code": []}', b"\0sandbox: boom", b"s-", b"sSystemExit"])
def test_s18_forged_or_malformed_reports_change_nothing_but_its_own_end(sb, msg):
    r = sb.run(FORGE.format(msg=msg) + "time.sleep(0.3)\nprint('still running')\nraise ValueError('late')\n")
    assert r.status == "error" and r.output.startswith("still running\n"), r.output
    assert r.output.endswith("ValueError: late\n"), r.output
    r = sb.run(FORGE.format(msg=msg) + "os._exit(0)\n")
    assert r.status == "ok" and r.output in ("", "[os._exit(0) called: the program stopped here]"), r.output
    assert sb.run("print(1+1)").output == "2\n"


@pytest.mark.timeout(30)
def test_s18_output_that_looks_like_a_sandbox_message_is_output(sb):
    r = sb.run("import sys\nsys.stdout.write('\\0sandbox: not really')")
    assert (r.status, r.output) == ("ok", "\0sandbox: not really")


@pytest.mark.timeout(60)
def test_s19_blocks_share_no_sysv_or_posix_ipc(sb):
    key = random.randrange(10**6, 10**8)
    shm = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmget.restype = ctypes.c_int\n"
           f"print(libc.shmget({key}, 2**20, {{flags}}) >= 0, "
           f"libc.mq_open(b'/thinc_q{key}', {{mq}}, 0o600, None) >= 0)\n")
    made = sb.run(shm.format(flags=0o1600, mq=0o100 | 2))  # IPC_CREAT | 0600; O_CREAT | O_RDWR
    assert made.output == "True True\n", made.output
    seen = sb.run(shm.format(flags=0, mq=0)).output
    with open("/proc/sysvipc/shm") as f:
        left = str(key) in {line.split()[0] for line in f}
    # contained: another block sees neither and no segment outlives the block (not root: the
    # module docstring lists IPC as not covered)
    assert (seen, left) == (("False False\n", False) if sb.contained else ("True True\n", True)), seen


def _keyctl(*args):
    libc = __import__("ctypes").CDLL(None, use_errno=True)
    return libc.syscall(*args)


@pytest.mark.timeout(60)
def test_s20_block_reads_no_key_of_the_caller_and_leaves_none(tmpdir_for_blocks):
    nr = dict(zip(("add_key", "request_key", "keyctl"), {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[
        os.uname().machine]))
    serial = _keyctl(nr["add_key"], b"user", b"thinc_test_key", b"hunter2", 7, -3)  # into the session keyring
    try:
        with Sandbox(workers=1, timeout=5) as box:
            r = box.run(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                        f"buf = ctypes.create_string_buffer(64)\n"
                        f"print(libc.syscall({nr['request_key']}, b'user', b'thinc_test_key', None, 0),"
                        f" libc.syscall({nr['keyctl']}, 11, {serial}, buf, 64), buf.value,"  # KEYCTL_READ
                        f" libc.syscall({nr['add_key']}, b'user', b'left', b'x', 1, -4))")  # into the user keyring
            assert r.output == "-1 -1 b'' -1\n" or not box.contained, r.output  # (not root: not covered)
    finally:
        if serial > 0:
            _keyctl(nr["keyctl"], 3, serial)  # KEYCTL_REVOKE


@pytest.mark.timeout(30)
def test_s21_no_user_namespace_to_hide_processes_in(sb):
    r = sb.run("import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(libc.unshare(0x10000000), ctypes.get_errno() == 1)\n"  # CLONE_NEWUSER -> EPERM
               "print(subprocess.run(['unshare', '-U', '-r', 'true'], capture_output=True).returncode != 0)\n"
               "pid = os.fork()\nif pid == 0:\n    os._exit(7)\n"
               "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    assert r.output == ("-1 True\nTrue\n7\n" if sb.contained else r.output), r.output
    assert r.status == "ok"


@pytest.mark.timeout(60)
def test_s22_memfd_pages_count_against_the_memory_limit_where_cgroups_exist(tmpdir_for_blocks):
    with Sandbox(workers=1, timeout=10, memory_mb=400) as box:  # (the forked template maps ~270 MB)
        r = box.run("import os\nfds = [os.memfd_create('x') for _ in range(10)]\nmib = bytes(2**20)\n"
                    "for fd in fds:\n    for _ in range(50):\n        os.write(fd, mib)\nprint('500 MiB written')")
        groups = [d for g in getattr(box, "_cgroups", [["(none)"]]) for d in g]
    if groups:  # a cgroup per block (root, cgroup v1 or delegated v2): every page counts
        assert r.status == "memory" and "500 MiB written" not in r.output, r.output
        assert not any(os.path.exists(d) for d in groups), "a block's cgroup outlived the sandbox"
    else:  # no cgroup may be made here: the executor docstring lists memfds as not counted
        assert (r.status, r.output) == ("ok", "500 MiB written\n")


@pytest.mark.timeout(60)
def test_s39_the_memory_limit_holds_swap_too(tmpdir_for_blocks):
    """A block cgroup limits RAM and swap together (tests/faults.md S39): v1's memsw limit is the
    RAM limit, v2's swap limit 0, wherever the kernel accounts swap. Before, a host with swap let a
    block's pages past memory_mb go to swap (S22's 500 MiB of memfds were written, status ok).
    Where no cgroup can be made, or swap is not accounted, the test has nothing to check: skipped."""
    with Sandbox(workers=1, timeout=10, memory_mb=400) as box:
        assert box.run("print(1)").output == "1\n"
        files = {}
        for d in [d for g in getattr(box, "_cgroups", []) for d in g]:
            for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.max", "memory.swap.max"):
                if os.path.exists(f"{d}/{name}"):
                    files[name] = open(f"{d}/{name}").read().strip()
    if not {"memory.memsw.limit_in_bytes", "memory.swap.max"} & set(files):
        pytest.skip("no block cgroup with swap accounting on this machine")
    if "memory.memsw.limit_in_bytes" in files:
        assert files["memory.memsw.limit_in_bytes"] == files["memory.limit_in_bytes"] == str(400 << 20)
    if "memory.swap.max" in files:
        assert (files["memory.swap.max"], files["memory.max"]) == ("0", str(400 << 20))


def test_s39_a_refused_swap_limit_keeps_the_ram_limit(monkeypatch):
    """Where the kernel refuses the swap limit (an OSError writing it), the block cgroup keeps its
    RAM limit; before, the error removed the whole memory cgroup (no memory limit at all)."""
    import builtins
    real_open = builtins.open

    def refusing_open(path, *args, **kwargs):
        if str(path).endswith(("memory.memsw.limit_in_bytes", "memory.swap.max")) and "w" in (args or ("r",))[0]:
            raise OSError(22, "Invalid argument", path)
        return real_open(path, *args, **kwargs)

    def memory_dirs(dirs):
        return [d for d in dirs if os.path.exists(f"{d}/memory.limit_in_bytes") or os.path.exists(f"{d}/memory.max")]

    plain = ex._make_cgroup(400)
    can_make = bool(memory_dirs(plain))
    ex._remove_cgroup(plain)
    if not can_make:
        pytest.skip("no memory cgroup can be made here")
    monkeypatch.setattr(builtins, "open", refusing_open)
    dirs = ex._make_cgroup(400)
    monkeypatch.setattr(builtins, "open", real_open)
    try:
        memory = memory_dirs(dirs)
        assert memory, "the refused swap limit dropped the memory cgroup"
        limit = f"{memory[0]}/memory.limit_in_bytes"
        limit = limit if os.path.exists(limit) else f"{memory[0]}/memory.max"
        assert open(limit).read().strip() == str(400 << 20)
    finally:
        ex._remove_cgroup(dirs)


@pytest.mark.timeout(30)
def test_s22_threads_count_towards_the_fork_bomb_limit(sb):
    r = sb.run(f"import threading, time\nfor _ in range({ex.MAX_BLOCK_TASKS + 100}):\n"
               "    threading.Thread(target=time.sleep, args=(10,), daemon=True).start()\ntime.sleep(10)\n")
    if sb.contained:  # (not root: RLIMIT_NPROC counts threads, against all the user's processes)
        assert r.status == "killed" or "can't start new thread" in r.output, r.output  # the count, or pids.max
        assert r.seconds < TIMEOUT  # (stopped by the limit, not by the timeout)


SEMANTICS = {
    "__file__": "import os\nprint(os.path.basename(__file__)[-3:], open(__file__).read() == open(__file__).read())\n",
    "isolated": "import sys\nprint(sys.flags.isolated)\n",
    "excepthook": "import sys\nsys.excepthook = lambda t, v, tb: print('hook:', t.__name__, v)\n"
                  "raise ValueError('x')\n",
    "del-and-unflushed": "class A:\n    def __del__(self):\n        print('del')\na = A()\n"
                         "out = open(1, 'w', closefd=False)\nout.write('buffered, never flushed\\n')\n",
    "close-1-2": "import os, sys\nprint('x')\nos.close(1)\nos.close(2)\nsys.exit(3)\n",
    "closerange": "import os\nos.closerange(3, 1024)\nprint('after')\n",
    "stdin": "import sys\n"
             "print(repr(sys.stdin.read()), sys.stdin.buffer.read(), sys.stdin.fileno(), sys.stdin.encoding)\n",
    "spawn-pool": "import multiprocessing as mp\ndef sq(x):\n    return x * x\nif __name__ == '__main__':\n"
                  "    with mp.get_context('spawn').Pool(2) as pool:\n        print(pool.map(sq, range(5)))\n",
    "spawn-process": "import multiprocessing as mp\ndef hello(q):\n    q.put('from the child')\n"
                     "if __name__ == '__main__':\n    ctx = mp.get_context('spawn')\n    q = ctx.Queue()\n"
                     "    p = ctx.Process(target=hello, args=(q,))\n    p.start()\n    print(q.get())\n    p.join()\n",
    "forkserver-executor": "import concurrent.futures as cf, multiprocessing as mp\ndef sq(x):\n    return x * x\n"
                           "if __name__ == '__main__':\n"
                           "    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context('forkserver')) as ex:\n"
                           "        print(list(ex.map(sq, range(5))))\n",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SEMANTICS))
def test_s23_block_runs_as_python_u_runs_the_same_file(sb, tmp_path, name):
    code = SEMANTICS[name]
    want = _python_u(code, str(tmp_path))
    with Sandbox(workers=1, timeout=30) as box:
        r = box.run(code)
    note = f"[sys.exit({want.returncode}) called: the program stopped here]" if name == "close-1-2" else ""
    assert (r.output, r.status == "ok") == (want.stdout + note, want.returncode == 0), (r.output, want.stdout)


@pytest.mark.timeout(60)
def test_s23_stateful_earlier_base_exception_or_thread_exit_ends_only_that_block(sb):
    rs = _trajectory(sb, ["x = 1\nraise KeyboardInterrupt", "print('next', x)", "raise BaseException('odd')",
                          "print('still', x)"])
    assert [(r.status, r.output.splitlines()[0]) for r in rs] == [
        ("error", "Traceback (most recent call last):"), ("ok", "next 1"),
        ("error", "Traceback (most recent call last):"), ("ok", "still 1")]
    # (the main thread joins the one that exits: `x = 2` never runs, however slow the machine)
    rs = _trajectory(sb, ["import os, threading\nx = 1\nt = threading.Thread(target=os._exit, args=(0,))\nt.start()\n"
                          "t.join()\nx = 2", "print(x)"])
    assert [(r.status, r.output) for r in rs] == [("ok", "[os._exit(0) called: the program stopped here]"),
                                                  ("ok", "1\n")]


@pytest.mark.timeout(60)
def test_s24_trajectory_printer_shows_control_characters_escaped(sb):
    out = sb.run("print('\\x1b[2J\\x1b]0;owned\\x07 nul\\0 cr\\r c1\\x9b del\\x7f tab\\t end')").output
    record = {"id": "p", "problem": "q\x1b[31m",
              "completion": "Plan.\n```python\nx\n```\n```output\n" + out + "```\n\\boxed{1}",
              "blocks": [{"code": "x", "status": "ok", "output": out}], "answer": "1", "pred": "1", "correct": True}
    text = ex.format_trajectory(record)
    assert "output 1:\n\\x1b[2J\\x1b]0;owned\\x07 nul\\x00 cr\\r c1\\x9b del\\x7f tab\t end\n" in text, text
    assert "problem p: q\\x1b[31m\n" in text
    assert not any(ch < " " and ch not in "\n\t" or "\x7f" <= ch <= "\x9f" for ch in text)


@pytest.mark.timeout(60)
def test_s25_a_tracer_cannot_keep_the_block_from_ending(sb):
    """A child that leaves the process group and ptrace-seizes the block's main process
    would keep its zombie from being reaped (only the tracer may reap a traced zombie), so
    `run` never returned; ptrace is refused (EPERM) and the block ends at its timeout."""
    code = ("import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\nmain = os.getpid()\n"
            "r, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
            "    print(libc.ptrace(0x4206, main, 0, 0), ctypes.get_errno(), flush=True)\n    os.write(w, b'x')\n"
            "    time.sleep(30)\n    os._exit(0)\nos.read(r, 1)\n")  # (the block ends once the child has tried)
    t0 = time.monotonic()
    r = sb.run(code)
    assert time.monotonic() - t0 < 15
    if sb.contained:
        assert r.output == "-1 1\n" and r.status == "ok", (r.status, r.output)


@pytest.mark.timeout(30)
def test_s26_no_network_no_open_file_flood_and_the_block_dies_first_out_of_memory(sb):
    """A block reaches no listener of the caller's, not on loopback either (a TCPStore of
    torchrun's is one); it may hold a bounded number of open files; and the kernel's OOM killer picks a
    block before the trainer (oom_score_adj 1000). Open files: at most 4096 a process (the
    report pipe's fd + 1), whatever the caller's limit."""
    import socket
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        r = sb.run("import resource, socket\ntry:\n"
                   f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('reached')\n"
                   "except OSError as e:\n    print(type(e).__name__)\n"
                   "print(resource.getrlimit(resource.RLIMIT_NOFILE))\n"
                   "print(open('/proc/self/oom_score_adj').read().strip())")
    finally:
        server.close()
    lines = r.output.splitlines()
    assert lines[1:] == [str((ex._REPORT_FD + 1,) * 2), "1000"] and ex._REPORT_FD < 4096, r.output
    if sb.contained:
        assert lines[0] in ("ConnectionRefusedError", "OSError"), r.output


# -----------------------------------------------------------------------------
# An allow-listed root, run as nobody, per-block state (faults S27-S35)

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="containment is for a root caller (CI runs as root)")

# what a reward-hacking block would run: every path of the filesystem but /proc (its own
# namespace's), by name (and the layout's folder name), and the contents of every file outside
# the system and the interpreter (but the block's own)
SEARCH = ("import os, sys\nfound = []\nfor top, dirs, files in os.walk('/'):\n"
          "    dirs[:] = [d for d in dirs if os.path.join(top, d) != '/proc']\n"
          "    for name in dirs + files:\n        path = os.path.join(top, name)\n"
          "        if (name.endswith(('.jsonl', '.safetensors')) or name in ('args.json', '.ssh')\n"
          "                or {folder!r} in path):\n"
          "            found.append(path)\n"
          "        elif name in files and path != __file__ and not path.startswith(('/usr/', '/dev/', sys.base_prefix,"
          " sys.prefix)):\n"
          "            try:\n                text = open(path, 'rb').read(1 << 20)\n"
          "            except OSError:\n                continue\n"
          "            if {problem!r}.encode() in text or {answer!r}.encode() in text:\n"
          "                found.append(path)\nprint(found)\n")


@pytest.fixture
def run_layout():
    """A realistic run, made by the caller (root) in the project folder: data/*.jsonl with a
    problem and its gold answer, a run folder (args.json naming the data, samples.jsonl,
    pass_rates.jsonl), a checkpoint's *.safetensors and a ~/.ssh-like 0600 key. Yields
    (problem, answer, folder); removed afterwards."""
    d = tempfile.mkdtemp(dir=ROOT, prefix=".thinc_layout_")
    problem, answer = f"What is the remainder of 7^{random.randrange(10**6)} mod 1009?", str(random.randrange(10**9))
    files = {"data/held_out.jsonl": f'{{"problem": "{problem}", "answer": "{answer}"}}\n',
             "runs/grpo/args.json": '{"data": "data/held_out.jsonl"}',
             "runs/grpo/samples.jsonl": f'{{"pred": "{answer}"}}\n',
             "runs/grpo/pass_rates.jsonl": f'{{"problem": "{problem}", "pass_rate": 0.5}}\n',
             "runs/grpo/ckpt/model.safetensors": "weights", "home/.ssh/id_ed25519": f"key {answer}"}
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    os.chmod(os.path.join(d, "home/.ssh/id_ed25519"), 0o600)
    yield problem, answer, d
    shutil.rmtree(d)


@pytest.mark.timeout(300)
@ROOT_ONLY
def test_a_block_searching_the_whole_filesystem_finds_nothing_of_the_callers_S27(tmpdir_for_blocks, run_layout):
    """tests/faults.md S27: the block's root holds only the system and the interpreter, so a
    walk of '/' finds no *.jsonl, *.safetensors, args.json, .ssh or executor.py, and no file
    holding the problem or its answer (before: all of them, read-only, in seconds)."""
    problem, answer, folder = run_layout
    with Sandbox(workers=1, timeout=120) as box:  # (the walk reads the whole venv)
        r = box.run(SEARCH.format(problem=problem, answer=answer, folder=os.path.basename(folder)))
    assert (r.status, r.output) == ("ok", "[]\n"), r.output[:3000]


@pytest.mark.timeout(300)
@ROOT_ONLY
def test_rollout_block_searching_for_the_answer_key_finds_nothing_S27(run_layout, tokenizer):
    """The same search as the block a (scripted) policy writes for the problem of the
    layout, run by executor.rollout through the sandbox the stages use."""
    from test_engine import Scripted, enc
    import tiny
    problem, answer, folder = run_layout
    prompt = ex.build_prompt_ids(tokenizer, problem)
    code = SEARCH.format(problem=problem, answer=answer, folder=os.path.basename(folder))
    model = Scripted(tiny.make_model(tokenizer), [prompt + enc(tokenizer, f"Search.\n```python\n{code}```")],
                     tokenizer.eos_token_id)
    with Sandbox(workers=1, timeout=120) as box:
        out = ex.rollout(model, tokenizer, [prompt], box, temperature=0.0, max_new_tokens=len(code) + 50)[0]
    assert [(b["code"], b["status"], b["output"]) for b in out.blocks] == [(code, "ok", "[]\n")], out.blocks


@pytest.mark.timeout(30)
@ROOT_ONLY
def test_a_block_reaches_no_unix_socket_or_fifo_of_the_caller_S28(sb):
    """tests/faults.md S28: a listening unix socket and a FIFO (with a reader) in the project
    folder: the block neither connects nor writes (before: both, as root: the network
    namespace does not cover path sockets)."""
    d = tempfile.mkdtemp(dir=ROOT, prefix=".thinc_ipc_")
    server, fifo = socket.socket(socket.AF_UNIX), os.path.join(d, "fifo")
    server.bind(os.path.join(d, "sock"))
    server.listen()
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        r = sb.run(f"import os, socket\ns = socket.socket(socket.AF_UNIX)\n"
                   f"for act in (lambda: s.connect({d!r} + '/sock'),"
                   f" lambda: os.write(os.open({fifo!r}, os.O_WRONLY | os.O_NONBLOCK), b'x')):\n"
                   "    try:\n        act()\n        print('reached')\n"
                   "    except OSError as e:\n        print(type(e).__name__)\n")
        assert r.output == "FileNotFoundError\nFileNotFoundError\n", r.output
        assert os.read(reader, 1) == b""  # (no writer ever opened it)
    finally:
        os.close(reader)
        server.close()
        shutil.rmtree(d)


@pytest.mark.timeout(30)
@ROOT_ONLY
def test_a_block_runs_as_nobody_and_takes_no_lease_lock_or_watch_on_the_callers_files_S29(sb, run_layout):
    """tests/faults.md S29: uid and gid 65534, no groups; the caller's run files cannot be
    locked, leased or watched (not there); a lease on a root-owned file it can see (the
    interpreter) is refused, EACCES: only a file's owner may take one (before: uid 0, all
    of them granted, so a block could stall the caller's appends until its timeout)."""
    target = os.path.join(run_layout[2], "runs/grpo/samples.jsonl")
    r = sb.run("import ctypes, fcntl, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(os.getuid(), os.getgid(), os.getgroups())\n"
               f"try:\n    fd = os.open({target!r}, os.O_RDONLY)\n"
               "    fcntl.flock(fd, fcntl.LOCK_EX)\n    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)\n"
               "    print('locked')\n"
               "except OSError as e:\n    print(type(e).__name__)\n"
               f"print(libc.inotify_add_watch(libc.inotify_init1(0), {target.encode()!r}, 0xfff), ctypes.get_errno())\n"
               "fd = os.open(os.path.realpath(sys.executable), os.O_RDONLY)\n"
               "try:\n    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)\n    print('leased')\n"
               "except OSError as e:\n    print(e.strerror)\n")
    assert r.output == "65534 65534 []\nFileNotFoundError\n-1 2\nPermission denied\n", r.output


@pytest.mark.timeout(120)
def test_orphans_are_reaped_like_plain_python_S30(tmpdir_for_blocks):
    """tests/faults.md S30: 200 `subprocess.run("true &", shell=True)`: each `true` is
    orphaned in the block's PID namespace, whose init reaps it, so the block ends as plain
    Python does (before: init was `cat`, the zombies piled up past the cgroup's 128 tasks
    and a fork failed, or the fork-bomb count stopped the block)."""
    code = ("import subprocess\nfor _ in range(200):\n    subprocess.run('true &', shell=True, check=True)\n"
            "print('done')\n")
    assert _python_u(code).stdout == "done\n"
    with Sandbox(workers=1, timeout=60) as box:
        r = box.run(code)
    assert (r.status, r.output) == ("ok", "done\n")


@pytest.mark.timeout(60)
@ROOT_ONLY
def test_a_pooled_cgroup_shows_no_earlier_blocks_peak_memory_S31(tmpdir_for_blocks):
    """tests/faults.md S31: one block touches 300 MiB, the next prints a number; the peak of
    the cgroup they shared (reused from the pool) after the second is the second's, under
    100 MiB (before: the first's, >= 300 MiB)."""
    with Sandbox(workers=1, timeout=20, memory_mb=0) as box:
        assert box.run("x = b'x' * (300 << 20)\nprint(len(x) >> 20)").output == "300\n"
        assert box.run("print(1)").output == "1\n"
        peaks = [int(open(f"{d}/memory.max_usage_in_bytes").read()) for g in box._cgroups for d in g
                 if os.path.exists(f"{d}/memory.max_usage_in_bytes")]
    if not peaks:
        pytest.skip("no cgroup v1 memory hierarchy here (v2 resets a peak only per open file)")
    assert len(peaks) == 1 and peaks[0] < 100 << 20, peaks


@pytest.mark.timeout(60)
def test_stateful_block_after_one_that_closed_every_fd_gets_its_own_timeout_and_output_S32(sb_quick):
    """tests/faults.md S32: an earlier block calls os.closerange(3, 65536), another closes
    fd 4095; nine trivial blocks follow. The next block, replaying them, prints, then
    sleeps past its 1 s timeout: it is stopped at its own timeout, with its output (before:
    after the replay's 11 x 1 s, or with no output). The bound, 6 s, is 5 s from both."""
    rs = _trajectory(sb_quick, ["import os\nos.closerange(3, 65536)\nx = 1",
                                "import os\ntry:\n    os.close(4095)\nexcept OSError:\n    pass\ny = 2"]
                     + ["z = 0"] * 9 + ["import time\nprint(x + y, flush=True)\ntime.sleep(60)"])
    r = rs[-1]
    assert r.status == "timeout" and r.output.startswith("3\n"), r.output
    assert r.seconds < 6, r.seconds


@pytest.mark.timeout(30)
def test_a_block_that_sigkills_itself_is_killed_not_out_of_memory_S33(sb):
    """tests/faults.md S33: SIGKILL from the block itself is status `killed`; `memory` only
    when the kernel's OOM killer acted (its cgroup's oom_kill count rose: S22's test)."""
    r = sb.run("import os, signal\nprint('up', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    assert (r.status, r.output) == ("killed", "up\nProcess killed by signal SIGKILL (Killed).")


@pytest.mark.timeout(60)
@ROOT_ONLY
def test_a_shadowed_mount_leaves_blocks_contained_S34(tmp_path):
    """tests/faults.md S34: in a mount namespace where a tmpfs over a folder hides a mount
    below it, the sandbox still contains its blocks: a block's rmtree of the caller's
    folder finds nothing to delete (before: the template's remount of the hidden mount
    failed, and every block ran uncontained, as root)."""
    (tmp_path / "keep").write_text("keep")
    hidden = tmp_path / "shadow" / "x" / "ro"
    hidden.mkdir(parents=True)
    block = (f"import os, shutil\nshutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n"
             f"print(os.getuid(), os.path.exists({str(tmp_path)!r}))")
    code = ("import executor as ex\nex._libc('unshare', ex._NEWNS)\nex._mount(None, b'/', None, 1 << 14 | 1 << 18)\n"
            f"ex._mount(b'tmpfs', {str(hidden).encode()!r}, b'tmpfs', 0)\n"
            f"ex._mount(b'tmpfs', {str(tmp_path / 'shadow').encode()!r}, b'tmpfs', 0)\n"
            "with ex.Sandbox(workers=1, timeout=10) as sb:\n"
            f"    r = sb.run({block!r})\n    print(sb.contained, r.output, end='')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert (p.stdout, p.stderr) == ("True 65534 False\n", ""), p.stdout + p.stderr
    assert (tmp_path / "keep").read_text() == "keep"


@pytest.mark.timeout(60)
@ROOT_ONLY
def test_a_mount_inside_a_bound_folder_shows_in_the_blocks_root_S44(tmp_path):
    """tests/faults.md S44: the interpreter's site-packages a mount of its own inside its bound
    venv (a volume) holds its files in the block's root, read-only (before: only the venv was
    bound, alone, so site-packages was the empty folder below the mount: ModuleNotFoundError)."""
    shutil.copy(os.path.join(ROOT, "executor.py"), tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True, timeout=50)
    site = glob.glob(str(tmp_path / ".venv/lib/python*/site-packages"))[0]
    block = "import s44_probe, os\nprint(s44_probe.VALUE, os.access(s44_probe.__file__, os.W_OK))"
    code = ("import executor as ex\nex._libc('unshare', ex._NEWNS)\nex._mount(None, b'/', None, 1 << 14 | 1 << 18)\n"
            f"ex._mount(b'tmpfs', {site.encode()!r}, b'tmpfs', 0)\n"
            f"open({site + '/s44_probe.py'!r}, 'w').write('VALUE = 44\\n')\n"
            "with ex.Sandbox(workers=1, timeout=10) as sb:\n"
            f"    r = sb.run({block!r})\n    print(sb.contained, r.status, r.output, end='')\n")
    p = subprocess.run([str(tmp_path / ".venv/bin/python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=50)
    assert (p.stdout, p.stderr) == ("True ok 44 False\n", ""), p.stdout + p.stderr


@pytest.mark.timeout(60)
@ROOT_ONLY
def test_a_root_caller_that_cannot_contain_blocks_stops_unless_it_asked_S35():
    """tests/faults.md S35: a root caller without CAP_SYS_ADMIN (dropped from its bounding
    set: the template cannot unshare) gets a SandboxError at start; with
    allow_uncontained=True the blocks run, uncontained, and a warning says so (before:
    every block ran uncontained after one warning line)."""
    code = ("import executor as ex\nex._LIBC.prctl(24, 21, 0, 0, 0)  # PR_CAPBSET_DROP, CAP_SYS_ADMIN\ntry:\n"
            "    ex.Sandbox(workers=1, timeout=5)\n    print('started')\nexcept ex.SandboxError as e:\n"
            "    print('SandboxError', 'allow_uncontained=True' in str(e))\n"
            "with ex.Sandbox(workers=1, timeout=5, allow_uncontained=True) as sb:\n"
            "    print(sb.contained, sb.run('print(1)').output, end='')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert p.stdout == "SandboxError True\nFalse 1\n", p.stdout + p.stderr
    assert p.stderr.startswith("executor.py: warning: blocks are not contained, as asked (cannot build"), p.stderr


# -----------------------------------------------------------------------------
# Who the caller is (faults S41, S43), stateful blocks that would forge (S40), Python's own
# threads and /etc (S42)

USER = 4242  # an unprivileged uid and gid of this machine (no account needed)


def _open_to_others(paths):
    """In this process's own mount namespace (root): every folder above `paths` (folders or files)
    that others may not enter (a 0700 home holding the interpreter, a 0700 clone) is covered by a
    tmpfs showing only the branches down to them, so that an unprivileged uid reaches the
    interpreter and the files it runs."""
    paths = [os.path.realpath(p) for p in paths]
    for path in paths:
        parts = path.split("/")
        for i in range(2, len(parts)):
            top = "/".join(parts[:i])
            if os.stat(top).st_mode & 0o001:
                continue
            branches = {"/".join(p.split("/")[:i + 1]) for p in paths if p.startswith(top + "/")}
            held = {b: os.open(b, os.O_PATH) for b in branches}  # (before the tmpfs hides them)
            ex._mount(b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=755")
            for branch, fd in held.items():
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(branch)
                else:
                    open(branch, "x").close()  # a file is bound over a file
                ex._mount(f"/proc/self/fd/{fd}".encode(), branch.encode(), None, ex._BIND | 1 << 14)
                os.close(fd)


def _as_user(no_user_namespaces=False):
    """A preexec_fn: the child drops to uid and gid USER (after _open_to_others, in a mount
    namespace of its own); with no_user_namespaces, a seccomp filter refuses it user namespaces
    (as a sysctl or a container's seccomp does)."""
    def drop():
        ex._libc("unshare", ex._NEWNS)
        ex._mount(None, b"/", None, 1 << 14 | 1 << 18)  # MS_REC | MS_PRIVATE
        _open_to_others([sys.base_prefix, sys.prefix, f"{ROOT}/tests/sandbox_caller.py", f"{ROOT}/executor.py"])
        if no_user_namespaces:
            ex._no_user_namespaces()
        os.setgroups([])
        os.setgid(USER)
        os.setuid(USER)
    return drop


def _caller(blocks, preexec_fn, **kwargs):
    """tests/sandbox_caller.py run with preexec_fn -> (its JSON answer, its stderr)."""
    job = json.dumps({"blocks": blocks, "kwargs": kwargs})
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sandbox_caller.py"), job], cwd="/",
                       preexec_fn=preexec_fn, capture_output=True, text=True, timeout=100,
                       env={"PATH": "/usr/bin:/bin"})
    assert p.stdout, p.stderr
    return json.loads(p.stdout), p.stderr


@pytest.mark.timeout(120)
@ROOT_ONLY  # (root makes the unprivileged caller)
def test_a_caller_that_is_not_root_gets_contained_blocks_S43(tmp_path):
    """tests/faults.md S43: a caller of uid USER gets its blocks contained through a user
    namespace: its own file (0600) and the project are not in the block's root, the block is
    pid 2 of its own namespace with no capability and no network, and a loop is stopped at its
    timeout (before: every block ran as the caller, seeing all it could read)."""
    secret = tmp_path / "key"
    secret.write_text("gold")
    os.chown(secret, USER, USER)
    secret.chmod(0o600)
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path.parent, 0o755)
    blocks = ["import os, socket\nstatus = open('/proc/self/status').read()\n"
              "print(os.getpid(), status.split('CapEff:')[1].split()[0], [n for i, n in socket.if_nameindex()])",
              # the project's files, not its folder: a venv inside the project (CI's .venv) is bound there alone
              f"import os\nprint([os.path.exists(p) for p in ({str(secret)!r}, {ROOT + '/data'!r}, "
              f"{ROOT + '/executor.py'!r})])", "while True: pass"]
    answer, err = _caller(blocks, _as_user(), timeout=2)
    assert answer == {"contained": True, "results": [["ok", "2 0000000000000000 ['lo']\n"],
                                                     ["ok", "[False, False, False]\n"],
                                                     ["timeout", answer["results"][2][1]]]}, (answer, err)
    assert 'File "<code>", line 1' in answer["results"][2][1]


@pytest.mark.timeout(120)
@ROOT_ONLY
def test_a_caller_that_is_not_root_without_user_namespaces_is_refused_at_start_S43():
    """tests/faults.md S43: where no user namespace can be made (here a seccomp filter), Sandbox()
    refuses in one line naming the cause and the opt-out; with allow_uncontained the blocks run,
    uncontained, and a warning says so (before: they ran uncontained, silently)."""
    answer, err = _caller(["print(1)"], _as_user(no_user_namespaces=True))
    assert "no user namespace can be made" in answer["error"] and "allow_uncontained=True" in answer["error"], answer
    assert "\n" not in answer["error"]
    answer, err = _caller(["print(1)"], _as_user(no_user_namespaces=True), allow_uncontained=True)
    assert answer == {"contained": False, "results": [["ok", "1\n"]]}, (answer, err)
    assert "blocks are not contained, as asked (no user namespace" in err, err


def _without_setuid():
    ex._LIBC.prctl(24, 7, 0, 0, 0)  # PR_CAPBSET_DROP, CAP_SETUID: not even root's exec gets it back


def _root_of_a_user_namespace():
    ex._libc("unshare", ex._NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", "0 0 1"), ("gid_map", "0 0 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


@pytest.mark.timeout(120)
@ROOT_ONLY
@pytest.mark.parametrize("preexec_fn,says", [(_without_setuid, "root without CAP_SETUID"),
                                             (_root_of_a_user_namespace, "uid_map does not map 65534")],
                         ids=["no-cap-setuid", "userns-maps-only-root"])
def test_a_root_caller_whose_blocks_cannot_become_nobody_is_refused_at_start_S41(preexec_fn, says):
    """tests/faults.md S41: Sandbox() refuses, naming the capability or the mapping (before: it
    started, and the first run() raised `could not start a block: PermissionError(1, ...)`)."""
    answer, err = _caller(["print(1)"], preexec_fn)
    assert says in answer.get("error", "") and "allow_uncontained=True" in answer["error"], (answer, err)


@pytest.mark.timeout(60)
def test_a_stateful_block_cannot_stretch_a_later_blocks_time_or_run_in_its_stead_S40(sb_quick):
    """tests/faults.md S40: a replayed block that rebinds os.write (the start of a block's own
    time limit), this module's _execute or builtins.exec changes nothing of a later block (before:
    a 3 s sleep under a 1 s limit ended ok; the later blocks printed 'forged' without running)."""
    rs = _trajectory(sb_quick, ["import os\nos.write = lambda fd, data: len(data)", "x = 1", "y = 2",
                                "import time\ntime.sleep(3)\nprint('slept')"])
    assert rs[-1].status == "timeout", rs[-1]
    for forge in ("import sys\nsys.modules['executor']._execute = lambda *a, **k: print('forged')",
                  "import builtins\nbuiltins.exec = lambda *a: print('forged')"):
        assert _trajectory(sb_quick, [forge, "print(1 + 1)"])[-1].output == "2\n"


@pytest.mark.timeout(60)
def test_a_block_reads_os_release_resolves_localhost_and_starts_400_threads_S42(sb):
    """tests/faults.md S42: as `python block.py` does (before: no /etc/os-release, no /etc/hosts,
    and 128 threads hit the address-space limit or counted as a fork bomb)."""
    code = ("import socket, threading\nprint(open('/etc/os-release').read().startswith(('NAME=', 'PRETTY_NAME=')))\n"
            "print(socket.getaddrinfo('localhost', 80, socket.AF_INET)[0][4])\n"
            "for n in (128, 400):\n    go = threading.Event()\n"
            "    threads = [threading.Thread(target=go.wait) for _ in range(n)]\n"
            "    for t in threads:\n        t.start()\n"
            "    go.set()\n    for t in threads:\n        t.join()\n    print(n, 'threads')\n")
    r = sb.run(code)
    assert (r.status, r.output) == ("ok", "True\n('127.0.0.1', 80)\n128 threads\n400 threads\n"), r.output
