"""One doctor check's result (name, status, what was measured, the fix), the console table and doctor.json."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATUSES = ("pass", "warn", "fail", "skip")


@dataclass
class CheckResult:
    """`status`: pass | warn (the run works, but look) | fail (the run would train on something else than
    intended, or not start) | skip (not applicable to this configuration). `fix`: what to change (empty on a pass)."""

    group: str
    name: str
    status: str
    measured: str
    fix: str = ""
    seconds: float = 0.0


def passed(group: str, name: str, measured: str) -> CheckResult:
    return CheckResult(group, name, "pass", measured)


def warned(group: str, name: str, measured: str, fix: str) -> CheckResult:
    return CheckResult(group, name, "warn", measured, fix)


def failed(group: str, name: str, measured: str, fix: str) -> CheckResult:
    return CheckResult(group, name, "fail", measured, fix)


def skipped(group: str, name: str, why: str) -> CheckResult:
    return CheckResult(group, name, "skip", why)


def timed(check, *args, **kwargs) -> list[CheckResult]:
    """Run `check(*args, **kwargs)` (one result or a list) and stamp each result with the seconds it took."""
    start = time.perf_counter()
    out = check(*args, **kwargs)
    results = out if isinstance(out, list) else [out]
    for result in results:
        result.seconds = round((time.perf_counter() - start) / len(results), 3)
    return results


def counts(results: list[CheckResult]) -> dict[str, int]:
    return {status: sum(r.status == status for r in results) for status in STATUSES}


MARKS = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def table(results: list[CheckResult], width: int = 160) -> str:
    """The checklist: one line per check (status, group/name, what was measured), then the fixes."""
    name_width = max((len(f"{r.group}/{r.name}") for r in results), default=10)
    lines = []
    for r in results:
        measured = r.measured if len(r.measured) <= width else r.measured[: width - 3] + "..."
        lines.append(f"  {MARKS[r.status]:4}  {f'{r.group}/{r.name}':{name_width}}  {measured}")
    fixes = [r for r in results if r.status in ("fail", "warn") and r.fix]
    if fixes:
        lines.append("")
        lines.append("what to do:")
        lines += [f"  {MARKS[r.status]} {r.group}/{r.name}: {r.fix}" for r in fixes]
    summary = counts(results)
    lines.append("")
    lines.append(f"doctor: {summary['pass']} pass, {summary['warn']} warn, {summary['fail']} fail, {summary['skip']} skipped")
    return "\n".join(lines)


def write_doctor_json(run_dir: Path, results: list[CheckResult], argv: list[str], wall_s: float) -> Path:
    """<run_dir>/doctor.json: every check's result, the counts, the arguments and the wall time (the run
    report shows it)."""
    path = Path(run_dir) / "doctor.json"
    path.write_text(json.dumps({"argv": argv, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": round(wall_s, 1),
                                "counts": counts(results), "checks": [asdict(r) for r in results]}, indent=2))
    return path


def read_doctor_json(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "doctor.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
