"""Objectives plug in through one registry (objectives/spec.py): every registered objective implements the
loop's protocol, every key of an objective's section that the chosen objective does not read is refused
naming it, and the config checks, --help, the matrix and docs/design.md's combinations table read the
registry rather than a list of names of their own."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import objectives
from test_agent import agent_task, agent_uninterrupted  # noqa: F401  (the agent task and its default run: fixtures)
from objectives import spec as registry

ROOT = Path(__file__).resolve().parents[1]

ALT = {"train.grpo.loss": "grpo", "train.grpo.importance_sampling": "sequence", "train.grpo.scale_rewards": "batch",
       "train.grpo.std": "sample", "train.grpo.normalize": "tokens", "train.grpo.reference": "runs/ref", "train.grpo.reward": "minimind_rules",
       "train.dpo.reference": "runs/ref", "train.distill.teacher": "runs/teacher2", "train.distill.teacher_model.rope_scaling.type": "yarn",
       "train.distill.teacher_model.init_from": "runs/x", "train.ppo.critic": "runs/critic", "train.agent.tools": "calculate_math",
       "train.agent.parser": "my_parser:parse", "train.distill.teacher_model.rope_scaling.factor": 2.0}
"""Another valid value of each text key (a number's or a flag's is made below, but where the made one is invalid)."""
WITH = {"train.distill.teacher_model.moe.": ["train.distill.teacher_model.moe.experts=4"],
        "train.distill.teacher_model.rope_scaling.type": ["train.distill.teacher_model.rope_scaling.factor=2.0"]}
"""The keys a key is valid only beside (an expert's keys need experts, YaRN a factor)."""


def other(key: str, value):
    """A value away from the default `value`."""
    if key in ALT:
        return ALT[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2 if value else 2
    if isinstance(value, float):
        return value / 2 if value else 0.5
    assert key in ALT, f"{key}: a text key the walk has no other value for: add one to ALT"
    return ALT[key]


def base(spec: registry.ObjectiveSpec, data_format: str) -> list[str]:
    """A valid config of this objective and format (batches in whole groups of completions)."""
    out = [f"train.objective={spec.objective}", f"data.format={data_format}", "train.global_batch=24", "train.micro_batch=12"]
    if spec.name == "distill":
        out.append("train.distill.teacher=runs/teacher")
    if data_format == "agent":
        out.append("train.grpo.reward=minimind_agent")
    return out


@pytest.mark.unit
def test_every_registered_objective_implements_the_loops_protocol_with_its_signatures():
    """objectives.spec.Objective is what train.py calls; each class a factory may return has every method with the
    protocol's parameters, and the skip_update flag."""
    wanted = {name: list(inspect.signature(getattr(registry.Objective, name)).parameters) for name in
              ("start", "begin_step", "prepare", "loss", "step_metrics", "states")}
    assert {s.name for s in objectives.specs()} >= {"next_token", "dpo", "distill", "grpo", "ppo", "agent"}
    for spec in objectives.specs():
        assert spec.classes, spec.name
        for cls in spec.classes:
            for name, params in wanted.items():
                got = list(inspect.signature(getattr(cls, name)).parameters)
                assert got == params, f"{spec.name}: {cls.__name__}.{name}{tuple(got)} is not the protocol's {tuple(params)}"
            assert isinstance(getattr(cls, "skip_update", None), bool), f"{cls.__name__}: no skip_update flag"


@pytest.mark.unit
def test_a_key_an_objective_does_not_read_set_away_from_its_default_is_refused_naming_it_under_every_objective():
    """Every key of every registered train.<section>, set away from its default under every objective and each
    data format it reads: refused naming the key when the objective does not read it (as unread, or by the
    section's own check), never refused as unread when it does (another check may still refuse the value)."""
    from configs import ConfigError, load_config

    walked = 0
    for spec in objectives.specs():
        for data_format in spec.formats:
            load_config(None, base(spec, data_format))  # the base itself is valid
            reads = spec.read_by(data_format)
            for section, cls in registry.sections().items():
                for key, value, _ in registry.leaf_keys(cls(), f"train.{section}."):
                    walked += 1
                    alt = other(key, value)
                    honoured = reads.get(section) == registry.ALL or key.split(".")[2] in reads.get(section, ())
                    text = f"{key}={str(alt).lower() if isinstance(alt, bool) else alt}"
                    beside = [o for prefix, extra in WITH.items() if key.startswith(prefix) for o in extra if not o.startswith(key + "=")]
                    try:
                        load_config(None, [*base(spec, data_format), *beside, text])
                    except ConfigError as e:
                        unread = "does not read it" in str(e)
                        assert not (honoured and unread), f"{spec.name}/{data_format}: {key} is read but refused as unread: {e}"
                        assert honoured or key in str(e), f"{spec.name}/{data_format}: {key} is refused without being named: {e}"
                    else:
                        assert honoured, f"{spec.name}/{data_format}: {text} is not read, and was accepted"
    assert walked > 100


@pytest.mark.unit
def test_the_agent_reads_grpos_scale_rewards_std_and_mask_truncated_and_ppo_refuses_grpos_loss_keys():
    from configs import ConfigError, load_config

    agent = registry.spec_for("grpo", "agent")
    for key in ("train.grpo.scale_rewards=none", "train.grpo.std=sample", "train.grpo.mask_truncated=true"):
        load_config(None, [*base(agent, "agent"), key])
    ppo = registry.spec_of("ppo")
    with pytest.raises(ConfigError, match=r"^train.grpo.loss=dapo: train.objective=ppo with data.format=prompts does not read it"):
        load_config(None, [*base(ppo, "prompts"), "train.grpo.loss=dapo"])


@pytest.mark.e2e
def test_an_unread_key_exits_2_through_train_py_naming_it(tmp_path):
    import launch

    code, err = launch.in_process("train.objective=next_token", "train.dpo.beta=0.5", f"out_dir={tmp_path / 'run'}")
    assert code == 2 and "train.dpo.beta=0.5: train.objective=next_token with data.format=text does not read it" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.unit
def test_train_objectives_choices_formats_and_help_come_from_the_registry():
    from configs import ConfigError, describe, load_config

    names = list(registry.objectives())
    with pytest.raises(ConfigError, match="expected one of " + ", ".join(names)):
        load_config(None, ["train.objective=nope"])
    with pytest.raises(ConfigError, match=r"train.objective=dpo with data.format=text: not supported \(next_token reads data.format=text\|chat"):
        load_config(None, ["train.objective=dpo"])
    line = next(line for line in describe().splitlines() if line.strip().startswith("train.objective ="))
    for spec in objectives.specs():
        assert spec.summary in line and spec.docs in line
    for section in registry.sections():
        assert f"train.{section} (" in describe()


@pytest.mark.unit
def test_docs_design_md_combinations_table_holds_each_refusal_the_registry_holds():
    """The refused rows of docs/design.md's "Combinations" are the registry's (objectives.spec.refusal_rows)."""
    page = (ROOT / "docs" / "design.md").read_text()
    missing = [row for row in registry.refusal_table().splitlines() if row not in page]
    assert not missing, f"docs/design.md lacks these rows of `python -m objectives` (paste them in): {missing}"


@pytest.mark.unit
def test_the_matrix_objective_dimension_and_its_refusals_are_the_registrys():
    import matrix

    assert matrix.DIMENSIONS["objective"] == tuple(v.name for s in objectives.specs() for v in s.matrix)
    for name, _, keys in matrix.REFUSALS:
        spec = registry.spec_of(re.sub(r"-under-fsdp$", "", name))
        assert "fsdp" not in spec.supports and keys == (f"train.objective={spec.objective}", "dist.strategy=fsdp")


AGENT_VARIANTS = {"scale_rewards-none": ["train.grpo.scale_rewards=none"], "scale_rewards-batch": ["train.grpo.scale_rewards=batch"],
                  "std-sample": ["train.grpo.std=sample"], "mask_truncated": ["train.grpo.mask_truncated=true"]}


@pytest.mark.e2e
@pytest.mark.parametrize("variant", AGENT_VARIANTS)
def test_the_agents_scale_rewards_std_and_mask_truncated_train_and_halted_on_2_resumed_on_3_equal_the_1_process_run(
        variant, agent_task, agent_uninterrupted, tmp_path):
    """GRPO's rollout path is the agent's (objectives/grpo.py `group` hook): each of these keys changes the agent's
    training (the uninterrupted run is not the default's) and stays exact, halted inside a rollout's updates on 2
    processes and resumed on 3, against one process (the weights and every logged figure)."""
    import launch
    from test_agent import AGENT_FIGURES, agent_base

    args = [*agent_base(agent_task, tmp_path / "cache"), *AGENT_VARIANTS[variant]]
    code, err = launch.in_process(*args, f"out_dir={tmp_path / 'one'}")
    assert code == 0, err[-3000:]
    launch.run(2, *args, "train.halt_at=3", f"out_dir={tmp_path / 'moved'}")
    launch.run(3, *args, f"out_dir={tmp_path / 'moved'}")
    launch.assert_identical(tmp_path / "moved", tmp_path / "one")
    got, want, default = launch.metrics(tmp_path / "moved"), launch.metrics(tmp_path / "one"), launch.metrics(agent_uninterrupted / "one")
    for key in AGENT_FIGURES:
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["loss"] for r in want] != [r["loss"] for r in default], f"{variant}: the agent trained as without it"
