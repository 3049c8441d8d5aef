"""Mutation testing of one module: which small, plausible bugs do its unit tests let through?

Our own, on the standard library's `ast`: mutmut and cosmic-ray fight with this layout (two
top-level packages, an editable install, and a conftest that puts the repo first on sys.path).

    .venv/bin/python tests/mutate.py MODULE_PATH --tests "tests/test_x.py tests/test_y.py" \
        [--only LINE,...] [--list] [--exclude FILE] [--workers N] [--fail-under PCT]

Each mutant changes one spot: a comparison flipped at its boundary or its sense (< <=, > >=,
== !=, in / not in, is / is not), and / or swapped, an if / while / ternary condition wrapped
in `not (...)`, an integer constant +1 and -1 (bools skipped), a subscript [0] <-> [-1],
`return X` -> `return None`, + <-> - (and += <-> -=), min <-> max, break <-> continue. It is
made by replacing the exact source text of that spot, so the rest of the file stays
byte-identical.

The working tree is never written. Each of N workers gets its own copy of the repo (all but
.venv, .git and caches) in a temp dir and runs `pytest -x -q -p no:cacheprovider TESTS` there,
with the copy first on PYTHONPATH and as the working directory, so the copy's packages are the
ones imported (the editable install's finder comes after PYTHONPATH; the conftest inserts the
copy's root). That is checked before any mutant runs: once with `import`, once with a canary
(the module made to raise on import; its tests must then fail). No bytecode is written, so a
mutant the same size as the last can never be served a stale .pyc.

A mutant is killed when the tests fail, timed out (counted as killed: an endless loop is
caught) when they run past 10x the unmutated run (at least 60 s), survived when they pass.
Survivors print as `path:line: original -> mutant`; `--exclude` (default
tests/mutate_equivalent.txt) lists mutants known to be equivalent, one per line exactly as
printed, each followed by `  # why`. Exit status: 1 when the tool cannot run, 2 when the score
is below --fail-under, else 0.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tokenize
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parents[1]
NOT_COPIED = {".venv", ".git", "runs", ".pytest_cache", ".ruff_cache", ".whl", "__pycache__"}
FLIP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "==",
        ast.In: "not in", ast.NotIn: "in", ast.Is: "is not", ast.IsNot: "is"}
SENSE = {ast.Lt: ">=", ast.LtE: ">", ast.Gt: "<=", ast.GtE: "<"}  # the comparison's opposite
CANARY = "mutate.py canary: this copy is the one imported"


@dataclass(frozen=True)
class Mutant:
    line: int
    start: int  # character offsets in the source: text[start:end] is replaced by `new`
    end: int
    new: str
    shown: str  # "original -> mutant", on one line

    def apply(self, text: str) -> str:
        return text[:self.start] + self.new + text[self.end:]


# --- finding mutants ---------------------------------------------------------------------------

class Source:
    """A module's text, its AST and its tokens, with AST positions as character offsets."""

    def __init__(self, text: str):
        self.text = text
        self.tree = ast.parse(text)
        self.lines = text.splitlines(keepends=True)
        self.line_at = [0]
        for line in self.lines:
            self.line_at.append(self.line_at[-1] + len(line))
        self.tokens = [(self.at(*t.start, chars=True), self.at(*t.end, chars=True), t.string)
                       for t in tokenize.generate_tokens(StringIO(text).readline)
                       if t.type in (tokenize.OP, tokenize.NAME)]
        self.token_starts = [t[0] for t in self.tokens]

    def at(self, line: int, col: int, chars: bool = False) -> int:
        """Offset of (line, col); ast's col is in UTF-8 bytes, tokenize's in characters."""
        if not chars:
            col = len(self.lines[line - 1].encode()[:col].decode())
        return self.line_at[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (self.at(node.lineno, node.col_offset),
                self.at(node.end_lineno, node.end_col_offset))

    def seg(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def between(self, a: ast.AST, b: ast.AST, op: str) -> tuple[int, int]:
        """The span of operator `op` (e.g. "<=", "not in") between nodes a and b."""
        lo, hi = self.span(a)[1], self.span(b)[0]
        words = op.split()
        i = bisect.bisect_left(self.token_starts, lo)
        found = []
        while i < len(self.tokens) and self.tokens[i][1] <= hi:
            if self.tokens[i][2] in words:
                found.append(self.tokens[i])
            i += 1
        if [t[2] for t in found] == words:
            return found[0][0], found[-1][1]
        # Inside an f-string (one STRING token before Python 3.12): search the text itself.
        edge = [r"\b" if w[0].isalpha() else r"(?<![<>=!+\-*/])" for w in words]
        pattern = r"\s+".join(e + re.escape(w) + (r"\b" if w[0].isalpha() else r"(?![<>=])")
                               for e, w in zip(edge, words, strict=True))
        m = re.search(pattern, self.text[lo:hi])
        if m is None:
            raise ValueError(f"no {op!r} between offsets {lo} and {hi}")
        return lo + m.start(), lo + m.end()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _int_text(old: str, value: int) -> str:
    if old[:2].lower() == "0x":
        return f"0x{value:X}" if old[2:] == old[2:].upper() else hex(value)
    return str(value)


def mutants(src: Source) -> list[Mutant]:
    """Every mutant of the module, in source order, each one parsing."""
    found: dict[tuple[int, int, str], Mutant] = {}  # the first way to make a mutant names it
    parents = {child: node for node in ast.walk(src.tree) for child in ast.iter_child_nodes(node)}

    def add(node: ast.AST, start: int, end: int, new: str, shown: tuple[int, int] | None = None):
        """Mutate text[start:end] to `new`; shown within text[shown] (default: the node's)."""
        c0, c1 = shown or src.span(node)
        before = src.text[c0:c1]
        after = before[:start - c0] + new + before[end - c0:]
        found.setdefault((start, end, new), Mutant(
            node.lineno, start, end, new, f"{_one_line(before)} -> {_one_line(after)}"))

    def replace(node: ast.AST, new: str, shown: tuple[int, int] | None = None):
        add(node, *src.span(node), new, shown)

    def around(node: ast.AST) -> tuple[int, int]:
        """What to show around a small node: the largest enclosing expression or statement on
        one line that reads at a glance, else its whole line when short enough, else itself."""
        best, up = node, parents.get(node)
        while up is not None:
            if hasattr(up, "lineno"):
                if up.lineno != up.end_lineno or len(src.seg(up)) > 80:
                    break
                best = up
            if isinstance(up, ast.stmt):
                break
            up = parents.get(up)
        if best is node and node.lineno == node.end_lineno:
            line = src.at(node.lineno, 0), src.line_at[node.lineno] - 1
            if len(src.text[line[0]:line[1]].strip()) <= 100:
                return line
        return src.span(best)

    for node in ast.walk(src.tree):
        if hasattr(node, "lineno") and not _positions_hold(src, node):
            continue  # ast's positions inside some f-strings before 3.12 are off: leave them
        if isinstance(node, ast.Compare):
            left = node.left
            for op, right in zip(node.ops, node.comparators, strict=True):
                start, end = src.between(left, right, _OP[type(op)])
                for new in (FLIP[type(op)], SENSE.get(type(op))):
                    if new:
                        add(node, start, end, new)
                left = right
        elif isinstance(node, ast.BoolOp):
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            for a, b in zip(node.values, node.values[1:], strict=False):
                add(node, *src.between(a, b, old), new)
        elif isinstance(node, ast.If | ast.While | ast.IfExp):
            replace(node.test, f"not ({src.seg(node.test)})")
        elif isinstance(node, ast.Subscript) and _int_value(node.slice) in (0, -1):
            replace(node.slice, "-1" if _int_value(node.slice) == 0 else "0", src.span(node))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            index = parents.get(parents.get(node))  # [-1] -> [-0] is [-1] -> [0] again
            twice = isinstance(index, ast.Subscript) and _int_value(index.slice) == -1
            for new in (node.value + 1, node.value - 1):
                if not (twice and new == 0):
                    replace(node, _int_text(src.seg(node), new), around(node))
        elif isinstance(node, ast.Return):
            if node.value is not None and not (
                    isinstance(node.value, ast.Constant) and node.value.value is None):
                replace(node.value, "None", src.span(node))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            old, new = ("+", "-") if isinstance(node.op, ast.Add) else ("-", "+")
            add(node, *src.between(node.left, node.right, old), new)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add | ast.Sub):
            old, new = ("+=", "-=") if isinstance(node.op, ast.Add) else ("-=", "+=")
            add(node, *src.between(node.target, node.value, old), new)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("min", "max")):
            replace(node.func, "max" if node.func.id == "min" else "min", around(node.func))
        elif isinstance(node, ast.Break | ast.Continue):
            replace(node, "continue" if isinstance(node, ast.Break) else "break")
    out = sorted(found.values(), key=lambda m: (m.start, m.end, m.new))
    for m in out:
        ast.parse(m.apply(src.text))  # a mutant that does not parse is a bug of this tool
    return _numbered(out)


_OP = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
       ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}


def _int_value(node: ast.AST) -> int | None:
    """The value of an int literal (`-1` included), else None; bools are not ints here."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _int_value(node.operand)
        return None if value is None else -value
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def _positions_hold(src: Source, node: ast.AST) -> bool:
    """Whether the node's source segment is the node (the replacements rely on it)."""
    text = src.seg(node)
    try:
        if isinstance(node, ast.expr):
            again = ast.parse(f"(\n{text}\n)", mode="eval").body
        elif isinstance(node, ast.Return | ast.Break | ast.Continue | ast.AugAssign):
            again = ast.parse(text).body[0]
        else:
            return True  # If / While: only their test is replaced, and it is checked itself
    except SyntaxError:
        return False
    return _dump(again) == _dump(node)


def _dump(node: ast.AST) -> str:
    return re.sub(r"Store\(\)|Del\(\)", "Load()", ast.dump(node))


def _numbered(found: list[Mutant]) -> list[Mutant]:
    """Mutants that would print the same on one line get ` [2]`, ` [3]`... so each has a name."""
    seen: dict[tuple[int, str], int] = {}
    out = []
    for m in found:
        n = seen[m.line, m.shown] = seen.get((m.line, m.shown), 0) + 1
        out.append(m if n == 1 else Mutant(m.line, m.start, m.end, m.new, f"{m.shown} [{n}]"))
    return out


# --- running them ------------------------------------------------------------------------------

class Workers:
    """N private copies of the repo, each running one mutant's tests at a time."""

    def __init__(self, module: str, tests: list[str], n: int):
        self.module, self.tests = module, tests
        self.tmp = Path(tempfile.mkdtemp(prefix="mutate-"))
        self.dirs: Queue[Path] = Queue()
        self.running: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopping = False
        for i in range(n):
            copy = self.tmp / f"w{i}"
            copy.mkdir()
            for entry in ROOT.iterdir():
                if entry.name in NOT_COPIED or entry.name.endswith(".egg-info"):
                    continue
                if entry.is_dir():
                    shutil.copytree(entry, copy / entry.name, symlinks=True,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(entry, copy / entry.name, follow_symlinks=False)
            self.dirs.put(copy)

    def env(self, copy: Path) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1",
                "PYTEST_ADDOPTS": ""}

    def run(self, text: str | None, timeout: float | None) -> tuple[str, float, str]:
        """The tests against the module as `text` (None: unchanged): ("killed" | "survived" |
        "timeout" | "stopped", seconds, output)."""
        copy = self.dirs.get()
        target = copy / self.module
        original = target.read_text()
        try:
            if text is not None:
                target.write_text(text)
            return self._pytest(copy, timeout)
        finally:
            target.write_text(original)
            self.dirs.put(copy)

    def _pytest(self, copy: Path, timeout: float | None) -> tuple[str, float, str]:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *self.tests]
        t0 = time.monotonic()
        with self.lock:
            if self.stopping:
                return "stopped", 0.0, ""
            proc = subprocess.Popen(cmd, cwd=copy, env=self.env(copy), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            self.running.add(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
            result = "survived" if proc.returncode == 0 else "killed"
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, result = proc.communicate()[0], "timeout"
        finally:
            with self.lock:
                self.running.discard(proc)
        if self.stopping:
            result = "stopped"
        return result, time.monotonic() - t0, out

    def imported_from(self) -> str:
        """Where a plain `import` in a worker's copy finds the module."""
        copy = self.dirs.get()
        try:
            name = self.module.removesuffix(".py").replace("/", ".")
            code = f"import {name} as m; print(m.__file__)"
            return subprocess.run([sys.executable, "-c", code], cwd=copy, env=self.env(copy),
                                  capture_output=True, text=True, check=True).stdout.strip()
        finally:
            self.dirs.put(copy)

    def stop(self):
        with self.lock:
            self.stopping = True
            for proc in self.running:
                _kill(proc)

    def close(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and any processes its tests started


def _excluded(path: Path, module: str) -> dict[str, str]:
    """`path:line: original -> mutant` -> why, for this module's entries in the exclude file."""
    if not path.is_file():
        return {}
    out = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, why = line.partition("  # ")
        if not sep or not why.strip():
            sys.exit(f"{path}:{number}: expected `path:line: original -> mutant  # why`")
        if name.startswith(f"{module}:"):
            out[name] = why.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module", help="the module to mutate, relative to the repo root")
    p.add_argument("--tests", required=True, help="test files (and pytest args), one string")
    p.add_argument("--only", help="mutate these lines only: LINE,LINE,...")
    p.add_argument("--list", action="store_true", help="print the mutants and stop")
    p.add_argument("--exclude", default="tests/mutate_equivalent.txt",
                   help="equivalent mutants to leave out")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--fail-under", type=float, default=0.0, help="exit 2 below this score (%%)")
    args = p.parse_args(argv)

    module = Path(args.module).as_posix()
    tests = shlex.split(args.tests)
    if not (ROOT / module).is_file() or not tests:
        p.error(f"{module} is not a file under {ROOT}, or no tests were given")
    src = Source((ROOT / module).read_text())
    every = mutants(src)
    if args.only:
        lines = {int(n) for n in args.only.split(",")}
        every = [m for m in every if m.line in lines]
    excluded = _excluded(ROOT / args.exclude, module)
    names = {m: f"{module}:{m.line}: {m.shown}" for m in every}
    todo = [m for m in every if names[m] not in excluded]
    if args.list:
        for m in every:
            print(names[m] + ("  # excluded" if names[m] in excluded else ""))
        print(f"{module}: {len(todo)} mutants, {len(every) - len(todo)} excluded as equivalent")
        return 0
    if not args.only:
        for stale in sorted(set(excluded) - set(names.values())):
            print(f"warning: {args.exclude} names a mutant that no longer exists: {stale}")

    t0 = time.monotonic()
    workers = Workers(module, tests, max(1, args.workers))
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    counts = {"killed": 0, "timeout": 0, "survived": 0}
    survivors = []
    try:
        where = workers.imported_from()
        if not where.startswith(str(workers.tmp)):
            print(f"error: {module} was imported from {where}, not from the copy")
            return 1
        result, base, out = workers.run(None, None)
        if result != "survived":
            print(out[-3000:] + f"\nerror: the tests fail on the unmutated {module}")
            return 1
        result, _, out = workers.run(src.text + f"\nraise ImportError({CANARY!r})\n", None)
        if CANARY not in out:
            print(out[-3000:] + f"\nerror: the tests did not import the copy of {module}")
            return 1
        timeout = max(60.0, 10 * base)
        print(f"{module}: {len(todo)} mutants ({len(every) - len(todo)} excluded), tests "
              f"{base:.1f} s unmutated, {args.workers} workers", flush=True)
        with ThreadPoolExecutor(max(1, args.workers)) as pool:
            futures = {pool.submit(workers.run, m.apply(src.text), timeout): m for m in todo}
            try:
                for future, m in futures.items():
                    result = future.result()[0]
                    if result in counts:
                        counts[result] += 1
                    if result == "survived":
                        survivors.append(names[m])
                        print(names[m], flush=True)
            except KeyboardInterrupt:
                workers.stop()
                pool.shutdown(cancel_futures=True)
                print("interrupted: the working tree was never changed")
                return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        workers.stop()
        workers.close()
    ran = sum(counts.values())
    caught = counts["killed"] + counts["timeout"]
    score = 100.0 * caught / ran if ran else 100.0
    print(f"{module}: {counts['killed']} failed, {counts['timeout']} timed out, "
          f"{counts['survived']} survived in {time.monotonic() - t0:.0f} s")
    print(f"{module}: killed {caught} of {ran} ({score:.1f}%), "
          f"{len(every) - len(todo)} excluded as equivalent")
    return 2 if score < args.fail_under else 0


if __name__ == "__main__":
    sys.exit(main())
