"""`python -m controller ...`: the control plane's commands (the same as `optimus ...`)."""

from controller.cli.main import main

main()
