"""The rank's side of supervision, beside the training loop:

- heartbeat.py: heartbeats to the node's agent (where the rank is: step, phase, figures);
- commands.py: the commands every rank agrees on at a step boundary (pause, stop, checkpoint);
- exits.py: the failures a rank leaves training with, by exit status;
- faults.py: fault injection, the rank breaking itself the way real ones do;
- inprocess.py: in-process restart, a rank that outlives its generation;
- warm.py: warm starts, rank processes past their imports before the agent needs them, and
  the node's health check;
- ports.py: a port for a server that binds it later.

What a rank, its agent and the controller share (phases, exit statuses, fault kinds,
environment names, the plan and exit records) is in optimus/contract/. Importing this package
loads no torch; heartbeat.py, inprocess.py, warm.py and ports.py load none either (the agent
imports the last two).
"""
