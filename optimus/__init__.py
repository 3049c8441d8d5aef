"""Optimus: fault-tolerant pretraining of dense and mixture-of-experts GPTs."""

__version__ = "0.1.0"
