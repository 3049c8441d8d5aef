"""Every command README.md writes works as written, so none can drift from the CLI again.

The commands are those of the README's ```bash blocks and of its prose (inline `optimus ...`
spans), and, checked against the CLI only, those of the bash blocks of the docs the planner,
config, checkpoint and operations pages. A command with a placeholder (JOB, NAME, N, RUN_DIR,
<checkpoint.dir>, `a|b`, `[...]`, `...`) is a synopsis: its command path must exist and every
option it writes must be one that command accepts (click's own command objects, the whole
`optimus` group). So is a command that talks to a running job's Redis (job, node, events,
chaos, health-check, agent, controller), which tests/test_operator.py and the chaos tests run
against live jobs. Every other command runs for real through bash, in a fresh directory that
holds a copy of jobs/ (so the test leaves nothing in the repository), with these
substitutions, so that the file takes a few minutes on two cores:

- every training command (`optimus train`, `torchrun ... -m optimus train`, `optimus run`)
  gets SMALL appended: 2 steps, 1 warm-up step, 1 validation batch;
- the Training section's commands also get `checkpoint.interval=0` and `eval.every=0`: they
  show layouts, and the Quick start's run checks saving and validation;
- `optimus data prepare corpus/*.jsonl books/*.txt ...` reads files this test writes there
  (600k bytes, so that its 1% held out fills a validation batch);
- the synopses in RUN_AFTER run with the values given there, after the section they name.

A prose span that leaves out a required argument or option names a command rather than runs
it (`optimus run`, `optimus data prepare --holdout 0.001`): it is checked against the CLI.

`make demo` and `make test` are not run here: CI runs `make test`, and make demo's command is
the Quick start's `optimus run` line, which runs here with SMALL. `. .venv/bin/activate` is
what putting the venv's bin/ first on PATH does. `curl localhost:9780/metrics` needs a
running controller; tests/test_monitoring.py scrapes it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

from controller.cli.main import main

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin/: optimus, torchrun
DOCS = ("docs/planner.md", "docs/config.md", "docs/checkpoints.md", "docs/huggingface.md",
        "docs/operations.md", "docs/stability.md")
STEPS = 2
SMALL = f"--set optim.steps={STEPS} --set optim.warmup_steps=1 --set eval.batches=1"
LAYOUT_ONLY = "--set checkpoint.interval=0 --set eval.every=0"
LIVE = {"job", "node", "events", "chaos", "health-check", "agent", "controller"}
# Synopses that can run once a section's commands have: (section, the command to run).
RUN_AFTER = {
    "optimus report RUN_DIR": ("Quick start", "optimus report runs/tiny-gpt"),
    "optimus checkpoint list|inspect|verify --dir DIR": ("Quick start", *(
        f"optimus checkpoint {verb} --dir runs/tiny-gpt/checkpoints"
        for verb in ("list", "inspect", "verify"))),
    "optimus eval CHECKPOINT --data DIR": ("Data", "optimus eval latest --data data/mine/holdout "
                                                   "--batches 1"),
}
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|<[^>]+>|\.\.\.")
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```$", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Command:
    text: str  # continuation lines joined, the comment removed
    section: str  # the `## ` heading it is under
    block: bool  # in a ```bash block (else in the prose)


@dataclass(frozen=True)
class Example:
    command: str  # after the `$ ` prompt
    output: list[str]


def parse(path: Path) -> tuple[list[Command], list[Example]]:
    """The commands of a markdown file's bash blocks and prose, and its `$ command` examples."""
    commands, examples = [], []
    parts = re.split(r"^## (.+)$", path.read_text(), flags=re.M)
    for section, body in zip(["", *parts[1::2]], parts[0::2], strict=True):
        for lang, block in FENCE.findall(body):
            if lang == "bash":
                for line in block.replace("\\\n", " ").splitlines():
                    line = re.sub(r"(^|\s)#\s.*$", "", line).strip()
                    if line:
                        commands.append(Command(" ".join(line.split()), section, True))
            elif lang == "":
                for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
                    first, *output = chunk.rstrip("\n").splitlines()
                    examples.append(Example(first, [s.rstrip() for s in output]))
        for span in SPAN.findall(FENCE.sub("", body)):
            span = " ".join(span.split()).replace("\\|", "|")
            if span.startswith("optimus "):
                commands.append(Command(span, section, False))
    return commands, examples


def optimus_argv(text: str) -> list[str] | None:
    """The arguments after `optimus` (or torchrun's `-m optimus`); None for another program."""
    argv = shlex.split(text)
    if argv[0] == "optimus":
        return argv[1:]
    if argv[0] == "torchrun" and "-m" in argv and argv[argv.index("-m") + 1] == "optimus":
        return argv[argv.index("-m") + 2:]
    return None


def is_synopsis(argv: list[str]) -> bool:
    return argv[0] in LIVE or any(
        "|" in t or t.startswith("[") or PLACEHOLDER.fullmatch(t.strip("[]")) for t in argv)


def check_against_cli(argv: list[str], *, complete: bool) -> None:
    """The command path exists, every option written is one it takes, every value one it
    accepts; with `complete`, every required argument and option is written too."""
    _check(main, argv, "optimus", complete)


def _check(command: click.Command, argv: list[str], path: str, complete: bool) -> None:
    if isinstance(command, click.Group):
        if not argv and not complete:
            return  # prose naming a group: `optimus job|node|events`
        assert argv and not argv[0].startswith("-"), f"`{path}` needs a subcommand"
        for name in argv[0].split("|"):
            assert name in command.commands, (f"`{path} {name}` is no command; it has "
                                              f"{', '.join(sorted(command.commands))}")
            _check(command.commands[name], argv[1:], f"{path} {name}", complete)
        return
    options = {o: p for p in command.params if isinstance(p, click.Option)
               for o in (*p.opts, *p.secondary_opts)}
    written, positional, i = set(), [], 0
    while i < len(argv):
        token = argv[i].strip("[]")
        if token.startswith("-"):
            name, eq, value = token.partition("=")
            assert name in options, f"`{path}` has no option {name}"
            option = options[name]
            written.add(option.name)
            if not option.is_flag and not option.count and not eq:
                i += 1
                value = argv[i].strip("[]")
            if eq or not option.is_flag:
                _check_value(option, value, path)
        elif token != "...":
            positional.append(token)
        i += 1
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    capacity = sum(len(positional) if a.nargs == -1 else a.nargs for a in arguments)
    assert len(positional) <= capacity, f"`{path}` takes {capacity} argument(s): {positional}"
    for argument, value in zip(arguments, positional, strict=False):
        _check_value(argument, value, path)
    if complete:
        missing = [p.name for p in command.params if p.required and not p.envvar
                   and p.name not in written and not isinstance(p, click.Argument)]
        assert not missing, f"`{path}` requires --{', --'.join(missing)}"
        needed = sum(1 for a in arguments if a.required)
        assert len(positional) >= needed, f"`{path}` needs {needed} argument(s)"


def _check_value(param: click.Parameter, value: str, path: str) -> None:
    for each in value.split("|") if isinstance(param.type, click.Choice) else [value]:
        if PLACEHOLDER.fullmatch(each) or (each == value and "|" in value):
            continue
        try:
            param.type.convert(each, param, None)
        except click.BadParameter as e:
            raise AssertionError(f"`{path}`: {param.name} does not take {each!r}: "
                                 f"{e.message}") from None


def complete(argv: list[str]) -> bool:
    """Whether the command writes every required argument and option. A prose span that
    leaves one out names the command (`optimus run`, `optimus data prepare`), not a run."""
    try:
        check_against_cli(argv, complete=True)
    except AssertionError:
        return False
    return True


def readme() -> tuple[list[Command], list[Example]]:
    return parse(REPO / "README.md")


def workspace(tmp_path: Path, name: str) -> Path:
    cwd = tmp_path / re.sub(r"\W+", "-", name)
    cwd.mkdir()
    shutil.copytree(REPO / "jobs", cwd / "jobs")
    return cwd


def run(text: str, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("REDIS_URL", None)
    proc = subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    said = f"`{text}` in {cwd} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n" \
           f"{proc.stderr[-4000:]}"
    assert (proc.returncode == 0) == ok, said
    assert "Traceback" not in proc.stderr, said
    return proc


def small(command: Command) -> str:
    """The command as the test runs it: training gets SMALL (and LAYOUT_ONLY in Training)."""
    argv = optimus_argv(command.text)
    if argv[0] not in ("train", "run"):
        return command.text
    return f"{command.text} {SMALL}" + (f" {LAYOUT_ONLY}" if command.section == "Training"
                                         else "")


def steps_trained(cwd: Path) -> list[dict]:
    lines = (cwd / "runs" / "tiny-gpt" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "step" in r]


def check_result(text: str, proc: subprocess.CompletedProcess, cwd: Path) -> None:
    """What the command must have produced, by what it is."""
    argv, out = optimus_argv(text), proc.stdout + proc.stderr
    verb = " ".join(argv[:2]) if argv[0] in ("config", "checkpoint", "data") else argv[0]
    if verb in ("train", "run"):
        assert [r["step"] for r in steps_trained(cwd)] == list(range(1, STEPS + 1)), out
    elif verb == "config check":
        said = (f"on {argv[argv.index('--world') + 1]} rank" if "--world" in argv
                else "(the fewest its layout runs on")
        assert out.startswith(f"ok: {argv[2]} on ") and said in out, out
    elif verb == "config show":
        shown = yaml.safe_load(proc.stdout)
        assert shown["name"] == "tiny-gpt" and shown["parallel"]["dp"] == int(
            argv[argv.index("--world") + 1]), out
    elif verb == "checkpoint list":
        assert re.search(rf"│ {STEPS} +│ committed", out), out
        assert "runs/tiny-gpt/checkpoints" in out, out  # named, whether given or found
    elif verb == "checkpoint inspect":
        assert re.search(rf"^step: +{STEPS}$", out, re.M), out
    elif verb == "checkpoint verify":
        assert f"ok: step_{STEPS:09d}" in out, out
    elif verb == "checkpoint export":
        written = cwd / argv[argv.index("--out") + 1] / "config.json"
        assert json.loads(written.read_text())["architectures"] == ["LlamaForCausalLM"], out
    elif verb == "report":
        page = Path(argv[1]) / "report" / "index.html"
        assert f"report: {page}" in out and (cwd / page).is_file(), out
    elif verb == "eval":
        assert re.search(rf"\(step {STEPS}\): validation loss \d+\.\d+", out), out
    elif verb == "data prepare":
        held = re.search(r"held out (\d+) documents", out)
        assert held and int(held[1]) > 0, out
    else:
        pytest.fail(f"`{text}` ran, but this test does not know what it should produce: "
                    "add it to check_result")


def runnable(section: str) -> list[str]:
    """The section's commands that run, in document order, then RUN_AFTER's for it."""
    commands, _ = readme()
    texts = []
    for c in commands:
        argv = optimus_argv(c.text)
        if (c.section == section and argv is not None and not is_synopsis(argv)
                and (c.block or complete(argv))):
            texts.append(small(c))
    texts += [t for synopsis, (where, *run_as) in RUN_AFTER.items() if where == section
              for t in run_as]
    return list(dict.fromkeys(texts))  # prose may repeat a block's command


def test_every_command_is_one_the_cli_accepts():
    commands, examples = readme()
    written = {c.text for c in commands}
    for synopsis in RUN_AFTER:  # the table names synopses the README still writes
        assert synopsis in written, f"RUN_AFTER names {synopsis!r}, which README.md dropped"
    assert {"optimus train jobs/tiny-gpt.yaml", "optimus report RUN_DIR",
            "optimus checkpoint list"} <= written  # the parser found blocks and prose
    for c in commands:
        argv = optimus_argv(c.text)
        if argv is None:  # a bash block holds nothing else we do not know of
            assert not c.block or c.text in ("make demo", "make test",
                                             ". .venv/bin/activate"), c.text
            continue
        check_against_cli(argv, complete=c.block and is_synopsis(argv))
    for e in examples:
        check_against_cli(optimus_argv(e.command), complete=True)
    for doc in DOCS:
        for c in parse(REPO / doc)[0]:
            if c.block and (argv := optimus_argv(c.text)) is not None:
                check_against_cli(argv, complete=False)


def test_a_synopsis_that_drifted_is_caught():
    for wrong in (["checkpoint", "lists"], ["plan", "JOB", "--device", "N"],
                  ["config", "show", "JOB", "-o", "yaml|toml"],
                  ["job", "resume|restart", "--job", "NAME"]):
        with pytest.raises(AssertionError):
            check_against_cli(wrong, complete=False)
    with pytest.raises(AssertionError, match="requires --nodes"):
        check_against_cli(["controller", "JOB", "--ranks-per-node", "R"], complete=True)
    check_against_cli(["chaos", "kill-rank|nan-rank", "--job", "NAME", "..."], complete=True)


def test_the_example_outputs_are_what_the_commands_print(tmp_path):
    _, examples = readme()
    assert examples, "README.md shows no `$ command` with its output"
    cwd = workspace(tmp_path, "examples")
    for e in examples:
        proc = run(e.command, cwd, ok=not e.output[0].startswith("error:"))
        printed = [s.rstrip() for s in (proc.stdout + proc.stderr).splitlines()]
        assert printed == e.output, f"`{e.command}` prints:\n" + "\n".join(printed)


def test_the_quick_start_runs_as_written(tmp_path):
    cwd = workspace(tmp_path, "quick-start")
    texts = runnable("Quick start")
    assert texts[0].startswith("optimus run jobs/tiny-gpt.yaml"), texts  # make demo's command
    for text in texts:
        check_result(text, run(text, cwd), cwd)


def test_the_job_file_commands_run_as_written(tmp_path):
    cwd = workspace(tmp_path, "job-files")
    texts = runnable("Job files")
    assert len(texts) >= 2, texts
    for text in texts:
        check_result(text, run(text, cwd), cwd)


def test_the_data_commands_run_as_written(tmp_path):
    cwd = workspace(tmp_path, "data")
    (cwd / "corpus").mkdir()
    (cwd / "books").mkdir()
    docs = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i % 5)
            for i in range(2000)]
    (cwd / "corpus" / "web.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs[:1900]))
    for i, d in enumerate(docs[1900:]):
        (cwd / "books" / f"book{i}.txt").write_text(d)
    texts = runnable("Data")
    assert [optimus_argv(t)[0] for t in texts] == ["data", "train", "eval"], texts
    for text in texts:
        check_result(text, run(text, cwd), cwd)


def test_the_training_commands_run_on_every_layout(tmp_path):
    """Each in a directory of its own (else each would resume the one before); every dense
    layout's first loss is one process's, and so is every MoE layout's among themselves."""
    texts = runnable("Training")
    assert sum(t.startswith("torchrun") for t in texts) >= 4, texts
    first = {}
    for i, text in enumerate(texts):
        cwd = workspace(tmp_path, f"training-{i}")
        check_result(text, run(text, cwd), cwd)
        first[text] = steps_trained(cwd)[0]["loss"]
    for moe in (False, True):
        losses = [loss for text, loss in first.items() if ("moe.experts" in text) == moe]
        assert len(losses) >= 2 and losses == pytest.approx([losses[0]] * len(losses),
                                                            rel=1e-5), first
