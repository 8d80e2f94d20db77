"""The code sandbox against hostile programs: each is contained, fails, and finishes in seconds."""

import os
import resource
import socket
import textwrap
import threading
import time

import pytest

from rlframe.reward.sandbox import DEFAULT_UID_BASE, Sandbox, SandboxLimits, outputs_match

LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=2.0, memory_bytes=512 << 20, max_processes=8)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(max_concurrency=2, limits=LIMITS)


@pytest.fixture(scope="module")
def hooked():
    """The fallback path, forced: no namespaces, the audit hook refuses sockets and writes."""
    return Sandbox(max_concurrency=2, limits=LIMITS, network="hook", privileges="keep", allow_unisolated=True)


def run(sandbox, code, **kwargs):
    start = time.monotonic()
    result = sandbox.run(textwrap.dedent(code), **kwargs)
    assert time.monotonic() - start < 10, "every execution must finish in seconds"
    return result


def test_isolation_report(sandbox, hooked):
    print("active isolation:", sandbox.isolation)
    assert sandbox.isolation["rlimits"]
    assert sandbox.isolation["netns"] or sandbox.isolation["audit_hook"]
    if os.geteuid() == 0:
        assert sandbox.isolation["uid"]
    assert hooked.isolation["audit_hook"] and not hooked.isolation["netns"]


def test_well_behaved_program_passes(sandbox):
    result = run(sandbox, "a, b = map(int, input().split())\nprint(a + b)", stdin="2 3\n",
                 expected_stdout="5")
    assert result.verdict == "passed", result.stderr
    assert result.exit_code == 0 and result.stdout == "5\n" and result.duration_s < 5
    assert run(sandbox, "print(4)", expected_stdout="5").verdict == "failed"
    assert run(sandbox, "raise SystemExit(3)").exit_code == 3
    assert run(sandbox, "1/0").verdict == "failed"
    assert run(sandbox, "import json, math, itertools; print(math.comb(5, 2))",
               expected_stdout="10\n\n").verdict == "passed"


def test_program_may_use_its_own_directory(sandbox):
    result = run(sandbox, """
        open("notes.txt", "w").write("hello")
        print(open("notes.txt").read())
        """, expected_stdout="hello")
    assert result.verdict == "passed", result.stderr


def test_infinite_loop_times_out(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert result.verdict == "timeout" and not result.passed
    assert result.duration_s < LIMITS.wall_time_s + 2


def test_sleeping_program_times_out_on_the_wall_clock(sandbox):
    result = run(sandbox, "import time\ntime.sleep(1000)")
    assert result.verdict == "timeout"
    assert LIMITS.wall_time_s - 0.5 < result.duration_s < LIMITS.wall_time_s + 2


def test_fork_bomb_is_contained(sandbox):
    before = len(os.listdir("/proc"))
    result = run(sandbox, """
        import os
        while True:
            os.fork()
        """)
    assert result.verdict in ("failed", "timeout") and not result.passed
    time.sleep(0.2)
    assert len(os.listdir("/proc")) < before + 20  # nothing left behind
    # the next program in the same slot can still start and fork once
    result = run(sandbox, "import os\npid = os.fork()\nif pid == 0: os._exit(0)\nos.wait()\nprint('ok')",
                 expected_stdout="ok")
    assert result.verdict == "passed", result.stderr


def test_huge_allocation_fails(sandbox):
    result = run(sandbox, "x = bytearray(50 * 2**30)\nprint('allocated')")
    assert result.verdict == "failed"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


@pytest.mark.parametrize("target", ["/tmp/escape_x", "/etc/escape_x", "../escape_x"])
def test_writing_outside_its_directory_fails(sandbox, target):
    result = run(sandbox, f"open({target!r}, 'w').write('x')\nprint('wrote')")
    assert result.verdict == "failed", result.stdout
    assert not os.path.exists("/tmp/escape_x") and not os.path.exists("/etc/escape_x")


def test_file_size_limit(sandbox):
    limits = sandbox.with_limits(max_file_bytes=1 << 20)
    result = run(sandbox, "open('big', 'wb').write(b'x' * (8 << 20))\nprint('wrote')", limits=limits)
    assert result.verdict == "failed" and "wrote" not in result.stdout


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    accepted = []
    server.settimeout(5)

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    server.close()


@pytest.mark.parametrize("which", ["sandbox", "hooked"])
def test_no_network(request, which, listening_port):
    port, accepted = listening_port
    result = run(request.getfixturevalue(which), f"""
        import socket
        s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
        print("connected")
        """)
    assert result.verdict == "failed" and "connected" not in result.stdout
    assert not accepted


def test_parent_environment_is_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("RLFRAME_TEST_SECRET", "hunter2")
    result = run(sandbox, """
        import os
        assert "RLFRAME_TEST_SECRET" not in os.environ, "env leaked"
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    assert b"hunter2" not in open(f"/proc/{pid}/environ", "rb").read(), pid
                except OSError:
                    pass
        print(sorted(os.environ))
        """)
    assert result.verdict == "passed", result.stderr
    assert "hunter2" not in result.stdout
    assert eval(result.stdout) == ["HOME", "LANG", "PATH"]  # our own output: a list literal
    # the read itself is refused outright: the secret is in this process's environment
    result = run(sandbox, f"print(open('/proc/{os.getpid()}/environ', 'rb').read())")
    assert result.verdict == "failed" and "hunter2" not in result.stdout


def test_hook_fallback_refuses_writes_outside(hooked):
    assert run(hooked, "open('/tmp/escape_x', 'w')").verdict == "failed"
    assert not os.path.exists("/tmp/escape_x")
    assert run(hooked, "open('ok.txt', 'w').write('1')\nprint(1)", expected_stdout="1").passed


def test_output_is_capped(sandbox):
    limits = sandbox.with_limits(max_output_bytes=1000)
    result = run(sandbox, "print('y' * 10**7)", limits=limits)
    assert result.truncated and len(result.stdout) == 1000


def test_workdir_is_removed_and_fresh(sandbox):
    import tempfile
    before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("rlframe-sandbox-")}
    first = run(sandbox, "import os\nopen('left.txt', 'w').write('1')\nprint(os.listdir('.'))")
    second = run(sandbox, "import os\nprint(os.listdir('.'))")
    assert "left.txt" in first.stdout and "left.txt" not in second.stdout
    after = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("rlframe-sandbox-")}
    assert after <= before


def test_concurrent_runs(sandbox):
    """Two slots run two programs at once: their [start, end] intervals overlap. (Structural, not timed:
    under a loaded machine the wall clock of each run varies; the limits are generous for the same reason.)"""
    roomy = SandboxLimits(wall_time_s=60.0, cpu_time_s=30.0, memory_bytes=512 << 20, max_processes=8)
    code = "import time\nstart = time.time()\ntime.sleep(1)\nprint(start, time.time())"
    results = sandbox.run_many([{"code": code, "limits": roomy} for _ in range(4)])
    assert [r.verdict for r in results] == ["passed"] * 4, [(r.verdict, r.stderr[-300:]) for r in results]
    spans = sorted(tuple(map(float, r.stdout.split())) for r in results)
    overlapping = sum(1 for (s1, e1), (s2, _) in zip(spans, spans[1:]) if s2 < e1)
    assert overlapping >= 1, spans  # with one slot the spans would follow each other


def test_host_unaffected():
    """The host's own limits are untouched by the child's rlimits."""
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY


def test_outputs_match():
    assert outputs_match("1\n2  \n\n", "1\n2")
    assert outputs_match("a\r\nb\r\n", "a\nb\n")
    assert not outputs_match("1 2", "12")


def test_sandboxes_die_with_their_parent(tmp_path):
    """A reward worker killed mid-run (its timeout) leaves no sandboxed program behind: neither launcher, nor the
    program it forked (before or after that program's exec), nor a process under the programs' dropped uids."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        from rlframe.reward.sandbox import Sandbox, SandboxLimits
        sb = Sandbox(max_concurrency=2, limits=SandboxLimits(wall_time_s=100, cpu_time_s=100))
        sb.run_many([{"code": "import time\\ntime.sleep(1000)"}] * 2)
        """))
    parent = subprocess.Popen([sys.executable, str(script)])
    marker = f'"parent_pid": {parent.pid}'.encode()
    dropped_uids = range(DEFAULT_UID_BASE + parent.pid * 256, DEFAULT_UID_BASE + parent.pid * 256 + 256)

    def processes():
        """pid -> (parent pid, start time, command line, uid) of every live process (zombies are dead)."""
        table = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{pid}/stat").read()
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ..., starttime (the 20th)
            if fields[0] not in ("Z", "X"):
                table[int(pid)] = (int(fields[1]), fields[19], cmdline, uid)
        return table

    def launchers(table):
        """This parent's launchers. A launcher's forked pid 1 carries the launcher's command line until it execs:
        a "launcher" whose parent is a launcher is that child, not one more sandbox."""
        def looks_like_launcher(pid):
            return pid in table and b"--launch" in table[pid][2] and marker in table[pid][2]
        return [pid for pid in table if looks_like_launcher(pid) and not looks_like_launcher(table[pid][0])]

    def started(table):
        """(pid, start time) of both sandboxes' launchers and programs once both programs run (their launcher's
        child has exec'd the interpreter; as root, under its dropped uid), else None."""
        tops = launchers(table)
        programs = [pid for pid, (ppid, _, cmdline, uid) in table.items()
                    if ppid in tops and b"--launch" not in cmdline and (os.geteuid() != 0 or uid in dropped_uids)]
        if len(tops) != 2 or len(programs) != 2:
            return None
        return {(pid, table[pid][1]) for pid in tops + programs}

    def survivors():
        table = processes()
        recorded = [pid for pid, start in sandboxes if pid in table and table[pid][1] == start]
        dropped = [pid for pid, (_, _, _, uid) in table.items() if uid in dropped_uids]
        return sorted(set(recorded + launchers(table) + dropped))

    deadline = time.monotonic() + 20
    sandboxes = started(processes())
    while sandboxes is None and time.monotonic() < deadline:
        time.sleep(0.1)
        sandboxes = started(processes())
    assert sandboxes is not None, "the sandboxes did not start"
    assert len(sandboxes) == 4 and len(survivors()) == 4  # 2 launchers + 2 programs, all seen
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and survivors():
        time.sleep(0.1)
    assert survivors() == []


def test_host_files_are_not_there(sandbox):
    """The root is built from an allow-list (interpreter, standard library, /dev/null): a "solution" cannot
    look its answer up in a host file (training data, /etc/passwd, this repository), and through the code
    reward such a lookup scores 0, not 1."""
    import importlib.util
    import json

    host_files = ["/etc/passwd", os.path.abspath(__file__)]
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "gsm8k", "train.jsonl")
    host_files += [os.path.realpath(shared)] if os.path.exists(shared) else []
    for path in host_files:
        assert os.access(path, os.R_OK)
        result = run(sandbox, f"print(open({path!r}).readline())")
        assert result.verdict == "failed" and "No such file" in result.stderr, (path, result.stdout[:200])
    if sandbox.isolation["mountns"]:
        listing = run(sandbox, "import os; print(sorted(os.listdir('/')))")
        assert set(eval(listing.stdout)) <= {"dev", "lib", "lib64", "usr", "proc", "tmp", "root", "opt", "home"}
        assert run(sandbox, "import hashlib, json, decimal, sqlite3; print(json.dumps([1]))",
                   expected_stdout="[1]").passed  # the standard library still works, extension modules too
    spec = importlib.util.spec_from_file_location("code_reward", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "reward_fns", "code.py"))
    code_reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_reward)
    first_line = open(__file__).readline()
    solution = f"```python\nprint(open({os.path.abspath(__file__)!r}).readline(), end='')\n```"
    out = code_reward.compute_score("code", solution, json.dumps({"inputs": ["\n"], "outputs": [first_line]}))
    assert out["score"] == 0.0 and out["verdict"] == "failed"


def test_no_nested_user_namespaces(sandbox, hooked):
    """A program cannot make a user namespace of its own (where it would be root): unshare, clone refused."""
    code = """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.unshare(0x10000000), ctypes.get_errno() == 1)
        print(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) if os.uname().machine == "x86_64" else -1)
        """
    for box in (sandbox, hooked):
        if box.isolation.get("no_userns", True) is False:  # an architecture whose system calls we do not know
            continue
        result = run(box, code)
        if box is hooked:  # the audit hook refuses ctypes outright
            assert result.verdict == "failed" and "ctypes" in result.stderr
            continue
        assert result.stdout.split() == ["-1", "True", "-1"], (result.stdout, result.stderr)
