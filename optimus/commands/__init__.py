"""The `optimus` command's subcommand groups that run on the rank side, one module each;
optimus/cli.py assembles them with the rest (the operator's commands are in controller/cli/).

- `checkpoint.py`: `optimus checkpoint list | inspect | verify | export`, and the way every
  command (`optimus eval` too) finds a checkpoint.
"""
