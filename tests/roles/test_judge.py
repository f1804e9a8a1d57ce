"""An LLM judge as the reward role: verdicts parsed by hand, malformed ones counted and scored
by the stated rule, bad settings refused by field, and a quick run scored by a real judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from roles.judge import JudgeConfig, Verdict
from tests.deploy.test_run import job, quick_argv, records


def test_number_verdicts_are_the_first_number_scaled_into_range() -> None:
    v = Verdict(kind="number", low=0, high=10)
    assert v.parse("7") == 0.7
    assert v.parse("score: 2.5 / 10") == 0.25  # the first number
    assert v.parse(" -1 ") is None  # out of range: malformed
    assert v.parse("eleven") is None and v.parse("") is None


def test_choice_verdicts_are_the_first_choice_word() -> None:
    v = Verdict(kind="choice", choices={"Yes": 1.0, "no": 0.0, "partly": 0.5})
    assert v.parse("YES, it is right") == 1.0
    assert v.parse("well... partly; no") == 0.5
    assert v.parse("noted") is None  # a word that only starts like a choice is not one
    assert v.parse("maybe") is None


def test_choices_with_spaces_and_punctuation_match_as_written_longest_first() -> None:
    v = Verdict(kind="choice", choices={"not sure": 0.5, "not": 0.0, "yes!": 1.0, "A)": 0.25})
    assert v.parse("I am NOT SURE about it") == 0.5  # the longer choice at the same place
    assert v.parse("not at all") == 0.0
    assert v.parse("yes! definitely") == 1.0
    assert v.parse("yes, definitely") is None  # "yes!" is the choice, not "yes"
    assert v.parse("answer: a) the first") == 0.25
    assert v.parse("nothing sure") is None  # a choice inside a longer word is not one
    assert v.parse("surely not sure") == 0.5  # the first choice in the answer wins


def test_bad_settings_are_refused_by_field() -> None:
    base = {"model": "m", "template": "{prompt}"}
    with pytest.raises(ValidationError, match="needs choices"):
        JudgeConfig(**base, verdict={"kind": "choice"})
    with pytest.raises(ValidationError, match=r"high=1\.0 must be above low=5\.0"):
        JudgeConfig(**base, verdict={"kind": "number", "low": 5})
    with pytest.raises(ValidationError, match="verdict"):
        JudgeConfig(model="m", template="{prompt}")  # type: ignore[call-arg]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_judge_model_scores_the_quickstart(tmp_path: Path) -> None:
    """The quickstart's own model (a tiny untrained Llama at its start) judges: it answers the
    template's arithmetic-looking question with bytes that mostly hold no valid verdict, so most
    rows are malformed, counted, and score the stated 0.25."""
    run_dir = tmp_path / "run"
    judge = (
        "{cls: roles.judge:JudgeReward, model: base, template: '{prompt}{response} is right? ',"
        " verdict: {kind: choice, choices: {'yes': 1.0, 'no': 0.0}}, malformed: 0.25,"
        " max_new_tokens: 4}"
    )
    assert job(quick_argv("quickstart.yaml", run_dir, [f"roles.reward={judge}"])) == 0
    rows = [r for r in records(run_dir) if r["stage"] == "grpo" and "stage_step" in r]
    assert len(rows) == 6
    for r in rows:
        malformed = r["train/reward/judge_malformed"]
        assert 0.0 <= malformed <= 1.0
        # every malformed row scored 0.25, the others 0 or 1
        assert r["train/reward/mean"] >= 0.25 * malformed - 1e-6
    assert max(r["train/reward/judge_malformed"] for r in rows) > 0.5
    # what the judge said is logged beside each sample it scored, rollouts and validation alike
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    judged = [s for s in samples if s["stage"] == "grpo" or s["kind"] == "validation"]
    assert judged and all(isinstance(s.get("verdict"), str) for s in judged)
    assert {s["kind"] for s in judged} == {"rollout", "validation"}


def test_a_bad_judge_setting_fails_before_any_process_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    judge = "{cls: roles.judge:JudgeReward, model: base, template: x, verdict: {kind: vote}}"
    assert job(quick_argv("quickstart.yaml", run_dir, [f"roles.reward={judge}"])) != 0
    assert not (run_dir / "logs").exists() or not any((run_dir / "logs").iterdir())


def test_the_prompt_fills_the_template_and_wraps_it_as_a_chat_message(tmp_path: Path) -> None:
    from roles.judge import judge_prompt
    from roles.modeling.models import init_model, load_tokenizer
    from roles.reward import RewardError

    tokenizer = load_tokenizer(str(init_model(tmp_path / "m", "tiny")))
    fields = {"prompt": "2+2=", "response": "4", "answer": "4"}
    cfg = JudgeConfig(
        model="m",
        template="Q {prompt} A {response} (expected {answer})",
        verdict={"kind": "number"},
    )
    assert judge_prompt(cfg, tokenizer, 0, fields) == "Q 2+2= A 4 (expected 4)"
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|judge|>{% endif %}"
    )
    chat = cfg.model_copy(update={"chat": True})
    assert judge_prompt(chat, tokenizer, 0, fields) == "<|user|>Q 2+2= A 4 (expected 4)<|judge|>"
    with pytest.raises(RewardError, match="judge template names 'answer' but row 3 has only"):
        judge_prompt(cfg, tokenizer, 3, {"prompt": "p", "response": "r"})
