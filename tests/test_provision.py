"""Model provisioning into the cache when several runs start at once (the test suite's parallel workers, two
users on one machine, nodes sharing a cache): each gets a complete folder, built once, none removed under another."""

from __future__ import annotations

import os
import subprocess
import sys

BUILD = ("import time; from rlframe.models import provision, tiny_vlm; "
         "real = tiny_vlm.build_tiny_vlm_dir\n"
         "def counted(path):\n"
         "    print('built', flush=True); time.sleep(1.0); return real(path)\n"
         "tiny_vlm.build_tiny_vlm_dir = counted\n"
         "print(provision.provision_tiny_vlm())")


def test_two_runs_provisioning_at_once_build_the_folder_once(tmp_path):
    env = {**os.environ, "RLFRAME_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-3000:]
    folders = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(folders) == 1
    assert sum(out.count("built") for out, _ in outputs) == 1  # the second waited for the first, then used its folder
    folder = tmp_path / "cache" / "models"
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(folders.pop()).model_type == "qwen2_5_vl"
    assert not [p for p in folder.iterdir() if p.name.startswith("tmp")]  # no staging folder left behind
