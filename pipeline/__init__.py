"""Self-improving research society on PubMedQA: stages of the retraining loop.

Every stage is one function in ``pipeline.stages`` with one CLI entry point
(``python -m pipeline <stage>``) shared by ``dvc.yaml`` and ``dags/agent_retraining.py``.
"""

__version__ = "0.1.0"

import os as _os

# litellm fetches its model cost map over the network at import time; offline (air-gapped workers,
# this CI) the failure is logged from inside an import hook and deadlocks MLflow's server and any
# process importing both. The bundled map is what we want anyway. Children inherit the setting.
_os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
