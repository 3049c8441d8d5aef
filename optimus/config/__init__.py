"""Job configuration: typed sections, validation, overrides, and the layout a job resolves to
on a world (an optimus.runtime.dims.ParallelDims)."""

from optimus.config.checks import (
    ConfigError,
    check_job,
    check_replica_nodes,
    resolve_layout,
)
from optimus.config.load import apply_override, job_hash, load_job, validate_job
from optimus.config.schema import (
    CheckpointConfig,
    DataConfig,
    FaultInjectionConfig,
    JobConfig,
    ModelConfig,
    MonitoringConfig,
    OptimConfig,
    ParallelConfig,
    SupervisionConfig,
)

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "FaultInjectionConfig", "JobConfig",
    "ModelConfig", "MonitoringConfig", "OptimConfig", "ParallelConfig",
    "SupervisionConfig",
    "apply_override", "check_job", "check_replica_nodes", "job_hash", "load_job",
    "resolve_layout", "validate_job",
]
