"""`python -m optimus ...`, the form torchrun launches: torchrun ... -m optimus train JOB."""

from optimus.cli import main

main()
