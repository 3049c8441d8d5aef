"""Which metrics the monitoring files reference, and which a scrape exports.

`metric_names(expr)` reads the metric names out of a PromQL expression (or a Grafana variable
query) without a full parser: PromQL's lexical rules are enough. Strings, comments, label
matchers `{...}`, ranges and subqueries `[...]`, Grafana variables and the label lists of
by / without / on / ignoring / group_left / group_right go first; of the identifiers left, one
followed by `(` is a function or aggregation, a keyword is a keyword, and the rest are metrics.
`monitoring_expressions()` collects every expression of the dashboard (its panels, annotations
and variables) and the alert rules;
`exported_names(text)` lists the sample names of a Prometheus exposition.
"""

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "monitoring" / "grafana" / "dashboards"
ALERTS = ROOT / "monitoring" / "prometheus" / "alerts.yml"

KEYWORDS = {"and", "or", "unless", "atan2", "by", "without", "on", "ignoring", "group_left",
            "group_right", "bool", "offset", "inf", "nan"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}

_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_NAME_MATCHER = re.compile(r"__name__\s*=\s*\"(\d+)\"")
_UNIT = r"(?:ms|[smhdwy])"
_TOKEN = re.compile(
    rf"(?P<duration>(?:\d+{_UNIT})+)(?![\w:])"
    r"|(?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<ident>[a-zA-Z_:][\w:]*)"
    r"|(?P<paren>[()])"
    r"|(?P<other>\S)"
)
# Grafana's Prometheus variable queries: label_values(expr, label), query_result(expr).
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((?P<args>.*)\)\s*$", re.S)
_QUERY_RESULT = re.compile(r"^\s*query_result\s*\((?P<expr>.*)\)\s*$", re.S)


def _strip_strings(expr: str) -> tuple[str, list[str]]:
    """Replace each string literal with `"<n>"` (n indexes the returned list); drop comments."""
    out, strings, i = [], [], 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            j, value = i + 1, []
            while j < len(expr) and expr[j] != c:
                if expr[j] == "\\" and c != "`" and j + 1 < len(expr):
                    j += 1
                value.append(expr[j])
                j += 1
            out.append(f'"{len(strings)}"')
            strings.append("".join(value))
            i = j + 1
        elif c == "#":
            while i < len(expr) and expr[i] != "\n":
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out), strings


def _grafana_query(expr: str) -> str:
    """The PromQL inside a Grafana variable query; a plain expression comes back as it is."""
    if m := _QUERY_RESULT.match(expr):
        return m["expr"]
    if m := _LABEL_VALUES.match(expr):
        args = m["args"]
        # label_values(label) names no metric; label_values(expr, label) queries expr.
        head, comma, _label = args.rpartition(",")
        return head if comma else ""
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or Grafana variable query) reads."""
    text, strings = _strip_strings(_grafana_query(expr))
    text = _VARIABLE.sub(" 0 ", text)
    names = set()
    for matchers in _MATCHERS.findall(text):
        names.update(strings[int(n)] for n in _NAME_MATCHER.findall(matchers))
    text = _MATCHERS.sub(" ", text)
    while _RANGE.search(text):
        text = _RANGE.sub(" ", text)
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(text)]
    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "ident" and value.lower() in GROUPING and following == "(":
            depth, i = 0, i + 1  # skip the label list: by (a, b)
            while i < len(tokens):
                depth += {"(": 1, ")": -1}.get(tokens[i][1], 0)
                if depth == 0:
                    break
                i += 1
        elif (kind == "ident" and value.lower() not in KEYWORDS and following != "("
              # an aggregation may put its grouping first: sum by (le) (...)
              and (following or "").lower() not in ("by", "without")):
            names.add(value)
        i += 1
    return names


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_expressions(path: Path) -> dict[str, str]:
    """Every target's expr, every annotation query's and every query variable's query in one
    dashboard JSON file."""
    dashboard = json.loads(path.read_text())
    found = {}
    for panel in _panels(dashboard.get("panels", [])):
        targets = [t for t in panel.get("targets", []) if t.get("expr")]
        for target in targets:
            key = f"dashboard: {panel.get('title', '')}"
            if len(targets) > 1:
                key += f" [{target.get('refId', targets.index(target))}]"
            if key in found:
                raise ValueError(f"{path.name}: two expressions at {key!r}; titles must differ")
            found[key] = target["expr"]
    for note in dashboard.get("annotations", {}).get("list", []):
        if note.get("expr"):
            found[f"dashboard annotation: {note['name']}"] = note["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if query:
            found[f"dashboard variable: {variable['name']}"] = query
    return found


def alert_expressions(path: Path = ALERTS) -> dict[str, str]:
    """Every rule's expr in a Prometheus rules file, keyed `alert: NAME` or `record: NAME`."""
    found = {}
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            kind = "alert" if "alert" in rule else "record"
            key = f"{kind}: {rule[kind]}"
            n = 2
            while key in found:
                key, n = f"{kind}: {rule[kind]} ({n})", n + 1
            found[key] = rule["expr"]
    return found


def monitoring_expressions(root: Path = ROOT) -> dict[str, str]:
    """Every PromQL expression of the dashboards and the alert rules under `root`."""
    found = {}
    parts = [dashboard_expressions(path)
             for path in sorted((root / DASHBOARDS.relative_to(ROOT)).glob("*.json"))]
    for part in [*parts, alert_expressions(root / ALERTS.relative_to(ROOT))]:
        if clash := found.keys() & part.keys():
            raise ValueError(f"two monitoring expressions share a name: {sorted(clash)}")
        found.update(part)
    return found


def exported_names(scrape_text: str) -> set[str]:
    """Every sample name in a Prometheus text exposition (histograms give _bucket, _sum and
    _count; counters their _total)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name for family in text_string_to_metric_families(scrape_text)
            for sample in family.samples}
