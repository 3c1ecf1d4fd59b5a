"""The contracts between stages: what ``evaluate`` hands ``promote`` and what ``promote`` hands the report and the DAG.

One module for them (as Agent Lightning keeps its process contracts in one ``schemas.py``; ``pipeline/schemas.py``
holds the agents' outputs). A stage validates what it writes against these models, a reader parses into them and reads
attributes, never key paths across a module line. Models are open (``extra="allow"``): a writer may add a figure a
reader does not know yet; what the gate and the report read is typed.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

Version = Annotated[str, BeforeValidator(str)]  # MLflow hands versions as str, older summaries wrote ints
M = TypeVar("M", bound=BaseModel)


class ContractError(ValueError):
    """A stage's file that does not match its contract (hand-edited, cut short, another release's)."""


def read(model: type[M], path: str | Path) -> M:
    """``path`` parsed as ``model``; a file that does not parse raises :class:`ContractError` naming the file, the key and
    the rule, in one line."""
    try:
        return model.model_validate_json(Path(path).read_bytes())
    except OSError as exc:  # a folder in its place, no permission
        raise ContractError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise ContractError(f"{path}: {where}: {first['msg']} (not a {model.__name__}; {exc.error_count()} error(s))") from None


class Status(StrEnum):
    """What promotion decided for a candidate (also its registry tag ``promotion.decision``)."""

    PROMOTED = "promoted"
    REJECTED = "rejected"
    INSUFFICIENT_EVIDENCE = "insufficient_evidence"
    DRY_RUN = "dry_run"
    FAILED = "failed"
    AWAITING_APPROVAL = "awaiting_approval"  # passed the gate; its role's gate asks a person before the switch
    NOT_APPROVED = "not_approved"            # passed the gate; the person said no (or did not answer in time)
    ROLLED_BACK = "rolled_back"              # was promoted; `rollback` gave its role the champion it replaced


class Level(StrEnum):
    """How a candidate was evaluated: as a whole society, or on its role's own output against the label."""

    SOCIETY = "society"
    ROLE = "role"


class Artifact(StrEnum):
    """What a candidate changes: the role's registered model version, or the prompt version it renders."""

    MODEL = "model"
    PROMPT = "prompt"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Stat(_Open):
    mean: float
    ci_low: float
    ci_high: float
    n: int


class Official(_Open):
    """PubMedQA's official figures over every question (DEFER and a failure answer maybe)."""

    accuracy: float
    macro_f1: float


class YesNo(_Open):
    """Accuracy on the yes/no questions with its exact interval (a failure decides nothing: it counts wrong)."""

    n: int
    accuracy: float
    ci_low: float
    ci_high: float
    majority: float  # the share of the commoner label: what always answering it scores
    go_share: float


class Failures(_Open):
    """Answers that failed (no decision), of the questions, with the rate's exact interval."""

    n: int
    of: int
    rate: float
    ci_low: float
    ci_high: float


class Auc(_Open):
    """The AUC of P(GO) between yes and no questions, with a bootstrap interval (None: not both labels)."""

    value: float | None
    ci_low: float
    ci_high: float

    def __str__(self) -> str:
        return "none" if self.value is None else f"{self.value:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}]"


class Metrics(_Open):
    """One model's summary over the evaluated tasks (``evaluation.metrics.summarise``), and the figures a PubMedQA reader
    compares (``evaluation.role_level.metrics``: ``questions`` to ``auc``; ``auc`` where the answers carry P(GO))."""

    tasks: int
    reward: Stat
    reward_judge: Stat | None = None
    reward_decision: Stat | None = None
    success_rate: Stat | None = None
    decision_accuracy: Stat | None = None
    setting: str | None = None
    level: Level = Level.SOCIETY
    questions: int | None = None
    official: Official | None = None
    yes_no: YesNo | None = None
    failures: Failures | None = None
    auc: Auc | None = None

    def mean(self, name: str) -> float:
        """The mean of figure ``name``: a typed field or a judge criterion (an extra, as ``summarise`` writes it)."""
        value = getattr(self, name)
        return value.mean if isinstance(value, Stat) else float(value["mean"])

    def failed(self) -> int | None:
        """Tasks whose answer failed (no decision: a failed rollout, or a served PI answer without one): the count where
        the metrics carry it, else from the success rate (``summarise`` alone)."""
        if self.failures is not None:
            return self.failures.n
        s = self.success_rate
        return None if s is None else round((1.0 - s.mean) * s.n)


class McNemar(_Open):
    """The exact McNemar test on paired correctness (``evaluation.significance.mcnemar_exact``): ``b`` tasks only the
    candidate got right, ``c`` only the champion, of ``n`` paired."""

    b: int
    c: int
    n: int
    p_value: float
    accuracy_diff: float | None = None  # (b - c) / n where ``paired_difference`` reads it


class Difference(_Open):
    """Candidate minus champion over the same tasks: the gate's evidence (``evaluation.metrics.paired_difference``)."""

    n: int
    mean: float
    ci_low: float
    ci_high: float
    ci: float
    p_value: float
    test: str | None = None  # which sign-flip test gave ``p_value`` (exact or Monte Carlo)
    decision: McNemar | None = None  # exact McNemar on decision correctness (the yes/no-labelled tasks)


class Side(_Open):
    version: Version
    target: str | None = None
    label: str | None = None  # the champion's routing, as the plot names it
    metrics: Metrics
    run_id: str | None = None


class Evaluation(_Open):
    """One candidate against its role's champion (a prompt candidate: versions are prompt versions, both sides answered
    by the champion model ``model_version``)."""

    role: str
    alias: str
    level: Level
    artifact: Artifact = Artifact.MODEL
    template: str | None = None
    model_version: Version | None = None
    champion: Side
    candidate: Side
    difference: Difference
    cost: dict[str, Any] = Field(default_factory=dict)


class Unevaluated(_Open):
    """A candidate the cycle did not evaluate, and why (too few tasks to decide: promote records insufficient evidence)."""

    role: str
    alias: str
    version: Version
    reason: str


class RoutingTable(_Open):
    """A routing table: logical model -> deployment (``worker`` or ``worker/adapter``), policy -> value, prompt template ->
    its Prompt Registry version (serving/routing/v<N>.yaml, the live file, the evaluation tables)."""

    version: int | None = None
    roles: dict[str, str]
    policies: dict[str, str] = Field(default_factory=dict)
    prompts: dict[str, int] = Field(default_factory=dict)


class EvaluationSummary(_Open):
    """``<evaluate.out_dir>/summary.json``: every candidate the cycle evaluated, keyed by role (``ROLE@aa`` for A/A)."""

    tasks: list[str]
    task_rotation: str | None = None  # the seed and challengers that drew the tasks
    setting: str
    created_at: str | None = None  # UTC ISO time the evaluation ended: evidence older than a rollback is stale
    champion_versions: dict[str, Version] = Field(default_factory=dict)
    champion_routing: RoutingTable | None = None  # every registered role on its champion: what each candidate is paired with
    roles: dict[str, Evaluation] = Field(default_factory=dict)
    unevaluated: dict[str, Unevaluated] = Field(default_factory=dict)


class PromotionDecision(_Open):
    """What the gate decided for one candidate, and why (``rule`` is the first rule that decided)."""

    candidate: Version
    status: Status
    rule: str
    detail: str
    promote: bool = False
    champion_before: Version | None = None
    role: str | None = None
    alias: str | None = None
    level: Level | None = None
    setting: str | None = None
    routing_version: int | None = None
    artifact: Artifact = Artifact.MODEL
    template: str | None = None
    # the evidence the gate read (``promote._evidence``): what the approval form and reports/promotion.json show
    p_value: float | None = None
    p_adjusted: float | None = None
    family: int = 1
    candidate_reward: float | None = None
    champion_reward: float | None = None
    difference: Difference | None = None
    auc: str | None = None
    run_url: str | None = None


class PromotionReport(_Open):
    """``reports/promotion.json``: the cycle's decisions, the champions after it and the live routing version."""

    promoted: list[str]
    decisions: dict[str, PromotionDecision]
    setting: str | None = None
    champions: dict[str, Version | None] = Field(default_factory=dict)
    routing_version: int | None = None
    dry_run: bool = False

    def replaced(self, role: str) -> str | None:
        """The champion this cycle's promotion of ``role`` replaced (None: not promoted this cycle)."""
        d = self.decisions.get(role)
        return d.champion_before if d is not None and d.status == Status.PROMOTED and d.champion_before else None

    def lines(self) -> list[str]:
        """What a person reads at the end of a cycle: one line a decision, then the champions and the live routing."""
        return [*(f"promotion: {key} v{d.candidate}: {d.status} ({d.rule}): {d.detail}" for key, d in self.decisions.items()),
                f"champions: {dict(self.champions)}; routing version live: v{self.routing_version}"]


def _figures(m: Metrics) -> str:
    assert m.official and m.yes_no and m.failures  # role_level.metrics sets them
    return (f"official accuracy {m.official.accuracy:.3f}, macro-F1 {m.official.macro_f1:.3f} (n={m.questions}); "
            f"yes/no {m.yes_no.accuracy:.3f} [{m.yes_no.ci_low:.3f}, {m.yes_no.ci_high:.3f}] (n={m.yes_no.n}, majority "
            f"{m.yes_no.majority:.3f}); failed {m.failures.n}/{m.questions}")


class Agreement(_Open):
    """How often the society's decision is the role-level decision of the same champion on the same question."""

    n: int
    same: int
    rate: float | None


class InputEffect(_Open):
    """The PI's decision on the brief alone vs with the protocol and reviews, on the same rollouts (``report.input_effect``)."""

    n: int
    agree: int
    yes_no_n: int
    brief_accuracy: float
    society_accuracy: float
    mcnemar: McNemar
    served_input: str


class SocietyPaired(_Open):
    """The society after vs before on the same questions: yes/no correctness, reward and failures, each paired."""

    correct: McNemar | None
    reward: Difference
    served: McNemar


class SocietyCost(_Open):
    seconds: float
    societies: int
    seconds_per_question: float


class SocietyFigures(_Open):
    """The society as served on the test questions, and (this cycle promoted its decision role) the society with the
    champion it replaced on the same questions."""

    questions: int
    after: Metrics
    before: Metrics | None = None
    before_version: Version | None = None
    after_vs_before: SocietyPaired | None = None
    agreement_with_role_level: Agreement | None = None
    input_effect: InputEffect | None = None
    cost: SocietyCost


class RoleLevelFigures(_Open):
    """A decision role's champion on its own decision over the test questions, and the champion it replaced."""

    questions: int
    setting: str
    maybe_answer: str
    champion: Version | None
    previous_champion: Version | None
    after: Metrics
    before: Metrics | None = None
    seconds: dict[str, float]
    mcnemar_p: float | None = None  # exact McNemar, after better than before on the yes/no questions
    mcnemar: McNemar | None = None


class TrainerReport(_Open):
    """What every training stage writes (``reports/train_<kind>/<role>.json``, its DVC metrics file's source): whether its
    data carried signal, and why not; each kind's own figures beside it, read by the kind's own module."""

    no_signal: bool = False
    no_signal_reason: str | None = None

    @model_validator(mode="after")
    def _says_why(self) -> TrainerReport:
        if self.no_signal and not self.no_signal_reason:
            raise ValueError("no_signal without its no_signal_reason: a trainer says why it registers nothing")
        return self


class TestReport(_Open):
    """``reports/test.json``: the champions on PubMedQA's official test split (``stages/report``), the society as served
    and each decision role's own readout, never confused."""

    __test__ = False  # not a pytest class

    questions: int
    setting: str
    routing_version: int | None
    predictions: str  # whose answers predictions.json holds: society or role_level
    official: Official  # what predictions.json scores
    society: SocietyFigures
    role_level: dict[str, RoleLevelFigures] = Field(default_factory=dict)

    def lines(self, out_dir: str) -> list[str]:
        """The figures a person reads, each with its n and interval or test."""
        s, out = self.society, []
        out.append(f"test ({self.setting}): the society as served after: {_figures(s.after)}")
        if s.before is not None:
            out.append(f"test ({self.setting}): the society as served before (v{s.before_version}): {_figures(s.before)}")
        if s.after_vs_before is not None and (c := s.after_vs_before.correct) is not None:
            out.append(f"test: the society after vs before, exact McNemar on {c.n} yes/no questions: b={c.b} c={c.c} "
                       f"p={c.p_value:.3g}")
        if (a := s.agreement_with_role_level) is not None and a.n:
            out.append(f"test: the society's decision is the role-level decision on {a.same}/{a.n} questions")
        if (e := s.input_effect) is not None:
            out.append(f"test: the decision on the brief vs with the protocol and reviews (n={e.yes_no_n} yes/no): "
                       f"{e.brief_accuracy:.3f} vs {e.society_accuracy:.3f}, agree {e.agree}/{e.n}; exact McNemar "
                       f"p={e.mcnemar.p_value:.3g}")
        out.append(f"test: the society cost {s.cost.seconds:.0f} s for {s.questions} questions x {s.cost.societies}")
        for role, x in self.role_level.items():
            for which, m, version in (("after", x.after, x.champion), ("before", x.before, x.previous_champion)):
                if m is not None:
                    out.append(f"test ({self.setting}): {role} {which} (v{version}), the role level: "
                               f"{_figures(m)}; AUC {m.auc}")
            if x.mcnemar is not None:
                out.append(f"test: {role} after vs before, exact McNemar on {x.mcnemar.n} yes/no questions: "
                           f"b={x.mcnemar.b} c={x.mcnemar.c} p={x.mcnemar.p_value:.2e}")
        out.append(f"test: predictions.json ({self.predictions}) on {self.questions} questions: accuracy "
                   f"{self.official.accuracy:.3f}, macro-F1 {self.official.macro_f1:.3f} (PubMedQA's evaluation.py: "
                   f"python evaluation.py {out_dir}/predictions.json with data/test_ground_truth.json = "
                   f"{out_dir}/ground_truth.json)")
        return out
