"""Experiments: each claim of the study as a measurement with a verdict."""
