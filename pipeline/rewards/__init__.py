"""Reward of a rollout: LLM-judge criteria, their weighted sum, and decision alignment."""
