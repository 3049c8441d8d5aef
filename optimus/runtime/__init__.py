"""Where a rank runs: launch environment, device and backend, process group, layout.

The torch-bound names load on first use (PEP 562), so that the `optimus` command's operator
subcommands, which need only `LaunchError`, start without torch.
"""

import importlib

from optimus.runtime.launch import LaunchEnv, LaunchError, expand_hostlist, launch_env

_WHERE = {
    "DeviceError": "device", "device_name": "device", "pick_backend": "device",
    "pick_device": "device", "ParallelDims": "dims", "destroy_distributed": "dist",
    "init_distributed": "dist",
}

__all__ = ["LaunchEnv", "LaunchError", "expand_hostlist", "launch_env", *sorted(_WHERE)]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'optimus.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"optimus.runtime.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
