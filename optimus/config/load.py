"""Job files: YAML in, a validated `JobConfig` out, or one `ConfigError` naming key and fix."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from optimus.config.checks import ConfigError, check_job
from optimus.config.schema import JobConfig


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `3e-4` as a float (YAML 1.1 wants `3.0e-4`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{source}{where}", f"not valid YAML: {problem}",
                          "fix the syntax there") from None


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `--set section.key=value` to the raw job mapping, value parsed as YAML."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {assignment}", "expected section.key=value",
                          "write it like --set optim.lr=1e-3")
    value = parse_yaml(text, f"--set {key}") if text.strip() else None
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"--set {key}", f"`{where}` is a value, not a section",
                              f"set `{where}` itself")
        node = child
    node[parts[-1]] = value


def load_job(path: str | Path, overrides: list[str] = (), world: int | None = None) -> JobConfig:
    """Read, override, validate; with `world`, also check the layout against that world size."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "no such job file", "give the path of a YAML job file")
    text = path.read_text()
    blank = all(not line.strip() or line.lstrip().startswith("#") for line in text.splitlines())
    raw = None if blank else parse_yaml(text, str(path))  # a stray tab is no YAML error here
    if raw is None:  # nothing but whitespace and comments (or a bare `---`, `null`)
        raise ConfigError(str(path), "the job file is empty: it holds no settings",
                          "write the job into it: `name:` and sections like `model:`, "
                          "`data:`, `optim:` (jobs/tiny-gpt.yaml is a small complete one)")
    if not isinstance(raw, dict):
        got = "a list" if isinstance(raw, list) else f"a single value ({str(raw)[:40]!r})"
        raise ConfigError(str(path), f"the job file is {got}, not a mapping of sections",
                          "start it with `name: ...` and sections like `model:`")
    raw.setdefault("name", path.stem)
    for assignment in overrides:
        apply_override(raw, assignment)
    with_site(raw, path)
    return validate_job(raw, source=str(path), world=world)


SITE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
SITE_KEYS = ("description", "network")


def with_site(raw: dict, path: Path) -> None:
    """The job's `site:` profile (`sites/<site>.yaml` beside the job file) under its own
    `network` section: the job's keys win, its `env` entries over the profile's."""
    site = raw.get("site")
    if site is None:
        return
    if not isinstance(site, str) or not SITE_NAME.match(site):
        return  # the schema refuses it, with the rule
    folder = path.parent / "sites"
    profile_path = folder / f"{site}.yaml"
    if not profile_path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        raise ConfigError(f"{path}: site", f"no site profile {site!r} in {folder}",
                          f"name one of {', '.join(known)}" if known else
                          "write it there (jobs/sites/ has examples), or drop `site:`")
    if profile_path.stat().st_size > 1 << 20:
        raise ConfigError(str(profile_path), "larger than 1 MiB: not a site profile",
                          "keep it to its `network` section")
    profile = parse_yaml(profile_path.read_text(), str(profile_path)) or {}
    if not isinstance(profile, dict) or set(profile) - set(SITE_KEYS):
        extra = sorted(set(profile) - set(SITE_KEYS)) if isinstance(profile, dict) else []
        raise ConfigError(str(profile_path), "a site profile is a mapping of "
                          f"{' and '.join(SITE_KEYS)}" + (f", not {', '.join(extra)}" if extra
                                                          else ""),
                          "keep only those keys; the rest belongs in the job file")
    theirs, ours = profile.get("network") or {}, raw.get("network") or {}
    if not isinstance(theirs, dict):
        raise ConfigError(f"{profile_path}: network", "not a section",
                          "write `network:` with `interface:` and `env:` under it")
    if not isinstance(ours, dict):
        return  # the schema refuses the job's, saying why
    merged = {**theirs, **ours}
    if isinstance(theirs.get("env"), dict) and isinstance(ours.get("env"), dict):
        merged["env"] = {**theirs["env"], **ours["env"]}
    raw["network"] = merged


def validate_job(raw: dict, source: str = "job", world: int | None = None) -> JobConfig:
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as e:
        problems = [_describe(err) for err in e.errors()]
        raise ConfigError(source, problems=problems) from None
    check_job(job, world=world, source=source)
    return job


# Keys that an older Optimus read, and where they live now.
MOVED = {"parallel.precision": "training.mixed_precision"}

_TYPE_FIXES = {
    "int_type": "write a whole number, unquoted",
    "float_type": "write a number, unquoted",
    "bool_type": "write true or false",
    "string_type": "write a string",
    "literal_error": "use one of the values named",
    "model_type": "write a mapping of keys under it",
    "dict_type": "write a mapping of keys under it",
    "list_type": "write a list",
}


def _describe(err: dict) -> tuple[str, str, str]:
    """(key, what is wrong, how to fix it) for one pydantic error."""
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc) or "(top level)"
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        if key in MOVED:
            return key, "this key has moved", f"write it as `{MOVED[key]}`"
        known = _known_keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(known)}"
        return key, "unknown key", f"remove it; {hint}"
    if kind == "missing":
        return key, "required but missing", f"add `{loc[-1]}:` to the job file"
    if kind in _TYPE_FIXES or kind.endswith("_type") or kind == "literal_error":
        got = f"{value!r} ({type(value).__name__})"
        fix = _TYPE_FIXES.get(kind, "change the value")
        return key, f"{_lower_first(err['msg'])}, got {got}", fix
    if kind == "value_error":
        return key, err["msg"].removeprefix("Value error, "), "see docs/config.md"
    return key, f"{_lower_first(err['msg'])}, got {value!r}", "change the value"


def _known_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] = JobConfig
    for part in loc:
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def job_hash(job: JobConfig) -> str:
    """A short fingerprint of the resolved job, recorded with every checkpoint."""
    text = json.dumps(job.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
