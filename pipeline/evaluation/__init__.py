"""Scoring the society on held-out questions: metrics with CIs, the promotion gate, PubMedQA's format."""
