"""Validate sharding rules against single-device results: ``python -m jshard.validate --all``.

See ``jshard.validate.core`` for the method and ``jshard.validate.samples`` for the sample programs.
"""

from .core import NOT_SAMPLED, Report, Sample, collect, registered_with_samples, validate, without_samples

__all__ = ["NOT_SAMPLED", "Report", "Sample", "collect", "registered_with_samples", "validate", "without_samples"]
