"""Attacks on the code sandbox, run by tests/test_sandbox_isolation.py as an unprivileged user (uid 65534).

    python helpers_sandbox_probe.py '{"checkout": ..., "victim": ..., "train": ..., "answer": ...}'

Prints one JSON object: the sandbox's mode and isolation, or the refusal's message; then for each attack what the
sandboxed program printed and its verdict; and the code reward's score for a "solution" that reads its answer from
the training file. Imports the standard library and the checkout's sandbox only (no site-packages needed).
"""

import json
import os
import sys

args = json.loads(sys.argv[1])
sys.path.insert(0, args["checkout"])
os.environ["RLFRAME_PROBE_SECRET"] = "hunter2-probe"  # in this process's environment: /proc/<pid>/environ

from rlframe.reward.sandbox import Sandbox, SandboxLimits, SandboxUnisolatedError  # noqa: E402

def load_code_reward():
    import importlib.util

    spec = importlib.util.spec_from_file_location("code_reward", os.path.join(args["checkout"], "reward_fns", "code.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = {"uid": os.getuid()}
if args.get("allow_unisolated"):  # as reward.sandbox.allow_unisolated=true does for the reward workers
    os.environ["RLFRAME_SANDBOX_ALLOW_UNISOLATED"] = "1"
cheat = ("```python\nimport json\nprint(json.loads(open(%r).readline())['answer'])\n```" % args["train"])
tests = json.dumps({"inputs": ["\n"], "outputs": [args["answer"]]})
try:
    box = Sandbox(max_concurrency=2, limits=SandboxLimits(wall_time_s=10, cpu_time_s=5, memory_bytes=512 << 20),
                  allow_unisolated=args.get("allow_unisolated", False))
except SandboxUnisolatedError as error:
    report["refused"] = str(error)
    try:
        load_code_reward().compute_score("code", cheat, tests)
    except SandboxUnisolatedError as error:
        report["code_reward_refused"] = str(error)
    if args.get("config_check"):  # the run's own check, before any worker (needs the site-packages on the path)
        import site
        from types import SimpleNamespace

        for folder in args["site_dirs"]:  # (with their .pth files: the editable install maps rlframe.workers)
            site.addsitedir(folder)

        from rlframe.config.reward import sandbox_isolates

        problems = []
        code_py = os.path.join(args["checkout"], "reward_fns", "code.py")
        cfg = SimpleNamespace(reward=SimpleNamespace(functions=[SimpleNamespace(path=code_py)],
                                                     sandbox=SimpleNamespace(allow_unisolated=False)))
        sandbox_isolates(cfg, lambda ok, key, message: ok or problems.append((key, message)))
        report["config_problems"] = problems
else:
    report["mode"], report["isolation"] = box.mode, box.isolation
    checkout_file = os.path.join(args["checkout"], "tests", "test_sandbox.py")
    attacks = {
        "passwd": "print(open('/etc/passwd').read())",
        "checkout": f"print(open({checkout_file!r}).read())",
        "checkout_listing": f"import os; print(os.listdir({args['checkout']!r}))",
        "parent_environ": f"print(open('/proc/{os.getpid()}/environ', 'rb').read())",
        "pid1_environ": "print(open('/proc/1/environ', 'rb').read())",
        "any_environ": ("import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try: "
                        "print(open(f'/proc/{p}/environ', 'rb').read())\n        except OSError: pass"),
        "remove": f"import os; os.remove({args['victim']!r}); print('removed')",
        "rename": f"import os; os.rename({args['victim']!r}, {args['victim'] + '.moved'!r}); print('renamed')",
        "train": f"print(open({args['train']!r}).read())",
    }
    report["attacks"] = {}
    for name, code in attacks.items():
        result = box.run(code)
        report["attacks"][name] = {"verdict": result.verdict, "stdout": result.stdout[:2000],
                                   "stderr": result.stderr[-600:]}
    out = load_code_reward().compute_score("code", cheat, tests)
    report["cheat_score"], report["cheat_verdict"] = out["score"], out["verdict"]
    report["sandbox_isolated"] = out["sandbox_isolated"]
report["victim_exists"] = os.path.exists(args["victim"])
print(json.dumps(report))
