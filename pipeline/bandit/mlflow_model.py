"""MLflow models-from-code entry point of the supervisor policy (no cloudpickle of a live object).

``mlflow.pyfunc.log_model(python_model=<this file>, artifacts={"vw_model": ...})`` records this file;
loading the model runs it, and MLflow then calls ``load_context`` with the artifacts.
"""

import mlflow

from pipeline.bandit.policy import SupervisorPolicyModel

mlflow.models.set_model(SupervisorPolicyModel())
