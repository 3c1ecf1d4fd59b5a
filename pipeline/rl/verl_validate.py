"""``python -m pipeline.rl.verl_validate CONFIG.yaml``: verl's own checks of a composed trainer config.

Run under an interpreter where verl imports (the GPU worker's; here the model venv, which carries
verl 0.8.0 without its GPU dependencies, ``requirements/contract.txt``): ``validate_config`` as
``run_ppo``'s task runner calls it (batch sizes against GPUs, micro-batch settings, the actor
dataclass) and the rollout dataclass the engine workers build. Composition (``verl_config.compose``)
proves the keys exist; this proves verl accepts the values, minutes before a GPU job would find out.
"""

from __future__ import annotations

import sys
import warnings

from omegaconf import DictConfig, OmegaConf


def main(path: str) -> None:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: PLC0415 - model plane only (imports torch)
    from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: PLC0415 - as above

    config = OmegaConf.load(path)
    if not isinstance(config, DictConfig):
        raise SystemExit(f"{path}: not a config mapping")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Disabled critic as adv_estimator != gae": GRPO has none by design
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    omega_conf_to_dataclass(config.actor_rollout_ref.rollout)  # what verl's engine workers build from it


if __name__ == "__main__":
    main(sys.argv[1])
