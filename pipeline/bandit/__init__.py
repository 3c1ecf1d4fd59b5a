"""Contextual bandit for the supervisor: features, Vowpal Wabbit policy, off-policy evaluation."""
