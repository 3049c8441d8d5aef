"""Machine profiles: what a device computes and holds, and how fast it talks, as data.

The built-in table is machines.yaml beside this file; a user's YAML file of the same shape adds
profiles or overrides built-in ones. A bad file or an unknown name is a ConfigError naming the
fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from optimus.config import ConfigError
from optimus.planner.rates import Rates, cached_rates

BUILT_IN = Path(__file__).with_name("machines.yaml")
# The profile `optimus plan` uses without --machine: the one of the job's parallel.device, and
# for `auto` (the device is found only where the job runs) the commonest training machine.
DEVICE_PROFILES = {"cpu": "cpu", "cuda": "h100-ndr", "xpu": "max1550-aurora"}
DEFAULT_PROFILE = "h100-ndr"
Positive = Annotated[float, Field(gt=0)]


class Machine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = ""
    description: str = ""
    peak_tflops: Positive
    sustained: Annotated[float, Field(gt=0, le=1)]
    memory_gib: Positive
    devices_per_node: Annotated[int, Field(ge=1)]
    intra_gbps: Positive
    inter_gbps: Positive
    latency_us: Annotated[float, Field(ge=0)] = 5.0
    hbm_gbps: Positive = 2000.0  # device memory bandwidth, GB/s: memory-bound work
    headroom_gib: Annotated[float, Field(ge=0)] = 0.0  # kept free: allocator, NCCL, context
    precision: Literal["bf16", "fp32"] = "bf16"
    # a table of measured matmul and attention rates (rates.py; bench/gemm_sweep.py writes
    # it), relative to the profile file's folder; without one the rates are uncalibrated:
    # peak x sustained x a shape factor (compute.py)
    rates: str | None = None

    @property
    def rate_table(self) -> Rates | None:
        return cached_rates(self.rates) if self.rates else None

    def rates_note(self) -> str:
        """Where this profile's matmul rates come from, in one line."""
        if self.rates:
            return f"matmul rates {self.rate_table.source}"
        return (f"matmul rates UNCALIBRATED: no GEMM sweep for this profile (peak x sustained "
                f"{self.sustained:g} x a shape factor; bench/gemm_sweep.py measures them)")

    @property
    def usable_gib(self) -> float:
        """What the memory model's peak may reach: the device's memory less the headroom
        kept for what the model does not follow (machines.yaml says what)."""
        return max(self.memory_gib - self.headroom_gib, 0.0)


def load_machines(extra: str | Path | None = None) -> dict[str, Machine]:
    """The built-in profiles, updated by those in `extra` (a YAML file), by name."""
    table = _read(BUILT_IN)
    if extra is not None:
        table.update(_read(Path(extra)))
    return table


def _read(path: Path) -> dict[str, Machine]:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(str(path), f"cannot read machine profiles: {e.strerror}",
                          "pass an existing YAML file to --machines") from None
    except yaml.YAMLError as e:
        raise ConfigError(str(path), f"is not valid YAML: {e}", "fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "must map profile names to their fields",
                          "see optimus/planner/machines.yaml for the shape")
    out = {}
    for name, fields in raw.items():
        try:
            fields = dict(fields or {})
            if isinstance(fields.get("rates"), str):  # relative to the profile file's folder
                fields["rates"] = str((path.parent / fields["rates"]).resolve())
            out[name] = Machine(name=name, **fields)
        except (ValidationError, TypeError, ValueError) as e:
            first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
            where = ".".join(str(x) for x in first["loc"])
            raise ConfigError(str(path), f"profile {name}: {where} {first['msg']}".strip(),
                              "see optimus/planner/machines.yaml for every field") from None
        if out[name].rates:  # a bad table is refused here, with its profile file
            cached_rates(out[name].rates)
    return out


def default_machine(device: str) -> str:
    """The profile name for a job's parallel.device when no --machine is given."""
    return DEVICE_PROFILES.get(device, DEFAULT_PROFILE)


def get_machine(name: str, extra: str | Path | None = None) -> Machine:
    table = load_machines(extra)
    if name not in table:
        raise ConfigError("--machine", f"unknown machine profile {name!r}",
                          f"choose among {', '.join(sorted(table))}, or add it with --machines")
    return table[name]
