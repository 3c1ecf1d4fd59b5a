"""Role-level evaluation of the PI: its exact tests against scipy, the setting guard, its data and the routing migration."""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
import yaml
from scipy.stats import binomtest, permutation_test
from sklearn.metrics import roc_auc_score

from pipeline.agents.graph import brief
from pipeline.config import load_params
from pipeline.data.pubmedqa import normalise_record
from pipeline.agents import decision, prompts
from pipeline.evaluation import role_level
from pipeline.evaluation.gate import decide
from pipeline.evaluation.metrics import paired_difference
from pipeline.evaluation.significance import mcnemar_exact, sign_flip
from pipeline.serving import routing
from pipeline.schemas import Decision, PIDecision
from pipeline.stages import train_pi
from tests.conftest import ROOT, section


def _records(p_go: list[float], labels: list[str]) -> list[dict]:
    out = []
    for i, (p, label) in enumerate(zip(p_go, labels, strict=True)):
        decision = "GO" if p >= 0.5 else "NO-GO"
        credit = float({"yes": "GO", "no": "NO-GO"}.get(label) == decision) if label != "maybe" else 0.5
        out.append({"task_id": str(i), "label": label, "decision": decision, "p_go": p, "status": "ok", "reward": credit,
                    "components": {"decision": credit}, "scores": {}, "turns": 1, "tokens": 0, "latency_s": 0.1})
    return out


def _pair(n: int, seed: int, better: float) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    labels = [rng.choice(["yes", "yes", "no", "maybe"]) for _ in range(n)]
    champ = [rng.random() for _ in labels]
    cand = [min(1.0, max(0.0, p + (better if lab == "yes" else -better if lab == "no" else 0) + rng.gauss(0, 0.2)))
            for p, lab in zip(champ, labels, strict=True)]
    return _records(cand, labels), _records(champ, labels)


@pytest.mark.parametrize("seed", range(5))
def test_role_level_tests_agree_with_scipy(seed: int) -> None:
    cand, champ = _pair(100, seed, 0.3)
    diff = paired_difference(cand, champ, 200)
    yes_no = [i for i, r in enumerate(cand) if r["label"] != "maybe"]
    right = lambda r: r["decision"] == {"yes": "GO", "no": "NO-GO"}[r["label"]]  # noqa: E731
    b = sum(right(cand[i]) and not right(champ[i]) for i in yes_no)
    c = sum(right(champ[i]) and not right(cand[i]) for i in yes_no)
    assert diff.decision is not None and (diff.decision.b, diff.decision.c) == (b, c)
    assert diff.decision.p_value == pytest.approx(binomtest(b, b + c, 0.5).pvalue, rel=1e-9)
    one_sided = mcnemar_exact([right(cand[i]) for i in yes_no], [right(champ[i]) for i in yes_no], "greater")
    assert one_sided.p_value == pytest.approx(binomtest(b, b + c, 0.5, alternative="greater").pvalue, rel=1e-9)
    # the sign-flip test of the decision reward: scipy's exact paired permutation test on the non-zero differences
    d = np.array([x["reward"] - y["reward"] for x, y in zip(cand, champ, strict=True)])
    nz = d[d != 0]
    exact = permutation_test((nz,), np.mean, permutation_type="samples", alternative="greater", n_resamples=np.inf).pvalue \
        if nz.size <= 16 else None
    p = sign_flip(d.tolist(), "greater", draws=50000, seed=seed)
    if exact is not None:
        assert p == pytest.approx(exact, abs=0.02)
    else:  # Monte Carlo above 16 tasks: within its own error of scipy's Monte Carlo
        ref = permutation_test((d,), np.mean, permutation_type="samples", alternative="greater", n_resamples=50000,
                               random_state=seed).pvalue
        assert p == pytest.approx(ref, abs=0.01)


def test_auc_agrees_with_sklearn_and_its_interval_holds_it() -> None:
    cand, _ = _pair(200, 7, 0.3)
    yes_no = [r for r in cand if r["label"] != "maybe"]
    ref = roc_auc_score([r["label"] == "yes" for r in yes_no], [r["p_go"] for r in yes_no])
    assert role_level.auc(cand) == pytest.approx(ref)
    lo, hi = role_level.auc_ci(cand, 300)
    assert lo < ref < hi
    m = role_level.metrics(cand, "reasoning_free", 300)
    assert m.yes_no and m.official and m.auc
    assert m.yes_no.n == len(yes_no) and m.questions == 200 and m.setting == "reasoning_free"
    assert m.yes_no.ci_low < m.yes_no.accuracy < m.yes_no.ci_high and m.auc.value == pytest.approx(ref)
    # the official metric counts every question; these records never DEFER, so maybe questions are all wrong
    maybe = sum(r["label"] == "maybe" for r in cand)
    assert m.official.accuracy == pytest.approx(m.yes_no.accuracy * len(yes_no) / 200)
    assert maybe > 0


def test_the_gate_promotes_a_better_pi_refuses_an_identical_one_and_refuses_across_settings() -> None:
    cand, champ = _pair(100, 3, 0.4)
    gate = section("promote")
    better = decide(role_level.metrics(cand, "reasoning_free", 200), role_level.metrics(champ, "reasoning_free", 200),
                    paired_difference(cand, champ, 200), gate)
    assert better.promote, better.detail
    same = decide(role_level.metrics(cand, "reasoning_free", 200), role_level.metrics(cand, "reasoning_free", 200),
                  paired_difference(cand, cand, 200), gate)
    assert not same.promote and same.rule == "margin"
    across = decide(role_level.metrics(cand, "reasoning_free", 200), role_level.metrics(champ, "reasoning_required", 200),
                    paired_difference(cand, champ, 200), gate)
    assert not across.promote and across.rule == "setting" and "reasoning_required" in across.detail


def _top(**probs: float) -> list[dict]:
    return [{"token": t, "logprob": float(np.log(p))} for t, p in probs.items()]


def test_the_decision_is_read_over_the_three_decisions_at_the_decision_position() -> None:
    made, p_go, probs = decision.read(_top(NO=0.6, GO=0.2, maybe=0.2))
    assert made is Decision.NO_GO and p_go == pytest.approx(0.25) and probs["DEFER"] == 0  # "maybe" spells no decision
    made, p_go, probs = decision.read(_top(DE=0.5, NO=0.3, GO=0.1, x=0.1))  # DEFER's first token
    assert made is Decision.DEFER and p_go == pytest.approx(0.25) and probs["DEFER"] == pytest.approx(5 / 9)
    made, p_go, _ = decision.read([{"token": ' "GO', "logprob": 0.0}])  # a space and the quote stripped
    assert made is Decision.GO and p_go == 1.0
    assert decision.read(_top(x=0.9, y=0.1)) == (None, None, {})  # nothing spells a decision: a served failure
    assert Decision.for_label("maybe") is Decision.DEFER and Decision.DEFER.answer == "maybe"


def test_reasoning_free_adds_the_conclusion_first() -> None:
    task = {"question": "Does X cause Y?", "contexts": ["A" * 50], "long_answer": "X causes Y."}
    required, free = brief(task, 20, "reasoning_required"), brief(task, 20, "reasoning_free")
    assert "X causes Y." not in required and "Conclusion: X causes Y." in free
    assert free.index("Conclusion") < free.index("Abstract") and free.endswith("A" * 20)


def test_the_pi_learns_the_gold_decision_maybe_included_on_the_call_the_society_serves(pubmedqa) -> None:
    params = load_params(ROOT / "params/learn.yaml", environ={})
    tasks = {pmid: {**normalise_record(pmid, rec), "setting": params.data.setting} for pmid, rec in list(pubmedqa.items())[:80]}
    data = train_pi.rows(list(tasks.values()), params)
    assert all("Conclusion: " in r["prompt"][0]["content"] for r in data)
    # each question once per its label's pi.oversample (the rare maybe repeated), copies under one task id: the SFT eval
    # split holds a question out whole, so no copy of an eval row is trained on
    assert len(data) == sum(params.pi.oversample[t["final_decision"]] for t in tasks.values())
    assert {r["task_id"] for r in data} == set(tasks) and {r["label"] for r in data} == {"yes", "no", "maybe"}
    assert params.pi.oversample["maybe"] > 1 and sum(r["label"] == "maybe" for r in data) == params.pi.oversample["maybe"] * sum(
        t["final_decision"] == "maybe" for t in tasks.values())
    for r in data:
        task = tasks[r["task_id"]]
        target = yaml.safe_load(r["completion"][0]["content"])
        assert target["decision"] == {"yes": "GO", "no": "NO-GO", "maybe": "DEFER"}[task["final_decision"]]
        assert target["rationale"] == task["long_answer"][:params.pi.rationale_chars]
        # the row's prompt is the decision call the society's PI makes on the same brief (no protocol: input brief)
        assert r["prompt"] == decision.decision_messages(task, params.agents, params.data.setting, prompts.REPOSITORY,
                                                         protocol={"title": "t"},
                                                         reviews=[{"reviewer": "peer_reviewer", "severity": "MINOR",
                                                                   "summary": "s"}])
    assert train_pi.signal(data) is None
    assert "yes and no" in (train_pi.signal([r for r in data if r["label"] != "no"]) or "")


def test_a_pi_whose_held_out_ranking_training_did_not_raise_is_no_signal_whatever_its_loss() -> None:
    """train_pi's signal (docs/training.md): the loss on its own rows falls under shuffled labels too, so a PI is
    registered only when training raised its ranking of held-out yes above no questions beyond their permuted labels;
    a base model that happened to rank them counts for nothing (docs/benchmarks-pi-signal.md)."""
    signal = load_params(ROOT / "params.yaml", environ={}).pi.signal
    rng = np.random.default_rng(0)
    labels = ["yes" if i % 2 else "no" for i in range(30)]
    aligned = [1.0 * (y == "yes") + rng.normal(0, 0.3) for y in labels]
    flat = [rng.normal(0, 0.3) for _ in labels]

    def held(scores: list[float]) -> dict[str, Any]:
        return {"auc": None, "yes": labels.count("yes"), "no": labels.count("no"), "labels": labels, "scores": scores}

    fitted = {"no_signal": False, "no_signal_reason": None}
    kept = train_pi.learned({**fitted, "held_out_before": held(aligned), "held_out": held(aligned)}, signal)
    assert kept["no_signal"] and "did not raise" in kept["no_signal_reason"] and kept["held_out_gain_p"] == 1.0
    taught = train_pi.learned({**fitted, "held_out_before": held(flat), "held_out": held(aligned)}, signal)
    assert not taught["no_signal"] and taught["held_out_gain_p"] < signal.alpha
    unfit = {"no_signal": True, "no_signal_reason": "the loss on 16 of its own training rows did not fall"}
    assert train_pi.learned({**unfit, "held_out_before": held(flat), "held_out": held(aligned)}, signal)[
        "no_signal_reason"] == unfit["no_signal_reason"]  # the first reason stands
    yes_only = {"auc": None, "yes": 3, "no": 0, "labels": ["yes"] * 3, "scores": [0.1, 0.2, 0.3]}
    none = train_pi.learned({**fitted, "held_out_before": yes_only, "held_out": yes_only}, signal)
    assert none["no_signal"] and "pi.sft.eval_fraction" in none["no_signal_reason"]
    three = {"auc": None, "yes": 1, "no": 2, "labels": ["no", "no", "yes"], "scores": [0.0, 0.0, 0.0]}
    few = train_pi.learned({**fitted, "held_out_before": three, "held_out": {**three, "scores": [0.0, 0.1, 0.9]}}, signal)
    assert few["no_signal"] and few["no_signal_reason"].startswith("insufficient evidence")  # the smallest p is 1/3


def test_a_routing_version_from_before_the_pi_had_its_own_model_routes_it_as_the_senior(tmp_path) -> None:
    serving = section("serving", routing_dir=str(tmp_path / "routing"), home=str(tmp_path / "home"))
    assert serving.inherits == {"principal_investigator": "senior_researcher"}  # roles.principal_investigator.inherits
    old = {r: "base" for r in serving.roles if r != "principal_investigator"}
    old["senior_researcher"] = "base/senior-adapter"
    (tmp_path / "routing").mkdir()
    (tmp_path / "routing" / "v1.yaml").write_text(yaml.safe_dump({"roles": old}))
    table = routing.load_version(serving, 1)
    assert table["roles"]["principal_investigator"] == "base/senior-adapter"


class _Template:
    """The tokenizer's part the decision rows rely on: the prompt rendered, ready for the assistant's answer, and a
    split into tokens (here: runs of letters, each other character alone)."""

    eos_token_id = "<|im_end|>"

    @staticmethod
    def apply_chat_template(messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    @staticmethod
    def __call__(text: str) -> dict:
        return {"input_ids": re.findall(r"[A-Za-z]+|.", text, flags=re.S)}  # the pieces stand for their ids

    @staticmethod
    def decode(ids: list[str]) -> str:
        return "".join(ids)


def test_decision_token_rows_put_the_loss_on_the_decision_after_the_served_prefix(pubmedqa) -> None:
    params = load_params(ROOT / "params/learn.yaml", environ={})
    tasks = [normalise_record(pmid, rec) for pmid, rec in list(pubmedqa.items())[:40]]
    chat = train_pi.rows(tasks, params)
    prefix = params.agents.decision.prefix
    rows = train_pi.decision_rows(chat, _Template(), prefix, end_of_turn=False)
    assert len(rows) == len(chat) and params.pi.loss_on == "decision_token"
    for row, src in zip(rows, chat, strict=True):
        assert row["prompt"].endswith("<assistant>" + prefix)
        # the decision's first token, the one the served PI is read from: NO-GO's `-GO` decides nothing
        assert row["completion"] == {"yes": "GO", "no": "NO", "maybe": "DEFER"}[src["label"]]
        assert decision.read([{"token": row["completion"], "logprob": 0.0}])[0] == Decision.for_label(src["label"])
        assert row["task_id"] == src["task_id"] and row["rollout_id"] == src["rollout_id"]
        # what TRL trains on: the prompt, then the decision's token, the only position in the loss (no EOS after it)
        assert row["input_ids"] == _Template()(row["prompt"] + row["completion"])["input_ids"]
        assert row["completion_mask"] == [0] * (len(row["input_ids"]) - 1) + [1] and row["input_ids"][-1] == row["completion"]
    # pi.end_of_turn (params.yaml's default): the end-of-turn after the decision is labelled too, as TRL's text rows had it
    assert params.pi.end_of_turn
    for row, alone in zip(train_pi.decision_rows(chat, _Template(), prefix, end_of_turn=True), rows, strict=True):
        assert row["input_ids"] == [*alone["input_ids"], _Template.eos_token_id]
        assert row["completion_mask"] == [*alone["completion_mask"], 1]
    no_eos = type("NoEos", (_Template,), {"eos_token_id": None})()
    with pytest.raises(ValueError, match="no EOS token"):  # a tokenizer without one: said, not a None among the ids
        train_pi.decision_rows(chat, no_eos, prefix, end_of_turn=True)
    with pytest.raises(ValueError, match="merges its end"):  # a prefix the decision would merge into: no token to train
        train_pi.decision_token(_Template(), '"decision": "x', "GO")


def test_the_rationale_is_the_string_the_model_closed_after_the_fixed_decision() -> None:
    prefix = section("agents").decision.prefix
    assert decision.rationale_prefix(prefix, Decision.GO) == prefix + 'GO",\n  "rationale": "'
    assert decision._closed('The abstract shows a \\"clear\\" effect."\n}') == 'The abstract shows a "clear" effect.'
    assert decision._closed("cut at the token cap") == "cut at the token cap"
    got = decision.Answer(decision=Decision.DEFER, p_go=0.5, probs={}, rationale="x" * 400)
    state = got.as_pi_decision()  # the society's decision: a valid PIDecision, the rationale cut to the schema
    obj = PIDecision(decision=state["decision"], rationale=state["rationale"])
    assert obj.decision == "DEFER" and len(obj.rationale) == 300 and state["p_go"] == 0.5


def test_every_prompt_is_a_named_template_whose_version_follows_its_text() -> None:
    from pipeline.agents import prompts

    repo, pi = prompts.REPOSITORY, "principal_investigator"
    task = {"question": "Does X cause Y?", "contexts": ["An abstract."], "long_answer": "It does."}
    assert decision.decision_messages(task, section("agents"), "reasoning_free", repo)[0]["content"] == repo.render(
        pi, brief=brief(task, section("agents").context_chars, "reasoning_free"), protocol=prompts.NO_PROTOCOL,
        reviews="none")
    before = repo.sha(pi)
    edited = repo.with_text(pi, repo.text(pi) + " Be brief.", 7)
    assert edited.sha(pi) != before and len(before) == 12 and edited.version(pi) == 7
    assert repo.sha(pi) == before and repo.version(pi) is None  # a value: what another society renders is untouched
    assert decision.decision_messages(task, section("agents"), "reasoning_free", edited)[0]["content"].endswith("Be brief.")
    with pytest.raises(KeyError, match="needs field 'brief'"):
        repo.render(pi, protocol="p", reviews="none")


def test_prompt_versions_round_trip_the_prompt_registry(mlflow_server: str, monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """Every template is a prompt version in MLflow's Prompt Registry (#43): registered once, a changed text is a new
    version and the champion alias stays where it was; the rendered value names each version (what spans record)."""
    import mlflow.genai

    from pipeline import prompt_registry
    from pipeline.agents import prompts

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = section("mlflow")
    first = prompt_registry.sync(cfg)
    assert set(first.versions) == set(prompts.TEMPLATES) and first.texts == prompts.TEMPLATES
    loaded = mlflow.genai.load_prompt("prompts:/society.principal_investigator@champion", link_to_model=False)
    assert loaded.template == prompts.TEMPLATES["principal_investigator"] and loaded.tags["sha"] == first.sha("principal_investigator")
    assert prompt_registry.sync(cfg) == first  # unchanged text: no new version
    monkeypatch.setitem(prompts.TEMPLATES, "principal_investigator", prompts.TEMPLATES["principal_investigator"] + " Be brief.")
    capfd.readouterr()
    second = prompt_registry.sync(cfg)
    assert "Waiting up to" not in capfd.readouterr().err  # MLflow's INFO line for every version registered, not shown
    # a new version (an optimizer's versions in between may have taken numbers: the repository alias tracks the text)
    assert second.version("principal_investigator") > first.version("principal_investigator")  # type: ignore[operator]
    assert prompt_registry.load("principal_investigator", "@repository").template.endswith("Be brief.")
    assert prompt_registry.sync(cfg) == second  # the repository's text again: no new version
    assert {k: v for k, v in second.versions.items() if k != "principal_investigator"} == {
        k: v for k, v in first.versions.items() if k != "principal_investigator"}
    champion = mlflow.genai.load_prompt("prompts:/society.principal_investigator@champion", link_to_model=False)
    assert int(champion.version) == first.version("principal_investigator") and not champion.template.endswith("Be brief.")


def test_a_routed_prompt_version_is_what_the_society_renders(mlflow_server: str, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path) -> None:
    """A routing version names a Prompt Registry version per template (#43): the society renders that version's text,
    spans name its version and hash; a routing version naming an unknown template or no version number writes nothing;
    a proposed text that drops a field the society fills is never registered."""
    from pipeline import prompt_registry
    from pipeline.agents import prompts

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    cfg = section("mlflow")
    prompt_registry.sync(cfg)
    repo_text = prompts.TEMPLATES["principal_investigator"]
    candidate = repo_text + " Weigh the conclusion before the protocol."
    version = prompt_registry.register(cfg, "principal_investigator", candidate, "test: a proposed version")
    with pytest.raises(prompt_registry.PromptError, match="fields"):
        prompt_registry.register(cfg, "principal_investigator", "Decide GO or NO-GO.", "drops every field")
    serving = load_params(ROOT / "params.yaml", environ={
        "PIPELINE__SERVING__ROUTING_DIR": str(tmp_path / "versions"), "PIPELINE__SERVING__HOME": str(tmp_path / "run"),
        "PIPELINE__SERVING__LIVE_FILE": str(tmp_path / "live.json")}).serving
    (tmp_path / "versions").mkdir()
    (tmp_path / "versions" / "v1.yaml").write_text((ROOT / "serving/routing/v1.yaml").read_text())
    roles_v1 = routing.load_version(serving, 1)["roles"]
    for bad in ({"no_such_template": 1}, {"principal_investigator": 0}, {"principal_investigator": "2"}):
        with pytest.raises(routing.RoutingError):
            routing.write_version(serving, roles_v1, "bad prompt", prompt_versions=bad)
    assert routing.versions(serving) == [1]  # nothing written
    number = routing.write_version(serving, roles_v1, "the PI's proposed prompt", prompt_versions={"principal_investigator": version})
    table = routing.load_version(serving, number)
    assert table["prompts"] == {"principal_investigator": version}
    rendered = prompt_registry.sync(cfg, table)
    fields = {"brief": "Q?", "protocol": "P", "reviews": "none"}
    assert rendered.version("principal_investigator") == version
    assert rendered.render("principal_investigator", **fields).endswith("Weigh the conclusion before the protocol.")
    assert rendered.sha("principal_investigator") == prompts.digest(candidate) != prompts.digest(repo_text)
    plain = prompt_registry.sync(cfg, routing.load_version(serving, 1))  # a table that routes no prompt: the repository's
    assert plain.render("principal_investigator", **fields) == repo_text.format(**fields)
    assert prompts.REPOSITORY.render("principal_investigator", **fields) == repo_text.format(**fields)  # no global moved


def test_a_pi_that_answers_one_decision_everywhere_is_not_promoted_however_often_it_is_right() -> None:
    """What the default make run's 8-step PI learned (docs/benchmarks.md): GO everywhere beats NO-GO everywhere on
    62% yes questions, significantly, and separates nothing: refused on discrimination (promote.min_auc)."""
    rng = random.Random(0)
    labels = ["yes"] * 55 + ["no"] * 34 + ["maybe"] * 11
    rng.shuffle(labels)
    always_go = _records([0.9 + rng.uniform(-0.05, 0.05) for _ in labels], labels)
    never_go = _records([0.1 + rng.uniform(-0.05, 0.05) for _ in labels], labels)
    gate = section("promote")
    diff = paired_difference(always_go, never_go, 200)
    assert diff.mean > 0 and diff.p_value < gate.alpha  # the reward alone would promote it
    d = decide(role_level.metrics(always_go, "reasoning_required", 200), role_level.metrics(never_go, "reasoning_required", 200),
               diff, gate)
    assert not d.promote and d.rule == "discrimination" and "promote.min_auc=0.5" in d.detail
    off = decide(role_level.metrics(always_go, "reasoning_required", 200), role_level.metrics(never_go, "reasoning_required", 200),
                 diff, section("promote", min_auc=None))
    assert off.promote


@pytest.mark.parametrize("served", ["brief", "society"])
def test_the_input_effect_asks_the_brief_alone_and_with_the_protocol_whichever_the_society_served(
        served: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PI that says GO on the brief alone and NO-GO once it reads a protocol: the report's brief accuracy is the
    brief's decision and its society accuracy the protocol's, whichever of the two the society served (its recorded
    decision); only the other is asked, one call a rollout."""
    from pipeline.agents.prompts import REPOSITORY
    from pipeline.stages import report
    from pipeline.traces.schema import Span, Trace

    params = load_params(ROOT / "params.yaml", environ={"PIPELINE__AGENTS__DECISION__INPUT": served})
    tasks = [{"id": str(i), "question": f"Does drug {i} work?", "contexts": ["An abstract."], "final_decision": label}
             for i, label in enumerate(["yes", "no", "yes"])]
    asked: list[list[dict]] = []

    async def pi(client, agent, model, cfg, decide_on, explain_on, spans, prompt=None):  # noqa: ANN001, ANN202
        asked.append(decide_on)
        told = decision.NO_PROTOCOL not in decide_on[-1]["content"]
        return decision.Answer(decision=Decision.NO_GO if told else Decision.GO, p_go=None, probs={}, rationale=None)

    def rollout(task: dict) -> Trace:
        society = decision.decision_messages(task, params.agents, params.data.setting, REPOSITORY, {"title": "t"}, [],
                                             what=decision.DecisionInput.SOCIETY)
        decided = society if served == "society" else decision.decision_messages(task, params.agents, params.data.setting,
                                                                                 REPOSITORY)
        span = lambda step, chat, d: Span(kind="llm", name="principal_investigator", data={  # noqa: E731
            "logical_model": "principal_investigator", "ok": True, "step": step, "decision": d,
            "messages": [*chat, {"role": "assistant", "content": "{"}]})
        return Trace(run_id="r", shard=0, task_id=task["id"], rollout_id=f"{task['id']}-0", status="ok",
                     label=task["final_decision"], spans=[span("decision", decided, "GO" if served == "brief" else "NO-GO"),
                                                          span("rationale", society, None)])

    monkeypatch.setattr(decision, "ask", pi)
    monkeypatch.setattr(report.proxy, "client_settings", lambda serving: ("http://127.0.0.1:9/v1", "key"))
    effect = report.input_effect(params, [rollout(t) for t in tasks], tasks, "principal_investigator", REPOSITORY)
    assert len(asked) == len(tasks)  # the served decision is the record's; only the other input is asked
    assert all((decision.NO_PROTOCOL in chat[-1]["content"]) == (served == "society") for chat in asked)
    assert effect.served_input == served and effect.n == 3 and effect.agree == 0
    assert effect.brief_accuracy == pytest.approx(2 / 3) and effect.society_accuracy == pytest.approx(1 / 3)
