"""Training stacks and their compute rate against the plain loop's, with sources (stacks.yaml).

The planner predicts what Optimus reaches; published runs on other stacks are checked with
their stack's factor, an input stated with its source, never fitted to the run it predicts.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optimus.config import ConfigError

TABLE = Path(__file__).with_name("stacks.yaml")
OURS = "optimus"
Factor = Annotated[float, Field(gt=0, le=2)]


class Stack(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    description: str
    compiled: Factor | None = None
    eager: Factor | None = None
    source: str

    def factor(self, compiled: bool) -> float:
        """Its rate over the plain loop's in that mode; ConfigError where none is known."""
        value = self.compiled if compiled else self.eager
        if value is None:
            mode = "compiled" if compiled else "eager"
            raise ConfigError("stacks.yaml", f"stack {self.name} has no {mode} factor",
                              "give one with its source, or predict the other mode")
        return value


@lru_cache(maxsize=1)
def stacks() -> dict[str, Stack]:
    raw = yaml.safe_load(TABLE.read_text())
    try:
        return {name: Stack(name=name, **fields) for name, fields in raw.items()}
    except ValidationError as e:
        raise ConfigError(str(TABLE), str(e.errors()[0]["msg"]), "fix the file") from None


def get_stack(name: str) -> Stack:
    table = stacks()
    if name not in table:
        raise ConfigError("stack", f"unknown stack {name!r}",
                          f"choose among {', '.join(sorted(table))}")
    return table[name]


def against_ours(name: str, compiled: bool) -> float:
    """Stack `name`'s compute rate over Optimus's in the same mode."""
    return get_stack(name).factor(compiled) / get_stack(OURS).factor(compiled)
