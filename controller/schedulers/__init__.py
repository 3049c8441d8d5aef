"""Batch scripts for the schedulers Optimus runs under, filled in by `optimus submit`."""
