"""The page's labels in English and Chinese; `Labels` remembers each labelled component so that the language
drop-down can relabel the whole page at once."""

from __future__ import annotations

LANGUAGES = ("en", "zh")

TEXT: dict[str, tuple[str, str]] = {
    "title": ("## rlframe board: configure, launch, watch and evaluate RL runs", "## rlframe 看板：配置、启动、监控和评估强化学习训练"),
    "language": ("Language", "语言"),
    "tab_train": ("Train", "训练"), "tab_watch": ("Watch", "监控"), "tab_runs": ("Runs", "运行记录"),
    "tab_eval": ("Evaluate", "评估"), "tab_chat": ("Chat", "对话"), "tab_export": ("Export", "导出"),
    "stage": ("Stage", "训练阶段"), "recipe": ("Recipe", "配方"),
    "model_source": ("Model", "模型来源"), "model_path": ("Local HF folder or hub id", "本地 HF 目录或 Hub 模型名"),
    "data": ("Data", "数据"), "data_source": ("Data source", "数据来源"),
    "train_upload": ("Training data file (parquet, jsonl, json, csv, arrow)", "训练数据文件 (parquet, jsonl, json, csv, arrow)"),
    "val_upload": ("Validation data file (optional)", "验证数据文件（可选）"),
    "data_rows": ("First rows", "前几行"), "prompt_col": ("Prompt column", "提示词列"),
    "answer_col": ("Answer column", "答案列"), "image_col": ("Images column", "图像列"),
    "video_col": ("Videos column", "视频列"), "audio_col": ("Audios column", "音频列"),
    "reward": ("Reward", "奖励函数"), "reward_pick": ("Reward function file", "奖励函数文件"),
    "reward_name": ("Function name", "函数名"), "reward_upload": ("Upload a reward .py", "上传奖励函数 .py"),
    "try_reward": ("Try it: score the data's own answers and wrong ones", "试一试：给数据自带答案和错误答案打分"),
    "try_table": ("Scores", "得分"),
    "judge_url": ("LLM judge URL (OpenAI-compatible; optional)", "LLM 评审 URL（OpenAI 兼容，可选）"),
    "judge_model": ("Judge model (served name)", "评审模型（服务名称）"),
    "teacher": ("Teacher (on-policy distillation)", "教师模型（在线策略蒸馏）"),
    "teacher_path": ("Teacher model folder (the student's tokenizer; optional)", "教师模型目录（与学生模型同一分词器，可选）"),
    "distillation_loss_mode": ("Distillation loss", "蒸馏损失"),
    "settings_main": ("Main settings", "常用参数"),
    "total_steps": ("Training steps", "训练步数"), "lr": ("Learning rate", "学习率"),
    "train_batch_size": ("Prompts per step", "每步提示词数"), "rollout_n": ("Samples per prompt", "每个提示词采样数"),
    "temperature": ("Sampling temperature", "采样温度"), "max_prompt_length": ("Max prompt tokens", "提示词最大长度"),
    "max_response_length": ("Max response tokens", "回复最大长度"), "kl_loss_coef": ("KL loss coefficient", "KL 损失系数"),
    "save_every": ("Checkpoint every N steps", "每 N 步保存检查点"), "val_every": ("Validate every N steps", "每 N 步验证"),
    "yaml": ("Full configuration (YAML): edit any other key", "完整配置 (YAML)：可修改其他任意参数"),
    "show_yaml": ("Show the full configuration", "显示完整配置"),
    "run_name": ("Run name (folder under the workspace's runs/)", "运行名称（工作区 runs/ 下的目录）"),
    "preview": ("Preview", "预览"), "launch": ("Launch", "启动"),
    "validation": ("Validation", "配置检查"), "memory_plan": ("Memory plan", "显存/内存规划"),
    "command": ("Equivalent command line", "等价命令行"),
    "settings_name": ("Settings name", "配置名称"), "save_settings": ("Save settings", "保存配置"),
    "load_settings": ("Load settings", "加载配置"), "saved_settings": ("Saved settings", "已保存的配置"),
    "watch_run": ("Run", "运行"), "refresh": ("Refresh", "刷新"), "progress": ("Progress", "进度"),
    "status": ("Status", "状态"), "stop": ("Stop (clean, keeps the last checkpoint)", "停止（安全停止，保留最新检查点）"),
    "resume": ("Resume", "继续训练"), "metrics": ("Latest steps", "最近步骤"),
    "samples": ("Latest sample rollouts", "最新采样结果"), "log": ("Log tail", "日志末尾"),
    "live": ("Live update", "实时刷新"),
    "plot_reward": ("Reward", "奖励"), "plot_accuracy": ("Accuracy", "准确率"), "plot_kl": ("KL", "KL 散度"),
    "plot_response_length": ("Response length", "回复长度"), "plot_logprob_gap": ("Log-prob gap", "对数概率差"),
    "plot_throughput": ("Throughput", "吞吐量"), "plot_memory": ("Memory", "内存"),
    "runs_table": ("Run folders", "运行目录"), "compare_runs": ("Runs to compare", "对比的运行"),
    "compare_key": ("Metric", "指标"), "compare_plot": ("Comparison", "对比"),
    "report_run": ("Run to open", "打开的运行"), "open_report": ("Open the report", "打开报告"),
    "eval_target": ("Run folder, checkpoint or model folder", "运行目录、检查点或模型目录"),
    "eval_n": ("Samples per prompt (n)", "每个提示词采样数 (n)"), "eval_k": ("k (pass@k, mean@k, maj@k)", "k (pass@k, mean@k, maj@k)"),
    "eval_temperature": ("Temperature", "温度"), "eval_data": ("Data files (default: the run's validation data)", "数据文件（默认：运行的验证集）"),
    "eval_reward": ("Reward file[:function] (default: the run's)", "奖励函数文件[:函数]（默认：运行的）"),
    "eval_max_samples": ("First N prompts (0: all)", "前 N 个提示词（0：全部）"),
    "run_eval": ("Evaluate", "开始评估"), "eval_table": ("Results", "结果"), "output": ("Output", "输出"),
    "chat_model": ("Model folder (an export, a run's hf_model, a hub id)", "模型目录（导出目录、运行的 hf_model 或 Hub 名）"),
    "load_model": ("Load the model", "加载模型"), "chat": ("Conversation", "对话"), "message": ("Message", "消息"),
    "send": ("Send", "发送"), "max_new_tokens": ("Max new tokens", "最大生成长度"),
    "export_source": ("Run folder (its newest checkpoint) or checkpoint folder", "运行目录（最新检查点）或检查点目录"),
    "export_name": ("Export name (folder under the workspace's exports/)", "导出名称（工作区 exports/ 下的目录）"),
    "merge": ("LoRA: merge the adapters into the model (else the adapter folder)", "LoRA：合并适配器（否则只导出适配器）"),
    "run_export": ("Export", "导出"),
}


def text(key: str, lang: str = "en") -> str:
    en, zh = TEXT[key]
    return zh if lang == "zh" else en


class Labels:
    """`labels(component, key)` sets a component's label (or a button's text) now and on a language change."""

    def __init__(self, lang: str = "en"):
        self.lang = lang
        self.tracked: list[tuple[object, str, str]] = []

    def __call__(self, key: str) -> str:
        return text(key, self.lang)

    def track(self, component, key: str, attr: str = "label"):
        self.tracked.append((component, key, attr))
        return component

    def components(self) -> list:
        return [c for c, _, _ in self.tracked]

    def updates(self, lang: str) -> list:
        import gradio as gr

        return [gr.update(**{attr: text(key, lang)}) for _, key, attr in self.tracked]
