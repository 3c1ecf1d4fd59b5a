"""Rollout traces: the one schema that datasets, trainers and the bandit read."""
