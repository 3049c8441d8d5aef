"""Where a rank runs: launch environment, device and backend, process group, layout."""

from optimus.runtime.device import DeviceError, device_name, pick_backend, pick_device
from optimus.runtime.dims import ParallelDims
from optimus.runtime.dist import destroy_distributed, init_distributed
from optimus.runtime.launch import LaunchEnv, LaunchError, expand_hostlist, launch_env

__all__ = [
    "DeviceError",
    "LaunchEnv",
    "LaunchError",
    "ParallelDims",
    "destroy_distributed",
    "device_name",
    "expand_hostlist",
    "init_distributed",
    "launch_env",
    "pick_backend",
    "pick_device",
]
