"""An agent program's environment: an allow-list of ours plus the gateway's OPENAI_BASE_URL / OPENAI_API_KEY, so
rlframe's HF / W&B / cloud keys (and the user's own OpenAI key) do not reach it; inherit_env opts into all. A real
command agent run by AgentEpisodes on the HF engine (tiny random model)."""

from __future__ import annotations

import json
import sys

from test_gateway import engine, episodes_runner, prompt_batch  # noqa: F401 (engine: the module's fixture)

DUMP = ("import json, os, sys; row = json.load(sys.stdin); "
        "open(sys.argv[1] + '/env-%d.json' % row['index'], 'w').write(json.dumps(dict(os.environ))); print('done')")


def run_agent(engine, tiny_model_dir, tmp_path, **program) -> list[dict]:  # noqa: F811
    from rlframe.workers.settings import SamplingSettings

    out = tmp_path / f"env-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    command = f"{sys.executable} -c {json.dumps(DUMP)} {out}"
    runner = episodes_runner(engine, tiny_model_dir, tmp_path / "record", command=command, **program)
    runner.run(prompt_batch(engine[1], 2, engine[3]), SamplingSettings(max_new_tokens=8), {"validate": True})
    return [json.loads(path.read_text()) for path in sorted(out.glob("env-*.json"))]


def test_agent_sees_the_gateway_not_our_secrets(engine, tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HF_TOKEN", "hf-secret-x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-y")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-users-real-key")
    envs = run_agent(engine, tiny_model_dir, tmp_path)
    assert len(envs) == 2
    for env in envs:
        assert "HF_TOKEN" not in env and "AWS_SECRET_ACCESS_KEY" not in env, sorted(env)
        assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:") and env["OPENAI_API_KEY"] != "sk-users-real-key"
        assert "PATH" in env and "RLFRAME_EPISODE_ROW" in env
        assert set(env) <= {"HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ",
                            "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "NO_PROXY", "no_proxy", "OPENAI_BASE_URL",
                            "OPENAI_API_KEY", "RLFRAME_EPISODE_ROW", "PWD", "SHLVL", "_"}, sorted(env)
    assert envs[0]["OPENAI_API_KEY"] != envs[1]["OPENAI_API_KEY"]  # each episode its own key
    inherited = run_agent(engine, tiny_model_dir, tmp_path, inherit_env=True)
    assert all(env["HF_TOKEN"] == "hf-secret-x" and env["OPENAI_API_KEY"] != "sk-users-real-key" for env in inherited)
