"""Exact binomial intervals for the benchmarks' rates and accuracies (valid at any n): the pipeline's own, which
role-level evaluation reports with every accuracy."""

from __future__ import annotations

from pipeline.evaluation.role_level import clopper_pearson

__all__ = ["clopper_pearson"]
