"""The `optimus` commands of the control plane: the command group (main.py), the operator's
verbs (ops.py) and `optimus run` with its console."""
