"""MLflow models-from-code entry point of the supervisor policy (no cloudpickle of a live object).

``train_bandit.log_model`` logs this file as the model's code, ``vw_policy.py`` + ``features.py`` as the
package ``supervisor_bandit`` in the model's ``code/`` folder, and the ``.vw`` file as the artifact
``vw_model``. Loading the model (``mlflow.pyfunc.load_model``) puts ``code/`` on ``sys.path``, runs this
file, and calls ``load_context`` with the artifacts: nothing from this repository is needed.
The pipeline itself never loads the policy this way (``pipeline.bandit.policy.load_policy``).
"""

import mlflow

try:  # loaded from a registered model: its code/ folder is on sys.path
    from supervisor_bandit.vw_policy import SupervisorPolicyModel
except ModuleNotFoundError as exc:  # run by mlflow.pyfunc.log_model in the checkout, before the code is logged
    if exc.name != "supervisor_bandit":
        raise
    from pipeline.bandit.vw_policy import SupervisorPolicyModel

mlflow.models.set_model(SupervisorPolicyModel())
