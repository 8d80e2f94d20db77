"""The page: gradio Blocks with the Train, Watch, Runs, Evaluate, Chat and Export tabs, wired to actions.Board.

Each tab's components are laid out by one function; each event handler turns the page's values into a call
on Board and its result back into the page's values. Bad input shows as `error: ...` in the page.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from rlframe.board import forms
from rlframe.board.actions import RECIPE_REWARD, Board, error_text
from rlframe.board.i18n import LANGUAGES, Labels
from rlframe.board.runs import CURVES
from rlframe.board.schema_help import key_help
from rlframe.board.security import BoardError
from rlframe.board.settings import list_settings, load_settings, save_settings

# TrainForm fields in the order the page passes them to the handlers.
FORM_FIELDS = ["stage", "recipe", "model_source", "model_path", "teacher_path", "distillation_loss_mode",
               "data_source", "train_files", "val_files", *forms.DATA_KEYS, "reward_path", "reward_name", "judge_url",
               "judge_model", *forms.MAIN_KEYS, "extra_yaml"]
PLOT_HEIGHT = 240
CSS = ("#plan textarea, #command textarea, #log textarea, #yaml textarea {font-family: monospace; font-size: 12px}\n"
       # gradio draws a plot's legend (the series' names) below its axes, outside the svg's box, which clips it
       ".board-plot, .board-plot svg {overflow: visible !important} .board-plot {padding-bottom: 56px !important}")


def paths(text: str) -> list[str]:
    return [p.strip() for p in (text or "").replace(",", "\n").splitlines() if p.strip()]


def typed(text):
    """A main-key box's text -> int, float, or the text itself (the schema then names what it takes); None when
    empty (the recipe's value stands)."""
    text = "" if text is None else str(text).strip()
    if not text:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def recipe_values(recipe: str) -> dict[str, str]:
    """The recipe's value of each main key (shown as the boxes' placeholders)."""
    from rlframe.board.forms import flatten
    from rlframe.board.preview import PREVIEW_LOCK, compose
    from rlframe.main import usage_errors

    try:
        with PREVIEW_LOCK:
            cfg, _ = compose([f"recipe={recipe}"])
    except (SystemExit, *usage_errors()):  # an unknown or broken recipe: the preview names it
        return {}
    from rlframe.board.preview import composed_dict

    values = flatten(composed_dict(cfg))
    return {name: f"recipe: {values.get(key)}" for name, key in forms.MAIN_KEYS.items()}


def form_of(values) -> forms.TrainForm:
    """The page's form values (FORM_FIELDS order) -> TrainForm."""
    data = dict(zip(FORM_FIELDS, values))
    data["train_files"], data["val_files"] = paths(data["train_files"]), paths(data["val_files"])
    data["reward_path"] = "" if data["reward_path"] in (None, RECIPE_REWARD) else data["reward_path"]
    for key in forms.MAIN_KEYS:
        data[key] = typed(data[key])
    for key in (*forms.DATA_KEYS, "model_path", "teacher_path", "distillation_loss_mode", "reward_name", "judge_url",
                "judge_model", "extra_yaml"):
        data[key] = data[key] or ""
    return forms.TrainForm.from_dict(data)


def page_values(form: forms.TrainForm) -> list:
    """TrainForm -> the page's values (FORM_FIELDS order), for loading saved settings."""
    data = form.to_dict()
    data["train_files"], data["val_files"] = "\n".join(form.train_files), "\n".join(form.val_files)
    data["reward_path"] = form.reward_path or RECIPE_REWARD
    return [data[name] for name in FORM_FIELDS]


def preview_outputs(preview) -> tuple[str, str, str]:
    """(validation text, memory plan, command) for the page."""
    if preview.ok:
        notes = "".join(f"\nnote: {n}" for n in preview.notes)
        return f"valid: every check of python -m rlframe.main passed{notes}", preview.plan_table, preview.command
    return preview.error, preview.plan_table, preview.command


def train_tab(board: Board, L: Labels) -> dict:
    by_stage = forms.recipes_by_stage()
    c: dict = {}
    with gr.Row():
        c["stage"] = L.track(gr.Dropdown(list(forms.STAGES), value="rl", label=L("stage"), elem_id="stage"), "stage")
        c["recipe"] = L.track(gr.Dropdown(by_stage.get("rl", []), value="grpo_math", label=L("recipe"),
                                          elem_id="recipe", allow_custom_value=True), "recipe")
    with gr.Row():
        c["model_source"] = L.track(gr.Radio(list(forms.MODEL_SOURCES), value="embedded", label=L("model_source"),
                                             elem_id="model_source", info=key_help("model.path")), "model_source")
        c["model_path"] = L.track(gr.Textbox(label=L("model_path"), elem_id="model_path"), "model_path")
    # on-policy distillation (docs/distillation.md): the teacher's folder (confined to the workspace, as Chat's) and
    # the loss; the rest of teacher: / distillation: in the YAML
    with L.track(gr.Accordion(L("teacher"), open=False, elem_id="teacher_box"), "teacher"), gr.Row():
        c["teacher_path"] = L.track(gr.Dropdown(["", *board.teacher_choices()], value="", label=L("teacher_path"),
                                                elem_id="teacher_path", allow_custom_value=True,
                                                info=key_help("teacher.path")), "teacher_path")
        c["distillation_loss_mode"] = L.track(gr.Dropdown(["", *forms.loss_modes()], value="",
                                                          label=L("distillation_loss_mode"),
                                                          elem_id="distillation_loss_mode",
                                                          info=key_help("distillation.loss_mode")),
                                              "distillation_loss_mode")
    with L.track(gr.Accordion(L("data"), open=False, elem_id="data_box"), "data"):
        c["data_source"] = L.track(gr.Radio(list(forms.DATA_SOURCES), value="recipe", label=L("data_source"),
                                            elem_id="data_source"), "data_source")
        with gr.Row():
            c["train_upload"] = L.track(gr.File(label=L("train_upload"), elem_id="train_upload"), "train_upload")
            c["val_upload"] = L.track(gr.File(label=L("val_upload"), elem_id="val_upload"), "val_upload")
        with gr.Row():
            c["train_files"] = gr.Textbox(label="data.train_files", elem_id="train_files", info=key_help("data.train_files"))
            c["val_files"] = gr.Textbox(label="data.val_files", elem_id="val_files")
        c["data_message"] = gr.Textbox(show_label=False, elem_id="data_message", interactive=False)
        c["data_rows"] = L.track(gr.Dataframe(label=L("data_rows"), interactive=False), "data_rows")
        with gr.Row():
            c["prompt_key"] = L.track(gr.Dropdown([], label=L("prompt_col"), allow_custom_value=True,
                                                  info=key_help("data.prompt_key")), "prompt_col")
            c["answer_key"] = L.track(gr.Dropdown([], label=L("answer_col"), allow_custom_value=True,
                                                  info=key_help("data.answer_key")), "answer_col")
            c["image_key"] = L.track(gr.Dropdown([], label=L("image_col"), allow_custom_value=True,
                                                 info=key_help("data.image_key")), "image_col")
            c["video_key"] = L.track(gr.Dropdown([], label=L("video_col"), allow_custom_value=True, elem_id="video_key",
                                                 info=key_help("data.video_key")), "video_col")
            c["audio_key"] = L.track(gr.Dropdown([], label=L("audio_col"), allow_custom_value=True, elem_id="audio_key",
                                                 info=key_help("data.audio_key")), "audio_col")
    with L.track(gr.Accordion(L("reward"), open=False, elem_id="reward_box"), "reward"):
        with gr.Row():
            c["reward_path"] = L.track(gr.Dropdown(board.reward_choices(), value=RECIPE_REWARD, label=L("reward_pick"),
                                                   elem_id="reward_path", allow_custom_value=True), "reward_pick")
            c["reward_name"] = L.track(gr.Textbox(value="compute_score", label=L("reward_name"), elem_id="reward_name"),
                                       "reward_name")
            c["reward_upload"] = L.track(gr.File(label=L("reward_upload"), elem_id="reward_upload"), "reward_upload")
        with gr.Row():  # an LLM judge in the loop (docs/judge.md); its rubric or verdict pattern: the YAML
            c["judge_url"] = L.track(gr.Textbox(label=L("judge_url"), elem_id="judge_url", placeholder="http://host:8000/v1",
                                                info=key_help("reward.judge.url")), "judge_url")
            c["judge_model"] = L.track(gr.Textbox(label=L("judge_model"), elem_id="judge_model",
                                                  info=key_help("reward.judge.model")), "judge_model")
        c["reward_message"] = gr.Textbox(show_label=False, elem_id="reward_message", interactive=False)
        c["try_button"] = L.track(gr.Button(L("try_reward"), elem_id="try_reward"), "try_reward", "value")
        c["try_table"] = L.track(gr.Dataframe(label=L("try_table"), interactive=False, elem_id="try_table"), "try_table")
    shown = recipe_values("grpo_math")
    with L.track(gr.Accordion(L("settings_main"), open=True), "settings_main"), gr.Row():
        for name, key in forms.MAIN_KEYS.items():
            c[name] = L.track(gr.Textbox(label=L(name), info=key_help(key), elem_id=name, min_width=180,
                                         placeholder=shown.get(name, "")), name)
    with L.track(gr.Accordion(L("yaml"), open=False, elem_id="yaml_box"), "yaml"):
        c["show_yaml"] = L.track(gr.Button(L("show_yaml"), size="sm"), "show_yaml", "value")
        c["extra_yaml"] = gr.Textbox(lines=12, max_lines=40, show_label=False, elem_id="yaml",
                                     placeholder="trainer:\n  val_before_train: false")
    c["run_name"] = L.track(gr.Textbox(label=L("run_name"), elem_id="run_name"), "run_name")
    with gr.Row():
        c["preview"] = L.track(gr.Button(L("preview"), elem_id="preview"), "preview", "value")
        c["launch"] = L.track(gr.Button(L("launch"), variant="primary", elem_id="launch"), "launch", "value")
    c["launch_message"] = gr.Textbox(show_label=False, elem_id="launch_message", interactive=False)
    c["validation"] = L.track(gr.Textbox(label=L("validation"), lines=3, max_lines=40, elem_id="validation",
                                         interactive=False), "validation")
    c["plan"] = L.track(gr.Textbox(label=L("memory_plan"), lines=6, max_lines=40, elem_id="plan", interactive=False),
                        "memory_plan")
    c["command"] = L.track(gr.Textbox(label=L("command"), elem_id="command", interactive=False, buttons=["copy"]),
                           "command")
    with gr.Row():
        c["settings_name"] = L.track(gr.Textbox(label=L("settings_name"), elem_id="settings_name"), "settings_name")
        c["save_settings"] = L.track(gr.Button(L("save_settings")), "save_settings", "value")
        c["saved"] = L.track(gr.Dropdown(list_settings(board.workspace), label=L("saved_settings")), "saved_settings")
        c["load_settings"] = L.track(gr.Button(L("load_settings")), "load_settings", "value")
    c["recipes"] = by_stage
    return c


def wire_train(board: Board, c: dict, watch_run) -> None:
    form_inputs = [c[name] for name in FORM_FIELDS]

    def on_stage(stage):
        choices = c["recipes"].get(stage, [])
        return gr.update(choices=choices, value=choices[0] if choices else None)

    def on_preview(run_name, *values):
        preview, run_name = board.preview(form_of(values), run_name)
        return (*preview_outputs(preview), run_name)

    def on_launch(run_name, *values):
        preview, run_name, message = board.launch(form_of(values), run_name)
        names = board.run_names()
        return (*preview_outputs(preview), run_name, message,
                gr.update(choices=names, value=run_name) if preview.ok else gr.update(choices=names))

    def on_data(file):
        unchanged = tuple(gr.update() for _ in range(6))  # the five column drop-downs and the data source
        if file is None:
            return gr.update(), "", None, *unchanged
        try:
            kept, info = board.upload_data(file)
        except BoardError as err:
            return gr.update(), error_text(err), None, *unchanged
        return (str(kept), f"{Path(kept).name}: {info.num_rows} rows, columns {', '.join(info.columns)}", info.rows,
                gr.update(choices=info.prompt_columns, value=info.prompt),
                gr.update(choices=info.columns, value=info.answer),
                gr.update(choices=["", *info.columns], value=info.images),
                gr.update(choices=["", *info.columns], value=info.videos),
                gr.update(choices=["", *info.columns], value=info.audios), "files")

    def on_val(file):
        if file is None:
            return gr.update(), ""
        try:
            kept, info = board.upload_data(file)
        except BoardError as err:
            return gr.update(), error_text(err)
        return str(kept), f"{Path(kept).name}: {info.num_rows} validation rows"

    def on_reward(file):
        if file is None:
            return gr.update(), gr.update(), ""
        try:
            kept, names = board.upload_reward(file)
        except BoardError as err:
            return gr.update(), gr.update(), error_text(err)
        name = "compute_score" if "compute_score" in names else names[0]
        return (gr.update(choices=board.reward_choices(), value=str(kept)), name,
                f"kept {kept.name} in the workspace; functions: {', '.join(names)}")

    def on_try(*values):
        result = board.try_reward(form_of(values))
        return result.table, "\n".join(filter(None, [result.error, result.verdict]))

    def on_yaml(run_name, *values):
        try:
            return board.full_yaml(form_of(values), run_name)
        except BoardError as err:
            return f"# {err}"

    def on_save(name, *values):
        try:
            path = save_settings(board.workspace, name, form_of(values))
        except BoardError as err:
            return error_text(err), gr.update()
        return f"saved {path}", gr.update(choices=list_settings(board.workspace), value=path.stem)

    def on_load(name):
        try:
            return ["", *page_values(load_settings(board.workspace, name or ""))]
        except BoardError as err:
            return [error_text(err), *[gr.update() for _ in FORM_FIELDS]]

    def on_recipe(recipe):
        shown = recipe_values(recipe or "")
        return [gr.update(placeholder=shown.get(name, "")) for name in forms.MAIN_KEYS]

    c["stage"].change(on_stage, c["stage"], c["recipe"])
    c["recipe"].change(on_recipe, c["recipe"], [c[name] for name in forms.MAIN_KEYS])
    c["preview"].click(on_preview, [c["run_name"], *form_inputs], [c["validation"], c["plan"], c["command"], c["run_name"]])
    c["launch"].click(on_launch, [c["run_name"], *form_inputs],
                      [c["validation"], c["plan"], c["command"], c["run_name"], c["launch_message"], watch_run])
    def cleared(handler):  # the file box is emptied after each upload (the kept copy is in the workspace)
        return lambda file: (*handler(file), None)

    c["train_upload"].upload(cleared(on_data), c["train_upload"],
                             [c["train_files"], c["data_message"], c["data_rows"], c["prompt_key"], c["answer_key"],
                              c["image_key"], c["video_key"], c["audio_key"], c["data_source"], c["train_upload"]])
    c["val_upload"].upload(cleared(on_val), c["val_upload"], [c["val_files"], c["data_message"], c["val_upload"]])
    c["reward_upload"].upload(cleared(on_reward), c["reward_upload"],
                              [c["reward_path"], c["reward_name"], c["reward_message"], c["reward_upload"]])
    c["try_button"].click(on_try, form_inputs, [c["try_table"], c["reward_message"]])
    c["show_yaml"].click(on_yaml, [c["run_name"], *form_inputs], c["extra_yaml"])
    c["save_settings"].click(on_save, [c["settings_name"], *form_inputs], [c["launch_message"], c["saved"]])
    c["load_settings"].click(on_load, c["saved"], [c["launch_message"], *form_inputs])


def watch_tab(board: Board, L: Labels) -> dict:
    c: dict = {}
    with gr.Row():
        c["run"] = L.track(gr.Dropdown(board.run_names(), label=L("watch_run"), elem_id="watch_run",
                                       allow_custom_value=True), "watch_run")
        c["refresh"] = L.track(gr.Button(L("refresh"), elem_id="watch_refresh"), "refresh", "value")
        c["live"] = L.track(gr.Checkbox(value=True, label=L("live")), "live")
        c["stop"] = L.track(gr.Button(L("stop"), variant="stop", elem_id="stop"), "stop", "value")
        c["resume"] = L.track(gr.Button(L("resume"), elem_id="resume"), "resume", "value")
    with gr.Row():
        c["status"] = L.track(gr.Textbox(label=L("status"), elem_id="watch_status", interactive=False), "status")
        c["progress"] = L.track(gr.Textbox(label=L("progress"), elem_id="watch_progress", interactive=False), "progress")
    c["message"] = gr.Textbox(show_label=False, elem_id="watch_message", interactive=False)
    c["plots"] = {}
    for row in (CURVES[:4], CURVES[4:]):
        with gr.Row():
            for title, _ in row:
                c["plots"][title] = L.track(gr.LinePlot(x="step", y="value", color="series", label=L(f"plot_{title}"),
                                                        elem_id=f"plot_{title}", height=PLOT_HEIGHT,
                                                        color_title="", y_title=title, elem_classes=["board-plot"]), f"plot_{title}")
    c["table"] = L.track(gr.Dataframe(label=L("metrics"), interactive=False, elem_id="watch_table"), "metrics")
    c["samples"] = L.track(gr.Dataframe(label=L("samples"), interactive=False, wrap=True), "samples")
    c["log"] = L.track(gr.Textbox(label=L("log"), lines=12, max_lines=12, elem_id="log", interactive=False), "log")
    c["timer"] = gr.Timer(2.0)
    return c


def drawable(frame) -> bool:
    """A plot's points hold a line (two points of one series): only such a frame is sent to a LinePlot."""
    return not frame.empty and int(frame.groupby("series").size().max()) >= 2


def wire_watch(board: Board, c: dict) -> None:
    outputs = [c["progress"], c["status"], *c["plots"].values(), c["table"], c["samples"], c["log"]]

    seen: dict[str, tuple] = {}  # per browser tab's run: what it was last sent, to skip a redraw when nothing moved

    def on_watch(run_name, request: gr.Request):
        key = f"{getattr(request, 'session_hash', '')}:{run_name}"
        stamp = board.watch_stamp(run_name)
        before = seen.get(key)
        if stamp is not None and before == stamp:
            return tuple(gr.skip() for _ in outputs)
        seen[key] = stamp
        view = board.watch(run_name)
        # the plots redraw (and animate) only when metrics.jsonl moved, not at every new log line; an empty frame
        # or one without a line yet is never sent (gradio 6.31's LinePlot then draws no line for any later data)
        same_metrics = stamp is not None and before is not None and before[0] == stamp[0]
        plots = [gr.skip() if same_metrics or not drawable(frame) else frame for frame in view["plots"].values()]
        return (view["progress"], view["status"], *plots, view["table"], view["samples"], view["log"])

    def guarded(action):
        def handler(run_name):
            try:
                if not run_name:
                    raise BoardError("pick a run first")
                return action(run_name)
            except BoardError as err:
                return error_text(err)
        return handler

    for event in (c["refresh"].click, c["run"].change, c["timer"].tick):
        event(on_watch, c["run"], outputs, show_progress="hidden")
    c["live"].change(lambda live: gr.Timer(active=live), c["live"], c["timer"])
    c["stop"].click(guarded(board.stop), c["run"], c["message"])
    c["resume"].click(guarded(board.resume), c["run"], c["message"])


def runs_tab(board: Board, L: Labels) -> dict:
    c: dict = {}
    c["refresh"] = L.track(gr.Button(L("refresh"), elem_id="runs_refresh"), "refresh", "value")
    c["table"] = L.track(gr.Dataframe(board.runs_table(), label=L("runs_table"), interactive=False,
                                      elem_id="runs_table"), "runs_table")
    with gr.Row():
        c["compare"] = L.track(gr.Dropdown(board.run_names(), multiselect=True, label=L("compare_runs"),
                                           elem_id="compare_runs"), "compare_runs")
        keys = [key for _, lines in CURVES for key, _ in lines]
        c["key"] = L.track(gr.Dropdown(keys, value="val/accuracy", label=L("compare_key")), "compare_key")
    c["plot"] = L.track(gr.LinePlot(x="step", y="value", color="series", label=L("compare_plot"),
                                      height=PLOT_HEIGHT + 40, color_title="", elem_id="compare_plot",
                                      elem_classes=["board-plot"]),
                        "compare_plot")
    with gr.Row():
        c["report_run"] = L.track(gr.Dropdown(board.run_names(), label=L("report_run"), elem_id="report_run",
                                              allow_custom_value=True), "report_run")
        c["open"] = L.track(gr.Button(L("open_report"), elem_id="open_report"), "open_report", "value")
    c["report"] = gr.HTML(elem_id="report")
    return c


def wire_runs(board: Board, c: dict) -> None:
    def on_refresh():
        names = board.run_names()
        return board.runs_table(), gr.update(choices=names), gr.update(choices=names)

    c["refresh"].click(on_refresh, None, [c["table"], c["compare"], c["report_run"]])
    def on_compare(names, key):
        frame = board.compare(names, key)
        return frame if drawable(frame) else gr.skip()  # (see wire_watch)

    for event in (c["compare"].change, c["key"].change):
        event(on_compare, [c["compare"], c["key"]], c["plot"])
    c["open"].click(board.report, c["report_run"], c["report"])


def eval_tab(board: Board, L: Labels) -> dict:
    c: dict = {}
    c["target"] = L.track(gr.Dropdown(board.run_names(), label=L("eval_target"), allow_custom_value=True,
                                      elem_id="eval_target"), "eval_target")
    with gr.Row():
        c["n"] = L.track(gr.Number(value=1, precision=0, label=L("eval_n")), "eval_n")
        c["k"] = L.track(gr.Textbox(value="1", label=L("eval_k")), "eval_k")
        c["temperature"] = L.track(gr.Number(value=0.0, label=L("eval_temperature")), "eval_temperature")
        c["max_samples"] = L.track(gr.Number(value=0, precision=0, label=L("eval_max_samples")), "eval_max_samples")
    with gr.Row():
        c["data"] = L.track(gr.Textbox(label=L("eval_data")), "eval_data")
        c["reward"] = L.track(gr.Textbox(label=L("eval_reward")), "eval_reward")
    c["run"] = L.track(gr.Button(L("run_eval"), variant="primary", elem_id="run_eval"), "run_eval", "value")
    c["table"] = L.track(gr.Dataframe(label=L("eval_table"), interactive=False, elem_id="eval_table"), "eval_table")
    c["output"] = L.track(gr.Textbox(label=L("output"), lines=8, max_lines=30, elem_id="eval_output"), "output")

    def on_eval(target, n, k, temperature, max_samples, data, reward):
        try:
            return board.evaluate(target, int(n or 1), k, float(temperature or 0), data, reward, int(max_samples or 0))
        except BoardError as err:
            return None, error_text(err)

    c["run"].click(on_eval, [c["target"], c["n"], c["k"], c["temperature"], c["max_samples"], c["data"], c["reward"]],
                   [c["table"], c["output"]])
    return c


def chat_tab(board: Board, L: Labels) -> dict:
    c: dict = {}
    with gr.Row():
        c["model"] = L.track(gr.Dropdown(board.chat_choices(), label=L("chat_model"), allow_custom_value=True,
                                         elem_id="chat_model"), "chat_model")
        c["load"] = L.track(gr.Button(L("load_model"), elem_id="chat_load"), "load_model", "value")
    c["status"] = gr.Textbox(show_label=False, elem_id="chat_status", interactive=False)
    c["chat"] = L.track(gr.Chatbot(label=L("chat"), elem_id="chatbot", height=320), "chat")
    with gr.Row():
        c["message"] = L.track(gr.Textbox(label=L("message"), elem_id="chat_message", scale=4), "message")
        c["send"] = L.track(gr.Button(L("send"), variant="primary", elem_id="chat_send"), "send", "value")
    with gr.Row():
        c["max_new_tokens"] = L.track(gr.Number(value=64, precision=0, label=L("max_new_tokens")), "max_new_tokens")
        c["temperature"] = L.track(gr.Number(value=0.0, label=L("temperature")), "temperature")

    def on_load(folder):
        try:
            return board.load_chat(folder or "")
        except BoardError as err:
            return error_text(err)

    def on_send(history, message, max_new_tokens, temperature):
        try:
            try:
                tokens, temp = int(max_new_tokens or 64), float(temperature or 0)
            except (TypeError, ValueError, OverflowError):
                raise BoardError(f"max new tokens={max_new_tokens}, temperature={temperature}: numbers, please") from None
            return board.chat(history or [], message or "", tokens, temp), "", ""
        except BoardError as err:
            return history, message, error_text(err)

    c["load"].click(on_load, c["model"], c["status"])
    for event in (c["send"].click, c["message"].submit):
        event(on_send, [c["chat"], c["message"], c["max_new_tokens"], c["temperature"]],
              [c["chat"], c["message"], c["status"]])
    return c


def export_tab(board: Board, L: Labels, chat_model) -> dict:
    c: dict = {}
    with gr.Row():
        c["source"] = L.track(gr.Dropdown(board.run_names(), label=L("export_source"), allow_custom_value=True,
                                          elem_id="export_source"), "export_source")
        c["name"] = L.track(gr.Textbox(label=L("export_name"), elem_id="export_name"), "export_name")
        c["merge"] = L.track(gr.Checkbox(label=L("merge")), "merge")
    c["run"] = L.track(gr.Button(L("run_export"), variant="primary", elem_id="run_export"), "run_export", "value")
    c["output"] = gr.Textbox(show_label=False, elem_id="export_output", interactive=False, lines=2)

    def on_export(source, name, merge):
        try:
            message = board.export(source or "", name or "", bool(merge))
        except BoardError as err:
            return error_text(err), gr.update()
        choices = board.chat_choices()
        return message, gr.update(choices=choices, value=choices[0] if choices else None)

    c["run"].click(on_export, [c["source"], c["name"], c["merge"]], [c["output"], chat_model])
    return c


def build_app(board: Board, lang: str = "en") -> gr.Blocks:
    L = Labels(lang)
    with gr.Blocks(title="rlframe board") as app:
        with gr.Row():
            L.track(gr.Markdown(L("title")), "title", "value")
            language = gr.Dropdown(list(LANGUAGES), value=lang, label="Language / 语言", elem_id="language", scale=0,
                                   min_width=140)
        with L.track(gr.Tab(L("tab_train"), elem_id="tab_train"), "tab_train"):
            train = train_tab(board, L)
        with L.track(gr.Tab(L("tab_watch"), elem_id="tab_watch"), "tab_watch"):
            watch = watch_tab(board, L)
        with L.track(gr.Tab(L("tab_runs"), elem_id="tab_runs"), "tab_runs"):
            runs = runs_tab(board, L)
        with L.track(gr.Tab(L("tab_eval"), elem_id="tab_eval"), "tab_eval"):
            eval_tab(board, L)
        with L.track(gr.Tab(L("tab_chat"), elem_id="tab_chat"), "tab_chat"):
            chat = chat_tab(board, L)
        with L.track(gr.Tab(L("tab_export"), elem_id="tab_export"), "tab_export"):
            export_tab(board, L, chat["model"])
        wire_train(board, train, watch["run"])
        wire_watch(board, watch)
        wire_runs(board, runs)
        language.change(L.updates, language, L.components())
    return app
