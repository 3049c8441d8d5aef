"""What both sides of the control plane use, the agent (`node/`) and the controller
(`control/`), which never import each other: how a host is probed (probe.py) and reached
(reach.py), the mesh check's ring (ring.py), and how a rank's exit reads (exit_text.py).
What ranks share with them is optimus/contract/.
"""
