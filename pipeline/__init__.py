"""Self-improving research society on PubMedQA: stages of the retraining loop.

Every stage is one function in ``pipeline.stages`` with one CLI entry point
(``python -m pipeline <stage>``) shared by ``dvc.yaml`` and ``dags/agent_retraining.py``.
"""

__version__ = "0.1.0"
