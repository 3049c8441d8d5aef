"""Where a rank runs: launch environment, device and backend, process group, layout, and the
memory it needed.

The torch-bound names load on first use (optimus/lazy.py): the `optimus` command imports
`LaunchError` only.
"""

from optimus.lazy import lazy_names
from optimus.runtime.launch import (
    LaunchEnv,
    LaunchError,
    cpu_binding,
    expand_hostlist,
    launch_env,
)

_WHERE = {
    "DeviceError": "device", "compute_dtype": "device",
    "device_name": "device", "pick_backend": "device",
    "pick_device": "device", "ParallelDims": "dims", "destroy_distributed": "dist",
    "init_distributed": "dist", "max_over_ranks": "memory", "peak_memory": "memory",
    "reset_peak_memory": "memory",
}
__all__ = ["LaunchEnv", "LaunchError", "cpu_binding", "expand_hostlist", "launch_env",
           *sorted(_WHERE)]
__getattr__ = lazy_names(__name__, _WHERE)
