"""The Evaluate, Export and Chat tabs' work: `rlframe.eval` and `rlframe.export` as processes, chat in-process.

    eval_args(target, n=4, k="1,4", temperature=1.0, data="", reward="")  # -> rlframe.eval's key=value list
    run_tool(launcher, "rlframe.eval", args, log)    # its own process, waited for; (exit code, output)
    export_args(checkpoint, out_dir, merge)           # -> rlframe.export's arguments
    ChatModel(folder).reply(history, message)         # an HF folder (an export, a run's hf_model, a hub id)

Evaluation and export run as rlframe's own entry points (the same code and errors as the command line);
chat loads the model once in the board's process and answers with its chat template.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pandas as pd

from rlframe.board.security import BoardError

TOOL_TIMEOUT_S = 1800


def eval_args(target: str, n: int, k: str, temperature: float, data: str = "", reward: str = "",
              max_samples: int | None = None, out: Path | None = None) -> list[str]:
    """`run=<run folder>` (its own validation data, reward and settings) or `model=<folder>` (then data= and
    reward= are needed), with n samples per prompt, pass@k/mean@k/maj@k for k, the temperature."""
    target = target.strip()
    if not target:
        raise BoardError("pick a run folder or a model/checkpoint folder to evaluate")
    is_run = (Path(target) / "config.yaml").is_file() and (Path(target) / "owner.json").is_file()
    args = [f"run={target}" if is_run else f"model={target}", f"n={int(n)}", f"temperature={float(temperature)}"]
    if not is_run and not (data and reward):
        raise BoardError("model=<folder> needs the data and the reward to score it with. Fix: fill both, "
                         "or pick a run folder (its validation data and reward are used)")
    if k and str(k).strip():
        if not re.fullmatch(r"\d+(,\d+)*", str(k).replace(" ", "")):
            raise BoardError(f"k={k}: comma-separated whole numbers (e.g. 1,4)")
        args.append(f"k={str(k).replace(' ', '')}")
    if data:
        args.append(f"data={data}")
    if reward:
        args.append(f"reward={reward}")
    if max_samples:
        args.append(f"max_samples={int(max_samples)}")
    if out is not None:
        args += [f"out={out}", f"table={out.with_suffix('.md')}"]
    return args


def export_args(checkpoint: str, out_dir: Path, merge: bool) -> list[str]:
    if not checkpoint.strip():
        raise BoardError("pick a run folder (its newest complete checkpoint) or a checkpoint folder to export")
    return [checkpoint.strip(), str(out_dir), *(["--merge"] if merge else [])]


def run_tool(launcher, entry: str, args: list[str], log: Path, timeout: float = TOOL_TIMEOUT_S) -> tuple[int, str]:
    """Run an entry point to its end; (exit code, its output)."""
    proc = launcher.start(entry, args, log)
    try:
        code = proc.wait(timeout)
    except Exception:
        proc.kill()
        raise
    text = log.read_text(errors="replace")
    return code, text[text.rfind("--- "):]


def eval_table(output: str) -> pd.DataFrame:
    """The `metrics: {...}` line of rlframe.eval as a two-column table."""
    for line in reversed(output.splitlines()):
        if line.startswith("metrics: "):
            metrics = json.loads(line[len("metrics: "):])
            rows = [{"metric": k, "value": v} for k, v in metrics.items() if isinstance(v, (int, float))]
            return pd.DataFrame(rows, columns=["metric", "value"])
    return pd.DataFrame(columns=["metric", "value"])


def error_lines(output: str) -> str:
    """From `error: ...` to the end (an entry point's one-screen message), or ''."""
    at = output.find("error: ")
    return output[at:].strip() if at >= 0 else ""


class ChatModel:
    """An HF causal LM loaded once; `reply` answers the conversation with the model's chat template."""

    def __init__(self, folder: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlframe.models.provision import resolve_model_path

        self.folder = folder
        path = resolve_model_path(folder)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise BoardError(f"{folder} cannot be loaded as a Hugging Face model ({err}). Fix: pick an exported "
                             "folder, a run's hf_model, or a hub id") from None
        self.model.eval()
        self.lock = threading.Lock()

    def reply(self, history: list[dict], message: str, max_new_tokens: int = 128, temperature: float = 0.0) -> str:
        import torch

        messages = [{"role": m["role"], "content": content_text(m["content"])} for m in history
                    if m.get("role") in ("user", "assistant")]
        messages.append({"role": "user", "content": message})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)
        sampling = {"do_sample": True, "temperature": float(temperature)} if temperature > 0 else {"do_sample": False}
        with self.lock, torch.no_grad():
            out = self.model.generate(**ids, max_new_tokens=int(max_new_tokens),
                                      pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                                      **sampling)
        text = self.tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        return text.strip() or f"(only whitespace or special tokens: {text!r})"


def content_text(content) -> str:
    """gradio's message content (a string, or a list of {type: text, text} parts) as text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)
