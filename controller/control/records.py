"""Redis records read back into the rules' views (controller/control/view.py).

The job record is the controller's own; requests come from operators, exits and status from
agents: what those write is checked where a rule does arithmetic on it (`number`, `count`: a
bad value reads as absent)."""

from __future__ import annotations

import json

from controller.control.view import Exit, JobView, Request


def job_view(r: dict[str, str]) -> JobView:
    def when(key: str) -> float | None:
        return float(r[key]) if r.get(key) else None

    def loaded(key: str, default):
        return json.loads(r[key]) if r.get(key) else default
    return JobView(state=r.get("state", "PENDING"), reason=r.get("reason", ""),
                   generation=int(r.get("generation", -1)), restarts=int(r.get("restarts", 0)),
                   desired=r.get("desired") or None, desired_by=r.get("desired_by", ""),
                   desired_reason=r.get("desired_reason", ""),
                   requests_seen=r.get("requests_seen", "0"),
                   restart_causes=loaded("restart_causes", {}),
                   failure_since=when("failure_since"), next_plan_at=when("next_plan_at"),
                   progress_gen=int(r["progress_gen"]) if r.get("progress_gen") else None,
                   progress_step=int(r.get("progress_step", -1)),
                   progress_at=when("progress_at"),
                   progress_moves=int(r.get("progress_moves", 0)),
                   step_times=tuple(loaded("step_times", [])), hang_since=when("hang_since"),
                   failures=loaded("failures", {}), losses=_times(loaded("losses", {})),
                   stragglers=tuple(loaded("stragglers", [])),
                   resumed_gen=int(r["resumed_gen"]) if r.get("resumed_gen") else None,
                   resumed_step=int(r["resumed_step"]) if r.get("resumed_step") else None,
                   suspect=loaded("suspect", None), skips=tuple(loaded("skips", [])),
                   rewinds=tuple(loaded("rewinds", [])), behind=_behind(loaded("behind", None)),
                   lost_s=_seconds(loaded("lost_s", {})),
                   last_recovery=loaded("last_recovery", None))


def _behind(value) -> dict | None:
    """Where a restart found the job (actions.restarted), or None when it is not one: the
    rules do arithmetic on its step and time."""
    if (isinstance(value, dict) and type(value.get("step")) is int
            and type(value.get("at")) in (int, float) and isinstance(value.get("cause"), str)):
        return value
    return None


def _times(value) -> dict:
    """Node -> a list of times (controller/control/forgive.py's `losses`), only the entries
    that are one: the rule counts and compares them."""
    if not isinstance(value, dict):
        return {}
    return {k: [t for t in v if number(t) is not None] for k, v in value.items()
            if isinstance(v, list)}


def _seconds(value) -> dict:
    """Cause -> seconds, only the entries that are numbers."""
    return {k: v for k, v in value.items() if type(v) in (int, float)} if isinstance(
        value, dict) else {}


def request(rid: str, r: dict[str, str]) -> Request:
    return Request(id=rid, action=r.get("action", ""), actor=r.get("actor", "?"),
                   host=r.get("host", ""), reason=r.get("reason", ""),
                   time=float(r.get("time") or 0.0), node=r.get("node", ""),
                   checkpoint=r.get("checkpoint") == "1", to=_int(r.get("to")),
                   skip=_window(r.get("skip")), samples=_int(r.get("samples")))


def _int(text: str | None) -> int | None:
    """A step or a count in an operator's request (validated: it crossed a boundary)."""
    return int(text) if isinstance(text, str) and text.isdigit() and len(text) < 13 else None


def _window(text: str | None) -> tuple[int, int] | None:
    """"A:B" steps, A <= B."""
    first, _, last = (text or "").partition(":")
    a, b = _int(first), _int(last)
    return (a, b) if a is not None and b is not None and 1 <= a <= b else None


def health(info: dict) -> str:
    return info.get("health_detail") or f"{info.get('health', 'unknown')}"


def exit_record(r: dict) -> Exit:
    return Exit(node=r["node"], rank=int(r["rank"]), generation=int(r["generation"]),
                code=r.get("code"), signal=r.get("signal"), by_agent=bool(r.get("by_agent")),
                tail=r.get("tail", ""), time=float(r.get("time", 0.0)),
                tail_age=number(r.get("tail_age")),
                local_rank=int(r.get("local_rank", -1)), launch=int(r.get("launch", 0)))


def number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def count(text: str | None) -> int | None:
    """A small count an agent wrote (validated: it crossed a boundary)."""
    return int(text) if isinstance(text, str) and text.isdigit() and len(text) < 7 else None


def port(text: str | None) -> int:
    """A rendezvous port an agent offers (`next_port`, controller/node/ports.py): a number
    above the privileged range, else 0 (none offered: the plan carries none)."""
    if (isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 5
            and 1024 <= int(text) < 65_536):
        return int(text)
    return 0
