"""Bad input ends before start with one `error:` screen naming its key or file (issue 33: complete validation).

A table of bad inputs (a value out of its bound, an unknown enum value, a wrong type, a broken recipe file, a
bad data file, row, column, template or image, too few rows, a run directory that is a file, a checkpoint
that is not one, ...), each run in this process through exactly what `python -m rlframe.main` runs before Ray
(compose_config, validate_config, prepare_run: model folder, run directory, the data built and checked),
asserting: the message is one screen, starts with `error: `, has no traceback, names the key or file (and
the row), and Ray never started. One case spawns `python -m rlframe.main` for the exit status and the whole
console output (no traceback, no Ray, no worker).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

from rlframe.config import validate_config
from rlframe.main import SCREEN_LINES, UsageError, compose_config, prepare_run, usage_errors


def before_start(argv: list[str]) -> str | None:
    """What `python -m rlframe.main <argv>` prints before Ray starts: its `error:` text, or None when all passes."""
    from rlframe.trainer.run_dir import release_run_dir

    cfg = None
    loggers = (logging.getLogger(), logging.getLogger("ray"))
    handlers = [list(logger.handlers) for logger in loggers]  # prepare_run routes the driver's logs to the run folder
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            cfg = compose_config(argv)
            validate_config(cfg)
            prepare_run(cfg)
        return None
    except UsageError as error:
        return str(error.code)
    except usage_errors() as error:  # what main() turns into UsageError
        return str(UsageError(str(error)).code)
    finally:
        if cfg is not None and cfg.trainer.run_dir:
            release_run_dir(Path(cfg.trainer.run_dir).resolve())
        for logger, kept in zip(loggers, handlers):  # this process goes on: its logging as it was
            for added in set(logger.handlers) - set(kept):
                added.close()
            logger.handlers[:] = kept


def assert_one_screen(text: str | None, expected: tuple[str, ...], user_traceback: bool = False) -> None:
    """`user_traceback`: the message may quote the traceback of the user's own file (a reward file's import)."""
    assert text is not None, "accepted, but it should have been refused"
    assert text.startswith("error: ") and (user_traceback or "Traceback" not in text), text
    assert len(text.splitlines()) <= SCREEN_LINES, text
    assert " object at 0x" not in text, text  # no object reprs
    for part in expected:
        assert part in text, f"{part!r} not in:\n{text}"


def ray_started() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


# ------------------------------------------------------------------ the configuration: bounds, enums, types
# overrides -> what the message names (the key; the bound or choices)
CONFIG_CASES = {
    # settings that invert or switch off training
    "grad_clip negative": (["actor.optim.grad_clip=-1"], ["actor.optim.grad_clip: -1", "must be > 0", "Fix: actor.optim.grad_clip=1.0"]),
    "grad_clip zero": (["actor.optim.grad_clip=0"], ["actor.optim.grad_clip: 0"]),
    "kl_loss_coef negative": (["algorithm.kl_loss_coef=-1"], ["algorithm.kl_loss_coef: -1", ">= 0"]),
    "ppo_epochs zero": (["actor.ppo_epochs=0"], ["actor.ppo_epochs: 0", ">= 1"]),
    # refused only inside a worker before
    "lr negative": (["actor.optim.lr=-1e-6"], ["actor.optim.lr: -1e-06", "> 0"]),
    "lr NaN": (["actor.optim.lr=nan"], ["actor.optim.lr: nan", "a finite number"]),
    "lr inf": (["actor.optim.lr=inf"], ["actor.optim.lr: inf", "a finite number"]),
    "betas length": (["actor.optim.betas=[0.9]"], ["actor.optim.betas: [0.9]", "a list of 2 numbers"]),
    "betas range": (["actor.optim.betas=[0.9,1.5]"], ["actor.optim.betas", "in [0, 1)"]),
    "weight decay negative": (["actor.optim.weight_decay=-0.1"], ["actor.optim.weight_decay: -0.1"]),
    "temperature negative": (["rollout.temperature=-1"], ["rollout.temperature: -1"]),
    "top_p zero": (["rollout.top_p=0"], ["rollout.top_p: 0", "in (0, 1]"]),
    "top_p above 1": (["rollout.top_p=1.5"], ["rollout.top_p: 1.5"]),
    # silently reinterpreted before
    "warmup negative": (["actor.optim.warmup_steps=-1"], ["actor.optim.warmup_steps: -1"]),
    "num_cpus zero": (["trainer.num_cpus=0"], ["trainer.num_cpus: 0", "Fix: trainer.num_cpus=null"]),
    "val_every negative": (["trainer.val_every=-1"], ["trainer.val_every: -1"]),
    # never validated up front before
    "timeout_s zero": (["reward.timeout_s=0"], ["reward.timeout_s: 0"]),
    "batch_timeout_s negative": (["reward.batch_timeout_s=-5"], ["reward.batch_timeout_s: -5"]),
    "num_workers negative": (["reward.num_workers=-1"], ["reward.num_workers: -1"]),
    "overlong unknown": (["data.overlong=drop"], ["data.overlong: 'drop' is not one of filter, error, truncate_left"]),
    "bad_rows unknown": (["data.bad_rows=ignore"], ["data.bad_rows: 'ignore' is not one of error, skip"]),
    # the rest of the sections
    "critic lr negative": (["critic.optim.lr=-1"], ["critic.optim.lr: -1", "Fix: critic.optim.lr=1e-05"]),
    "critic grad_clip zero": (["critic.optim.grad_clip=0"], ["critic.optim.grad_clip: 0"]),
    "critic head_lr zero": (["critic.head_lr=0"], ["critic.head_lr: 0"]),
    "critic cliprange negative": (["critic.cliprange_value=-1"], ["critic.cliprange_value: -1"]),
    "max_prompt_length negative": (["data.max_prompt_length=-5"], ["data.max_prompt_length: -5"]),
    "max_response_length zero": (["data.max_response_length=0"], ["data.max_response_length: 0"]),
    "train_batch_size zero": (["data.train_batch_size=0"], ["data.train_batch_size: 0"]),
    "val_max_samples zero": (["data.val_max_samples=0"], ["data.val_max_samples: 0"]),
    "data seed negative": (["data.seed=-1"], ["data.seed: -1"]),
    "arithmetic n_train zero": (["data.arithmetic.n_train=0"], ["data.arithmetic.n_train: 0"]),
    "rollout n zero": (["rollout.n=0"], ["rollout.n: 0"]),
    "top_k below -1": (["rollout.top_k=-2"], ["rollout.top_k: -2"]),
    "val_temperature negative": (["rollout.val_temperature=-0.5"], ["rollout.val_temperature: -0.5"]),
    "gpu_memory_utilization zero": (["rollout.gpu_memory_utilization=0"], ["rollout.gpu_memory_utilization: 0"]),
    "kv cache zero": (["rollout.cpu_kv_cache_gib=0"], ["rollout.cpu_kv_cache_gib: 0"]),
    "mini batch zero": (["actor.ppo_mini_batch_size=0"], ["actor.ppo_mini_batch_size: 0"]),
    "micro batch zero": (["actor.ppo_micro_batch_size_per_device=0"], ["actor.ppo_micro_batch_size_per_device: 0"]),
    "world size zero": (["actor.world_size=0"], ["actor.world_size: 0"]),
    "gamma above 1": (["algorithm.gamma=1.5"], ["algorithm.gamma: 1.5", "in [0, 1]"]),
    "lam negative": (["algorithm.lam=-0.1"], ["algorithm.lam: -0.1"]),
    "kl_ctrl coef negative": (["algorithm.kl_ctrl.kl_coef=-1"], ["algorithm.kl_ctrl.kl_coef: -1"]),
    "tis_cap below 1": (["algorithm.tis_cap=0.5"], ["algorithm.tis_cap: 0.5"]),
    "lora dropout 1": (["model.lora.dropout=1.0"], ["model.lora.dropout: 1.0"]),
    "lora rank negative": (["model.lora.rank=-4"], ["model.lora.rank: -4"]),
    "total_steps zero": (["trainer.total_steps=0"], ["trainer.total_steps: 0"]),
    "total_epochs zero": (["trainer.total_epochs=0"], ["trainer.total_epochs: 0"]),
    "save_every negative": (["trainer.save_every=-1"], ["trainer.save_every: -1"]),
    "keep negative": (["trainer.max_checkpoints_to_keep=-1"], ["trainer.max_checkpoints_to_keep: -1"]),
    "trainer seed negative": (["trainer.seed=-1"], ["trainer.seed: -1"]),
    "timeout zero": (["trainer.timeouts.rollout=0"], ["trainer.timeouts.rollout: 0"]),
    "staleness negative": (["trainer.max_staleness=-1"], ["trainer.max_staleness: -1"]),
    "fallback score inf": (["reward.fallback_score=inf"], ["reward.fallback_score: inf"]),
    "reward weight NaN": ([f"reward.functions=[{{path: {REPO_ROOT / 'reward_fns' / 'math.py'}, weight: nan}}]"],
                          ["reward.functions[0].weight: nan", "a finite number"]),
    "judge concurrency zero": (["reward.judge.max_concurrency=0"], ["reward.judge.max_concurrency: 0", ">= 1"]),
    "judge retries negative": (["reward.judge.max_retries=-1"], ["reward.judge.max_retries: -1", ">= 0"]),
    "dpo beta zero": (["dpo.beta=0"], ["dpo.beta: 0"]),
    "sft epochs zero": (["sft.epochs=0"], ["sft.epochs: 0"]),
    # enum keys
    "dtype unknown": (["model.dtype=fp32"], ["model.dtype: 'fp32' is not one of"]),
    "attention unknown": (["model.attn_implementation=flash"], ["model.attn_implementation: 'flash'"]),
    "engine unknown": (["rollout.engine=sglang"], ["rollout.engine: 'sglang'"]),
    "kl_loss_type unknown": (["algorithm.kl_loss_type=k9"], ["algorithm.kl_loss_type: 'k9'"]),
    "kl_ctrl type unknown": (["algorithm.kl_ctrl.type=pid"], ["algorithm.kl_ctrl.type: 'pid'"]),
    "remove padding unknown": (["actor.use_remove_padding=maybe"], ["actor.use_remove_padding: 'maybe'"]),
    "device unknown": (["trainer.device=tpu"], ["trainer.device"]),
    "checkpoint format unknown": (["trainer.checkpoint_format=zip"], ["trainer.checkpoint_format: 'zip'"]),
    "memory check unknown": (["trainer.memory_check=maybe"], ["trainer.memory_check: 'maybe'"]),
    "source unknown": (["data.source=web"], ["data.source: 'web'"]),
    "loss agg unknown": (["actor.loss_agg_mode=mean"], ["actor.loss_agg_mode: 'mean'"]),
    # types and keys
    "total_steps not a number": (["trainer.total_steps=abc"], ["trainer.total_steps: 'abc' is not a whole number"]),
    "lr not a number": (["actor.optim.lr=fast"], ["actor.optim.lr: 'fast' is not a number"]),
    "n not whole": (["rollout.n=2.5"], ["rollout.n: 2.5 is not a whole number"]),
    "bool not bool": (["data.shuffle=maybe"], ["data.shuffle: 'maybe' is not true or false"]),
    "unknown key": (["trainer.nope=1"], ["unknown config key 'trainer.nope'"]),
    "unknown recipe": (["recipe=no_such_recipe"], ["unknown recipe 'no_such_recipe'", "Available recipes"]),
    "model path missing": (["model.path=/no/such/model"], ["model.path: '/no/such/model'"]),
    "reward file missing": (["reward.functions=[{path: /no/such/reward.py}]"], ["reward.functions[0].path"]),
    "estimator file missing": (["algorithm.custom_estimator={path: /no/such.py, name: mine}"],
                               ["algorithm.custom_estimator.path"]),
}


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    """The overrides every case starts from: the tiny model, a small generated task, a fresh run directory each."""
    root = tmp_path_factory.mktemp("usage")
    counter = iter(range(10**6))

    def overrides(*extra: str) -> list[str]:
        return [f"model.path={tiny_model_dir}", f"trainer.run_dir={root / f'run{next(counter)}'}",
                "trainer.memory_check=off", "trainer.total_steps=1", "data.arithmetic.n_train=16",
                "data.arithmetic.n_val=4", *extra]
    return overrides


def test_the_base_passes_every_check(base):
    assert before_start(base()) is None  # so each case below fails for its own reason
    assert not ray_started()


# through Hydra's parser and composition (the rest merge their values onto the composed, typed schema as Hydra's
# compose does, OmegaConf.merge, which applies the same type checks, then validate_config: a tenth of the time)
COMPOSED = {"total_steps not a number", "lr not a number", "n not whole", "bool not bool", "unknown key",
            "unknown recipe", "grad_clip negative", "overlong unknown", "max_prompt_length negative"}


@pytest.fixture(scope="module")
def typed_base(base):
    from omegaconf import OmegaConf

    with contextlib.redirect_stdout(io.StringIO()):
        return OmegaConf.structured(compose_config(base()))


def merged_and_validated(typed_base, overrides: list[str]) -> str | None:
    """The error text of `overrides` merged onto the composed schema, then validated (None: accepted)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rlframe.main import compose_error_message

    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(typed_base, OmegaConf.from_dotlist(overrides)))
        with contextlib.redirect_stdout(io.StringIO()):
            validate_config(cfg)
    except OmegaConfBaseException as error:
        return str(UsageError(compose_error_message(error, "test")).code)
    except usage_errors() as error:
        return str(UsageError(str(error)).code)
    return None


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_setting_is_one_screen_naming_the_key(base, typed_base, case):
    overrides, expected = CONFIG_CASES[case]
    text = before_start(base(*overrides)) if case in COMPOSED else merged_and_validated(typed_base, overrides)
    assert_one_screen(text, tuple(expected))
    assert not ray_started()


def test_every_shipped_recipe_validates():
    """No recipe we ship is refused by the checks (grpo_gsm8k's data files are made on the user's machine)."""
    from rlframe.main import available_recipes

    data = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
    for name in available_recipes():
        files = [f"data.train_files={data}", f"data.val_files={data}"] if name == "grpo_gsm8k" else []
        if name == "opd_math":  # its teacher is named by the user (docs/distillation.md): the student itself here
            files = ["teacher.path=smollm2-135m-instruct"]
        with contextlib.redirect_stdout(io.StringIO()):
            validate_config(compose_config([f"recipe={name}", *files]))


# ------------------------------------------------------------------ files: recipes, data, templates, run dir
def good_row(i: int = 0, prompt=None) -> dict:
    return {"data_source": "toy", "prompt": prompt or [{"role": "user", "content": f"What is {i} plus 1?"}],
            "reward_model": {"ground_truth": str(i + 1)}}


def jsonl(path: Path, rows) -> str:
    path.write_bytes(b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows))
    return str(path)


def with_bad_row(bad) -> callable:
    """Five good rows with `bad` as row 3, as data.train_files."""
    return lambda tmp: [f"data.train_files={jsonl(tmp / 'train.jsonl', [good_row(0), good_row(1), good_row(2), bad, good_row(4)])}",
                        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]


def long_rows(tmp: Path, *extra: str) -> list[str]:
    rows = [good_row(i, [{"role": "user", "content": "How many apples? " * (30 if i < 6 else 1)}]) for i in range(8)]
    return [f"data.train_files={jsonl(tmp / 'long.jsonl', rows)}", "data.max_prompt_length=40",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", *extra]


def write(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def recipe(tmp: Path, text: str) -> list[str]:
    return [f"recipe={write(tmp, 'my_recipe.yaml', text)}"]


def template_rows(tmp: Path, template: str) -> list[str]:
    rows = [{**good_row(i), "prompt": f"What is {i} plus 1?"} for i in range(4)]
    return [f"data.train_files={jsonl(tmp / 'plain.jsonl', rows)}", f"data.prompt_template={write(tmp, 't.jinja', template)}",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]


def image_rows(tmp: Path, image) -> list[str]:
    rows = [{**good_row(i, [{"role": "user", "content": "<image>How many circles?"}]), "images": [image]} for i in range(4)]
    return [f"data.train_files={jsonl(tmp / 'images.jsonl', rows)}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]


def video_rows(tmp: Path, video) -> list[str]:
    rows = [{**good_row(i, [{"role": "user", "content": "<video>Which way does it move?"}]), "videos": [video]}
            for i in range(4)]
    return [f"data.train_files={jsonl(tmp / 'videos.jsonl', rows)}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]


def audio_rows(tmp: Path, audio) -> list[str]:
    rows = [{**good_row(i, [{"role": "user", "content": "<audio>How many beeps?"}]), "audios": [audio]} for i in range(4)]
    return [f"data.train_files={jsonl(tmp / 'audios.jsonl', rows)}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]


def stage_rows(tmp: Path, stage: str, rows: list[dict], *extra: str) -> list[str]:
    return [f"stage={stage}", f"data.train_files={jsonl(tmp / f'{stage}.jsonl', rows)}", *extra]


CSV_TEXT, NOT_JSON = "a,b\n1,2\n", b"{not json\n"

# setup(tmp) -> overrides; what the message names
FILE_CASES = {
    # recipe files
    "empty recipe": (lambda tmp: recipe(tmp, ""), ["my_recipe.yaml is empty"]),
    "recipe YAML syntax": (lambda tmp: recipe(tmp, "trainer:\n  total_steps: [1\n"), ["my_recipe.yaml, line", "YAML syntax error"]),
    "recipe not a mapping": (lambda tmp: recipe(tmp, "- a\n- b\n"), ["expected a mapping"]),
    "recipe wrong type": (lambda tmp: recipe(tmp, "trainer:\n  total_steps: many\n"), ["trainer.total_steps: 'many'"]),
    "recipe unknown key": (lambda tmp: recipe(tmp, "trainer:\n  totl_steps: 3\n"), ["totl_steps"]),
    # data files
    "train file missing": (lambda tmp: [f"data.train_files={tmp / 'none.jsonl'}"], ["data.train_files: '", "none.jsonl' does not exist"]),
    "val file missing": (lambda tmp: [f"data.train_files={jsonl(tmp / 'a.jsonl', [good_row()] * 8)}",
                                      f"data.val_files={tmp / 'none.jsonl'}"], ["data.val_files: '"]),
    "unsupported file type": (lambda tmp: [f"data.train_files={write(tmp, 'rows.txt', 'x')}"], ["unsupported data file type '.txt'"]),
    "CSV named parquet": (lambda tmp: [f"data.train_files={write(tmp, 'rows.parquet', CSV_TEXT)}"],
                          ["rows.parquet: not a parquet file", "it starts with 'a,b'"]),
    "empty parquet": (lambda tmp: [f"data.train_files={write(tmp, 'rows.parquet', '')}"], ["rows.parquet: the file is empty"]),
    "empty jsonl": (lambda tmp: [f"data.train_files={write(tmp, 'rows.jsonl', '')}"], ["no usable rows in", "rows.jsonl"]),
    "invalid JSON line": (lambda tmp: [f"data.train_files={jsonl(tmp / 'train.jsonl', [good_row(), NOT_JSON])}"],
                          ["train.jsonl, line 2: invalid JSON"]),
    "JSON line not an object": (lambda tmp: [f"data.train_files={jsonl(tmp / 'train.jsonl', [good_row(), [1, 2]])}"],
                                ["train.jsonl, line 2: expected a JSON object"]),
    "missing prompt column": (lambda tmp: [f"data.train_files={jsonl(tmp / 'qa.jsonl', [{'question': 'q', 'answer': '1'}] * 8)}"],
                              ["qa.jsonl, row 0: field 'prompt': missing", "columns: question, answer", "Fix: data.prompt_key="]),
    "missing answer column": (lambda tmp: [f"data.train_files={jsonl(tmp / 'qa.jsonl', [{'prompt': 'q', 'answer': '1'}] * 8)}"],
                              ["field 'reward_model.ground_truth': missing", "Fix: data.answer_key="]),
    # rows
    "prompt wrong type": (with_bad_row({**good_row(), "prompt": 42}), ["train.jsonl, row 3: field 'prompt'", "got int"]),
    "prompt empty string": (with_bad_row({**good_row(), "prompt": "  "}), ["row 3: field 'prompt': empty string"]),
    "message content not text": (with_bad_row(good_row(0, [{"role": "user", "content": 7}])), ["row 3: field 'prompt[0].content'"]),
    "message not a dict": (with_bad_row(good_row(0, ["hello"])), ["row 3: field 'prompt[0]'"]),
    "non-UTF-8 bytes": (with_bad_row(b'{"prompt": [{"role": "user", "content": "caf\xe9"}], "reward_model": {"ground_truth": "3"}}\n'),
                        ["row 3: field 'prompt[0].content': not valid UTF-8"]),
    "message content empty": (with_bad_row(good_row(0, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " "}])),
                              ["row 3: field 'prompt[1].content': empty (user message)"]),
    "ground truth NaN": (with_bad_row({**good_row(), "reward_model": {"ground_truth": float("nan")}}),
                         ["row 3: field 'reward_model.ground_truth': nan is not a finite number"]),
    "SFT message content empty": (lambda tmp: stage_rows(tmp, "sft", [{"prompt": [{"role": "user", "content": ""}], "response": "a"}] * 20),
                                  ["sft.jsonl, row 0", "'prompt[0].content': empty (user message)"]),
    "ground truth empty": (with_bad_row({**good_row(), "reward_model": {"ground_truth": ""}}), ["row 3: field 'reward_model.ground_truth': empty"]),
    "ground truth bool": (with_bad_row({**good_row(), "reward_model": {"ground_truth": True}}), ["row 3: field 'reward_model.ground_truth'"]),
    "data_source not text": (with_bad_row({**good_row(), "data_source": 5}), ["row 3: field 'data_source'"]),
    "extra_info not a dict": (with_bad_row({**good_row(), "extra_info": [1]}), ["row 3: field 'extra_info'"]),
    "overlong prompt, overlong=error": (lambda tmp: long_rows(tmp, "data.overlong=error"),
                                        ["long.jsonl, row 0", "more than data.max_prompt_length=40", "Fix: raise data.max_prompt_length"]),
    "too few rows after the overlong filter": (lambda tmp: long_rows(tmp),
                                               ["data.train_batch_size=4", "yield only 2 usable ones",
                                                "data.overlong=filter dropped 6 of 8 rows"]),
    "too few rows": (lambda tmp: [f"data.train_files={jsonl(tmp / 'few.jsonl', [good_row(0), good_row(1)])}",
                                  "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"],
                     ["data.train_batch_size=4 needs 4 prompts per step", "yield only 2 usable ones",
                      "Fix: lower data.train_batch_size"]),
    "too few rows after bad_rows=skip": (lambda tmp: [*with_bad_row({"prompt": 1})(tmp), "data.train_batch_size=8",
                                                      "actor.ppo_mini_batch_size=8", "data.bad_rows=skip"],
                                         ["data.bad_rows=skip dropped 1 of 5 malformed rows"]),
    "bad validation row": (lambda tmp: [f"data.train_files={jsonl(tmp / 'train.jsonl', [good_row(i) for i in range(8)])}",
                                        f"data.val_files={jsonl(tmp / 'val.jsonl', [good_row(), {'prompt': 3}])}"],
                           ["val.jsonl, row 1: field 'prompt'"]),
    # templates
    "template syntax error": (lambda tmp: template_rows(tmp, "{{ content "), ["data.prompt_template:", "t.jinja, line 1", "Jinja syntax error"]),
    "template fails on a row": (lambda tmp: template_rows(tmp, "{{ content }} {{ hint }}"),
                                ["plain.jsonl, row 0", "data.prompt_template failed on it", "'hint' is undefined"]),
    "template file missing": (lambda tmp: [*template_rows(tmp, "x")[:1], f"data.prompt_template={tmp / 'none.jinja'}"],
                              ["prompt_template file not found"]),
    # images
    "image does not decode": (lambda tmp: image_rows(tmp, {"path": str(write(tmp, "bad.png", b"not a picture"))}),
                              ["images.jsonl, row 0: field 'images[0]': cannot decode the image", "not an image format PIL reads"]),
    "image file missing": (lambda tmp: image_rows(tmp, {"path": "missing.png"}), ["field 'images[0]': image file not found"]),
    # videos (verl's layout: {"video": path, "fps", "max_frames"}; EasyR1's: a path)
    "video does not decode": (lambda tmp: video_rows(tmp, {"video": str(write(tmp, "bad.avi", b"not a video" * 50)), "fps": 2}),
                              ["videos.jsonl, row 0: field 'videos[0]': cannot decode the video", "bad.avi"]),
    "video file missing": (lambda tmp: video_rows(tmp, "missing.mp4"), ["field 'videos[0]': video file not found", "missing.mp4"]),
    "video frame does not decode": (lambda tmp: video_rows(tmp, [{"path": str(write(tmp, "f.png", b"no"))}]),
                                    ["field 'videos[0][0]': cannot decode the image"]),
    "video without its placeholder": (lambda tmp: [f"data.train_files={jsonl(tmp / 'vid.jsonl', [{**good_row(), 'videos': ['a.avi']}] * 4)}"],
                                      ["vid.jsonl, row 0", "0 <video> placeholder(s) in the prompt but 1 video(s)"]),
    # audios (verl's / LLaMA-Factory's layout: a .wav path, or {"array", "sampling_rate"})
    "audio does not decode": (lambda tmp: audio_rows(tmp, str(write(tmp, "bad.wav", b"RIFF....WAVE" + b"\0" * 64))),
                              ["audios.jsonl, row 0: field 'audios[0]': cannot decode the audio", "bad.wav"]),
    "audio file missing": (lambda tmp: audio_rows(tmp, "missing.wav"), ["field 'audios[0]': audio file not found", "missing.wav"]),
    "image without its placeholder": (lambda tmp: [f"data.train_files={jsonl(tmp / 'img.jsonl', [{**good_row(), 'images': [{'path': 'a.png'}]}] * 4)}"],
                                      ["img.jsonl, row 0", "0 <image> placeholder(s) in the prompt but 1 image(s)"]),
    # stages
    "SFT too few rows": (lambda tmp: stage_rows(tmp, "sft", [{"prompt": "q", "response": "a"}] * 3),
                         ["sft.batch_size=16 needs 16 SFT rows per step", "yield only 3 usable ones"]),
    "SFT response missing": (lambda tmp: stage_rows(tmp, "sft", [{"prompt": "q"}] * 20), ["sft.jsonl, row 0: field 'response'"]),
    "DPO identical pair": (lambda tmp: stage_rows(tmp, "dpo", [{"prompt": "q", "chosen": "a", "rejected": "a"}] * 10),
                           ["dpo.jsonl, row 0", "identical"]),
    # run directory and checkpoints
    "run_dir is a file": (lambda tmp: [f"trainer.run_dir={write(tmp, 'a_file', 'x')}"], ["trainer.run_dir: '", "is a file"]),
    "resume not a folder": (lambda tmp: [f"trainer.resume={tmp / 'no_such_step'}"], ["trainer.resume"]),
    "resume folder not a checkpoint": (lambda tmp: [f"trainer.resume={(tmp / 'step_3').mkdir() or tmp / 'step_3'}"],
                                       ["trainer.resume", "step_3"]),
    # reward files
    "hub id without network or cache": (lambda tmp: ["model.path=no-such-org/no-such-model"],
                                        ["model.path: 'no-such-org/no-such-model' is a hub id, but the hub cannot be reached",
                                         "Fix: model.path=/path/to/a/local/model/folder"]),
    "reward file fails at import": (lambda tmp: [f"reward.functions=[{{path: {write(tmp, 'r.py', 'raise ImportError(1)')}}}]"],
                                    ["reward.functions[0]"]),
    "reward function of two arguments": (lambda tmp: [f"reward.functions=[{{path: {write(tmp, 'r.py', TWO_ARGUMENTS)}}}]"],
                                         ["reward.functions[0]", "compute_score(solution_str, ground_truth)",
                                          "verl's per-sample form compute_score(data_source, solution_str, ground_truth, "
                                          "extra_info=None, **kwargs)"]),
    "reward kwargs the function does not take": (
        lambda tmp: [f"reward.functions=[{{path: {write(tmp, 'r.py', VERL_FORM)}, kwargs: {{scale: 2}}}}]"],
        ["reward.functions[0]", "does not take the keyword arguments that reward.functions[0].kwargs passes", "'scale'"]),
    "reward data_sources match no row": (lambda tmp: [*with_bad_row(good_row(3))(tmp), f"reward.functions=[{{path: {MATH}, data_sources: [gsm8k]}}]"],
                                         ["reward.functions[0].data_sources: ['gsm8k'] match none of the data's data_source values ('toy')",
                                          "Fix: list some of those values, or data_sources=null"]),
    "reward data_sources leave rows unscored": (
        lambda tmp: [*with_bad_row({**good_row(3), "data_source": "other"})(tmp), f"reward.functions=[{{path: {MATH}, data_sources: [toy]}}]"],
        ["no reward function scores the rows whose data_source is 'other'"]),
}
MATH = REPO_ROOT / "reward_fns" / "math.py"
TWO_ARGUMENTS = "def compute_score(solution_str, ground_truth):\n    return float(ground_truth in solution_str)\n"
VERL_FORM = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


USER_CODE = {"reward file fails at import"}  # the error quotes where the user's file failed (its traceback)


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_bad_file_is_one_screen_naming_the_file(base, tmp_path, case):
    setup, expected = FILE_CASES[case]
    assert_one_screen(before_start(base(*setup(tmp_path))), tuple(expected), user_traceback=case in USER_CODE)
    assert not ray_started()


# ------------------------------------------------------------------ the whole process: exit status, console
def test_main_prints_only_the_error(base, tmp_path):
    """The whole process on a data error found only by building the data: exit 1, the error screen, nothing else."""
    setup, expected = FILE_CASES["CSV named parquet"]
    done = subprocess.run([sys.executable, "-m", "rlframe.main", *base(*setup(tmp_path))], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-4000:]
    error = done.stderr[done.stderr.index("error: "):]
    assert_one_screen(error.strip(), tuple(expected))
    everything = done.stdout + done.stderr
    assert "Traceback" not in everything and "Ray" not in everything and "workers:" not in everything, everything[-4000:]
