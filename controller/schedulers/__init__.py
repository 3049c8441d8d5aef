"""Batch scripts for schedulers: each module fills in its template under deploy/ and adds one
subcommand to `optimus submit`."""
