"""What the agent-program path reads before it runs: the agent's file (checked without running it), the chat
template's append-only property, and the dataset row's messages recovered from its templated prompt."""

from __future__ import annotations

import ast

SENTINEL = "\u2063ROW\u2063"
# an agent's conversation: question, a call, its result, the answer (as rlframe/doctor/template_checks.py checks)
TOOL_CONVERSATION = [{"role": "user", "content": "What is 12 + 7? Put the answer in \\boxed{}."},
                     {"role": "assistant", "content": "Let me compute 12 + 7."},
                     {"role": "tool", "content": "19"},
                     {"role": "assistant", "content": "12 + 7 = 19. \\boxed{19}"}]


def agent_function_problem(path: str, name: str) -> str | None:
    """Why `path` cannot serve `name(row)` (read with `ast`, not imported: the driver does not run the agent), or None."""
    from rlframe.workers.rollout.tools import resolve_tool_path

    file = resolve_tool_path(path)  # as given, else inside the checkout / package (as tool files are found)
    if not file.is_file():
        return f"file not found: {path}. Fix: rollout.agent_program.path=<the Python file that defines {name}(row)>"
    try:
        tree = ast.parse(file.read_text(), filename=str(file))
    except SyntaxError as error:
        return f"{path} line {error.lineno}: {error.msg}. Fix the file"
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if name not in defined:
        return (f"{path} defines no top-level function '{name}' (it defines: {', '.join(defined) or 'none'}). "
                f"Fix: rollout.agent_program.name=<one of them>")
    return None


def template_rewrites(model_dir: str, trust_remote_code: bool = False) -> str | None:
    """Why the model's chat template is not append-only (a conversation one message longer must render with the
    shorter one's rendering as its prefix), or None."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        return f"{model_dir} has no chat template"
    messages = TOOL_CONVERSATION
    try:
        texts = [tokenizer.apply_chat_template(messages[:k], tokenize=False) for k in range(1, len(messages) + 1)]
    except Exception as error:  # a template without a tool role, etc.
        return f"the template cannot render a tool conversation ({type(error).__name__}: {error})"
    for k in range(1, len(texts)):
        if not texts[k].startswith(texts[k - 1]):
            return f"rendering message {k + 1} rewrites message {k} or earlier"
    return None


def prompt_messages(tokenizer, prompt_text: str) -> list[dict]:
    """The chat messages of a templated one-user-message prompt (the template rendered around a sentinel user
    message gives the text before and after the content); else the whole text as one user message."""
    try:
        framed = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                               add_generation_prompt=True)
    except Exception:
        return [{"role": "user", "content": prompt_text}]
    before, _, after = framed.partition(SENTINEL)
    if prompt_text.startswith(before) and prompt_text.endswith(after) and len(prompt_text) >= len(before) + len(after):
        return [{"role": "user", "content": prompt_text[len(before): len(prompt_text) - len(after)]}]
    return [{"role": "user", "content": prompt_text}]
