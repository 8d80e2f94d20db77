"""The sandbox off root (run as uid 65534 through setpriv: a user namespace, or a refusal naming the key) and its
total memory and disk caps as root. The non-root runs need root here to switch to 65534; elsewhere they skip."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from rlframe.reward.sandbox import Sandbox, SandboxLimits, SandboxUnisolatedError

CHECKOUT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("helpers_sandbox_probe.py")
NOBODY = 65534
ANSWER = "4217"
root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                               reason="needs root (to become uid 65534 with setpriv)")


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def nobody_python() -> str:
    """An interpreter uid 65534 may run (and that may start itself again, as the sandbox does): this one unless it
    lives in root's home (pyenv), else the system's."""
    check = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        if os.path.exists(candidate) and subprocess.run(as_nobody(candidate, "-c", check), cwd="/",
                                                        capture_output=True).returncode == 0:
            return candidate
    pytest.skip("no Python interpreter that uid 65534 can run")


def nobody_env() -> dict:
    site = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
            "PYTHONPATH": os.pathsep.join([str(CHECKOUT), *site])}


@pytest.fixture
def targets():
    """A folder nobody may write in, holding a file of nobody's (the one an attack deletes) and a training file with
    the answer in it (the one a cheating "solution" reads)."""
    folder = tempfile.mkdtemp(prefix="rlframe-victims-")
    os.chmod(folder, 0o777)
    victim, train = os.path.join(folder, "victim.txt"), os.path.join(folder, "train.jsonl")
    Path(victim).write_text("keep me")
    Path(train).write_text(json.dumps({"question": "the number?", "answer": ANSWER}) + "\n")
    for path in (victim, train):
        os.chown(path, NOBODY, NOBODY)
    yield {"victim": victim, "train": train, "checkout": str(CHECKOUT), "answer": ANSWER}
    shutil.rmtree(folder, ignore_errors=True)


def probe(args: dict, launcher: list[str]) -> dict:
    done = subprocess.run([*launcher, str(PROBE), json.dumps(args)], capture_output=True, text=True, timeout=300,
                          cwd="/", env=nobody_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@root_only
def test_off_root_the_host_is_out_of_reach(targets):
    """As uid 65534 (a user namespace here): /etc/passwd, the checkout, the training file and other processes'
    environments are not there, an outside file cannot be removed or renamed, and the cheating solution scores 0
    through reward_fns/code.py. (On a kernel without user namespaces: the refusal, naming the key.)"""
    report = probe(targets, as_nobody(nobody_python()))
    print("non-root sandbox:", report.get("isolation") or report.get("refused"))
    assert report["uid"] == NOBODY
    if "refused" in report:
        assert "reward.sandbox.allow_unisolated" in report["refused"]
        return
    assert report["mode"] == "userns" and report["isolation"]["mountns"] and report["isolation"]["pidns"]
    attacks = report["attacks"]
    for name in ("passwd", "checkout", "checkout_listing", "train", "parent_environ", "remove", "rename"):
        assert attacks[name]["verdict"] == "failed", (name, attacks[name])
        assert "No such file" in attacks[name]["stderr"], (name, attacks[name])
    everything = json.dumps(attacks)
    assert "hunter2-probe" not in everything and "root:x:0:0" not in everything and ANSWER not in everything
    assert attacks["pid1_environ"]["verdict"] == "passed"  # pid 1 of its own namespace: the program itself
    assert b"RLFRAME_PROBE_SECRET" not in attacks["any_environ"]["stdout"].encode()
    assert report["victim_exists"]
    assert report["cheat_score"] == 0.0 and report["cheat_verdict"] == "failed"
    assert report["sandbox_isolated"] == 1.0


@root_only
def test_sandbox_suite_passes_as_nonroot():
    """tests/test_sandbox.py itself, run by uid 65534: every hostile-program test holds off root too."""
    done = subprocess.run(as_nobody(nobody_python(), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    str(CHECKOUT / "tests" / "test_sandbox.py")),
                          capture_output=True, text=True, timeout=600, cwd="/", env=nobody_env())
    print(done.stdout[-1500:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


@root_only
def test_without_user_namespaces_code_rewards_refuse(targets):
    """A kernel that refuses unprivileged user namespaces (here: a seccomp filter, inherited, refusing them to
    uid 65534): the sandbox, the code reward and the run's config check refuse, naming
    reward.sandbox.allow_unisolated; allowed, the audit hook still stops the reads and the os.remove."""
    python = nobody_python()
    launcher = [python, "-c", textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(CHECKOUT)!r})
        from rlframe.reward.sandbox_launcher import _refuse_new_user_namespaces
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
        _refuse_new_user_namespaces()
        os.execv({python!r}, [{python!r}, *sys.argv[1:]])
        """)]
    site_dirs = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    report = probe({**targets, "config_check": True, "site_dirs": site_dirs}, launcher)
    assert report["uid"] == NOBODY and "refused" in report, report
    for message in (report["refused"], report["code_reward_refused"]):
        assert "reward.sandbox.allow_unisolated=true" in message
    assert [key for key, _ in report["config_problems"]] == ["reward.sandbox.allow_unisolated"]
    allowed = probe({**targets, "allow_unisolated": True}, launcher)
    assert allowed["mode"] == "none" and allowed["isolation"]["audit_hook"]
    for name in ("passwd", "checkout", "train", "parent_environ", "remove", "rename"):
        assert allowed["attacks"][name]["verdict"] == "failed", (name, allowed["attacks"][name])
        assert "sandbox:" in allowed["attacks"][name]["stderr"], (name, allowed["attacks"][name])
    assert allowed["victim_exists"] and allowed["cheat_score"] == 0.0 and allowed["sandbox_isolated"] == 0.0


def test_forced_fallback_refuses_unless_allowed(monkeypatch):
    monkeypatch.delenv("RLFRAME_SANDBOX_ALLOW_UNISOLATED", raising=False)
    with pytest.raises(SandboxUnisolatedError, match=r"reward\.sandbox\.allow_unisolated=true"):
        Sandbox(network="hook", privileges="keep")
    monkeypatch.setenv("RLFRAME_SANDBOX_ALLOW_UNISOLATED", "1")
    assert not Sandbox(network="hook", privileges="keep").isolated


def _namespaced() -> Sandbox:
    box = Sandbox(max_concurrency=1)
    if not box.isolated:
        pytest.skip("no namespaces on this machine")
    return box


def test_total_memory_cap():
    """All of an execution's processes together stay within total_memory_bytes: with 2 x 256 MiB allowed, the
    program and one child each hold ~200 MiB, and a third process is refused (RLIMIT_NPROC = 2)."""
    box = _namespaced()
    limits = box.with_limits(memory_bytes=256 << 20, total_memory_bytes=512 << 20, max_processes=16,
                             wall_time_s=10, cpu_time_s=5)
    code = textwrap.dedent("""
        import os, time
        hold = bytearray(200 << 20)
        child = os.fork()
        if child == 0:
            more = bytearray(200 << 20); time.sleep(2); os._exit(0)
        try:
            os.fork() or os._exit(0)
            print("third process")
        except OSError as e:
            print("refused", e.errno)
        try:
            bytearray(200 << 20); print("allocated over the cap")
        except MemoryError:
            print("MemoryError")
        os.waitpid(child, 0)
        """)
    result = box.run(code, limits=limits)
    assert result.verdict == "passed", result.stderr
    assert result.stdout.split() == ["refused", "11", "MemoryError"], result.stdout
    assert "2 processes x 268435456" in Sandbox(max_concurrency=1, limits=limits).isolation["memory"]


def test_disk_cap_and_host_tmp_untouched():
    """The working directory is a tmpfs of max_disk_bytes: many files under the per-file limit fill it and then
    fail with ENOSPC; nothing lands in the host's /tmp."""
    box = _namespaced()
    limits = box.with_limits(max_disk_bytes=24 << 20, max_file_bytes=8 << 20, wall_time_s=10)
    before = shutil.disk_usage(tempfile.gettempdir()).used
    code = textwrap.dedent("""
        import errno
        written = 0
        try:
            for i in range(40):
                with open(f"f{i}", "wb") as f:
                    f.write(b"x" * (4 << 20))
                written += 4
        except OSError as e:
            print("stopped", written, errno.errorcode[e.errno])
        """)
    result = box.run(code, limits=limits)
    assert result.verdict == "passed", result.stderr
    words = result.stdout.split()
    assert words[0] == "stopped" and words[2] == "ENOSPC" and int(words[1]) <= 24, result.stdout
    assert shutil.disk_usage(tempfile.gettempdir()).used - before < 16 << 20
    assert box.isolation["disk"].startswith("tmpfs of ")
