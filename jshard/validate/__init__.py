"""Validate sharding rules against single-device results: ``python -m jshard.validate --all``.

See ``jshard.validate.core`` for the method and ``jshard.validate.samples`` for the sample programs.
"""

from .core import Report, Sample, collect, validate

__all__ = ["Report", "Sample", "collect", "validate"]
