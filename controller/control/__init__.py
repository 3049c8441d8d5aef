"""What the leading controller runs (`optimus controller`): the reconcile loop, its pure rules
(decide, detect, recovery, operator) and what it reads and writes besides Redis."""
