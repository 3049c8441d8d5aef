"""The control plane, by who runs it: `node/` (the agent on every node), `control/` (the leading
controller and its rules), `store/` (the Redis keys every side shares), `cli/` (the `optimus`
commands, `optimus run` among them), `exporter.py` (the metrics the controller serves) and
`schedulers/` (`optimus submit`).

It talks to ranks only through their node agent and the environment the agent sets
(`OPTIMUS_*`, read by `optimus.runtime.launch_env`); `optimus/` never imports this package.
"""
