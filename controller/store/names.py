"""Node names: one rule, checked wherever a name enters the control plane (docs/security.md).

A node name is a hostname as Slurm, PBS and Kubernetes write one: dot-separated labels of
letters, digits, '-' and '_', each 1-63 characters long and none starting with '-'; 253
characters in all. Nothing else: no space, newline, quote, '$', '[', ',', ':', '@' or '/'. A
name goes into Redis keys (`ranks:<node>`, `<node>@<incarnation>`), `#SBATCH --exclude=`
lines, shell words, paths, events, terminal tables and figures; any of those characters would
be read there as something other than part of a name.

Where names enter: the agent's `--node` (and the operator's node arguments) are refused with a
usage error; `OwnRecords.register_node` refuses one; everything the store reads back from Redis
passes `Refused.keep`, which drops what an agent's credentials could have written under another
name and remembers it, for the controller to say once in a `name_refused` event; the
controller's journal is refused whole (controller/control/journal.py).
"""

from __future__ import annotations

import re

from controller.store.decode import Notes

NODE_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?:\.(?!-)[A-Za-z0-9_-]{1,63})*")
MAX_LENGTH = 253
RULE = ("letters, digits, '-' and '_' in dot-separated labels of 1-63 characters, none "
        "starting with '-'; 253 characters in all")


def own(node: str, name: str) -> str:
    """The name of one of a node's own keys (controller/store/own.py), as `Store.k` takes it:
    `node:<node>:<name>`. A node name holds no ':', so no node's keys are another's."""
    return f"node:{node}:{name}"


def is_node_name(name: object) -> bool:
    return (isinstance(name, str) and len(name) <= MAX_LENGTH
            and NODE_NAME.fullmatch(name) is not None)


def shown(name: object) -> str:
    """A name that may be no node name, as a message can carry it: quoted, escaped, short."""
    text = name if isinstance(name, str) else repr(name)
    return repr(text[:64]) + ("..." if len(text) > 64 else "")


def problem(name: object) -> str | None:
    """Why `name` is no node name, or None."""
    return None if is_node_name(name) else f"{shown(name)} is not a node name ({RULE})"


def check(name: str) -> str:
    """`name`, or a ValueError saying why it is no node name."""
    if (why := problem(name)) is not None:
        raise ValueError(why)
    return name


class Refused(Notes):
    """The names one process read from Redis and dropped; `take` hands each over once, as
    `shown` writes it."""

    def keep(self, name: object) -> bool:
        """Whether `name` is a node name; if not, it is noted (up to decode.REMEMBERED)."""
        if is_node_name(name):
            return True
        self.note(shown(name))
        return False

    def named(self, pairs) -> dict:
        """Member -> score of a sorted set's (member, score) pairs, for node names only."""
        return {n: score for n, score in pairs if self.keep(n)}

    def only(self, members) -> list[str]:
        """The members of a set or range that are node names, in their order (sets sorted)."""
        return [n for n in (sorted(members) if isinstance(members, set) else members)
                if self.keep(n)]
