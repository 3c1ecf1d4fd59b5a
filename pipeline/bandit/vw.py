"""Vowpal Wabbit pieces: ADF example lines, the ``--cb_explore_adf`` policy and a reward regressor.

VW's multi-line ADF format: one ``shared`` line with the context, one line per candidate; the
chosen candidate's line carries ``0:<cost>:<probability>`` with cost = -reward. ``-q sa`` crosses
context and candidate features, which is what makes the policy contextual.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from vowpalwabbit import Workspace

from pipeline.bandit.vw_policy import _action, _shared  # one line format for training and the logged policy
from pipeline.config import BanditSettings


def adf_lines(context: dict[str, Any], actions: Sequence[dict[str, Any]], chosen: int | None = None,
              reward: float | None = None, propensity: float | None = None) -> list[str]:
    lines = [f"shared {_shared(context)}"]
    for i, action in enumerate(actions):
        label = (f"0:{-float(reward):.6f}:{float(propensity):.6f} "
                 if chosen == i and reward is not None and propensity is not None else "")
        lines.append(label + _action(action))
    return lines


def _epochs(examples: Sequence[dict[str, Any]], passes: int, seed: int) -> Iterator[dict[str, Any]]:
    """Every example once per pass, in a seeded shuffled order."""
    order = list(range(len(examples)))
    rng = random.Random(seed)
    for _ in range(passes):
        rng.shuffle(order)
        yield from (examples[i] for i in order)


def policy_args(bandit: BanditSettings) -> str:
    return f"--cb_explore_adf --epsilon {bandit.epsilon} -q sa -l {bandit.learning_rate} --random_seed {bandit.seed} --quiet"


def train_policy(bandit: BanditSettings, examples: Sequence[dict[str, Any]]) -> Any:
    """A ``--cb_explore_adf`` workspace learned from logged (context, actions, chosen, propensity, reward)."""
    ws = Workspace(policy_args(bandit))
    for ex in _epochs(examples, bandit.passes, bandit.seed):
        ws.learn(adf_lines(ex["context"], ex["actions"], ex["chosen"], ex["reward"], ex["propensity"]))
    return ws


def pmf(ws: Any, context: dict[str, Any], actions: Sequence[dict[str, Any]]) -> list[float]:
    """The policy's probability for each candidate, in candidate order (sums to 1)."""
    probs = [float(p) for p in ws.predict(adf_lines(context, actions))]
    total = sum(probs)
    return [p / total for p in probs] if total > 0 else [1.0 / len(actions)] * len(actions)


def train_reward_model(bandit: BanditSettings, examples: Sequence[dict[str, Any]]) -> Any:
    """Squared-loss regressor of reward on (context x chosen candidate): the direct-method part of DR."""
    ws = Workspace(f"-q sa -l {bandit.learning_rate} --random_seed {bandit.seed} --quiet")
    for ex in _epochs(examples, max(bandit.passes, 3), bandit.seed + 1):
        ws.learn(f"{float(ex['reward']):.6f} {_shared(ex['context'])} {_action(ex['actions'][ex['chosen']])}")
    return ws


def predict_rewards(ws: Any, context: dict[str, Any], actions: Sequence[dict[str, Any]]) -> list[float]:
    return [float(ws.predict(f"{_shared(context)} {_action(a)}")) for a in actions]
