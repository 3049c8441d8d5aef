"""The control plane: controller, node agents, Redis store, operator CLI, metrics exporter.

It talks to ranks only through their node agent and the environment the agent sets
(`OPTIMUS_*`, read by `optimus.runtime.launch_env`); `optimus/` never imports this package.
"""
