"""train.compile and train.activation_checkpointing (runtime/speed.py, docs/performance.md): compiled
runs are bit-identical to compiled runs on any world size and across a resume that changes it
(dist.reduce=canonical), checkpointing is bit-identical to none, and the compile's surprises are said.

The compiled runs are launched (each process compiles, from the shared Inductor cache that
scripts/test.sh points at: the first launch of a shape compiles, the others read it)."""
from __future__ import annotations

import json
import logging
import re

import pytest

import launch

# Every micro-batch the same shape on 1, 2 and 3 processes: 12 = 2 x 6 = 2 x 2 x 3 = 2 x 3 x 2.
COMPILED = ["dist.reduce=canonical", "train.global_batch=12", "train.compile=true", "train.steps=8"]


@pytest.mark.e2e
def test_compiled_runs_on_1_process_and_on_2_halted_then_3_resumed_under_fsdp_are_bit_identical(tmp_path, tiny):
    """One uninterrupted compiled run; the same run halted on 2 processes (ddp) at step 4 and resumed
    on 3 (fsdp): every loss and the final weights equal. Three launches, each compiling (or reading
    the cache's kernels) on its own: the run-to-run check too."""
    one = launch.run(0, *tiny, *COMPILED, f"out_dir={tmp_path / 'one'}")
    assert "train.compile: the first step took" in one.stderr and "Inductor's deterministic mode on" in one.stderr
    assert "graph break" not in one.stderr and "new graph" not in one.stderr
    launch.run(2, *tiny, *COMPILED, "train.halt_at=4", f"out_dir={tmp_path / 'moved'}")
    resumed = launch.run(3, *tiny, *COMPILED, "dist.strategy=fsdp", f"out_dir={tmp_path / 'moved'}")
    assert "resumes at" in resumed.stderr and "train.compile was" not in resumed.stderr
    launch.assert_identical(tmp_path / "moved", tmp_path / "one")
    # The same run resumed eagerly is allowed and said: the bits change from there.
    code, err = launch.in_process(*tiny, *COMPILED, "train.compile=false", "train.steps=9", f"out_dir={tmp_path / 'one'}")
    assert code == 0 and "train.compile was True, now False" in err and "not bit-identical" in err, err


@pytest.mark.e2e
def test_a_compiled_chat_run_with_its_block_diagonal_mask_is_bit_identical_on_1_and_2_processes(tmp_path):
    from test_chat import conversations

    corpus = tmp_path / "sft.jsonl"
    corpus.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations()))
    base = [f"data.path={corpus}", "data.format=chat", f"data.cache_dir={tmp_path / 'cache'}", "model.init_from=", "model.dim=32",
            "model.n_layers=2", "model.seq_len=128", "train.global_batch=6", "train.micro_batch=1", "train.steps=3",
            "train.warmup_steps=2", "dist.reduce=canonical", "train.compile=true", "runtime.threads=1", "log.progress=false",
            "log.sample_ids=true"]
    launch.run(0, *base, f"out_dir={tmp_path / 'one'}")
    launch.run(2, *base, f"out_dir={tmp_path / 'two'}")
    launch.assert_identical(tmp_path / "two", tmp_path / "one")


@pytest.mark.e2e
def test_activation_checkpointing_full_and_every_2_are_bit_identical_to_none_with_dropout(tmp_path, tiny):
    """The same arithmetic, recomputed in the backward from the same generator state (dropout draws
    its masks again, the same ones): the same losses and weights as without it (peak memory is
    scripts/bench.py's to measure)."""
    args = [*tiny, "model.dropout=0.1", "train.steps=6"]
    for mode in ("none", "full", "every_2"):
        code, err = launch.in_process(*args, f"train.activation_checkpointing={mode}", f"out_dir={tmp_path / mode}")
        assert code == 0, err
    launch.assert_identical(tmp_path / "full", tmp_path / "none")
    launch.assert_identical(tmp_path / "every_2", tmp_path / "none")


@pytest.fixture
def eager_dynamo(monkeypatch):
    """runtime.speed.apply with Dynamo's eager backend: the graphs, guards and counters of a real
    compile, without Inductor's code generation (seconds instead of a minute)."""
    import torch

    from runtime import speed

    monkeypatch.setattr(speed, "BACKEND", "eager")
    prior = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch._dynamo.reset()
    yield speed
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(prior[0], warn_only=prior[1])  # apply() turned them on for this process


@pytest.mark.e2e
def test_a_graph_break_and_a_recompile_after_the_first_step_are_warned(eager_dynamo, caplog):
    import torch

    from model import MiniMindLM, ModelConfig

    torch.manual_seed(0)
    model = MiniMindLM(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16))
    watch = eager_dynamo.apply(model, True, "none")
    tokens = torch.randint(0, 64, (2, 16))
    caplog.set_level(logging.INFO, logger="minimind")
    model(tokens, tokens)[1].backward()
    watch.after_step(1, True)
    assert "the first step took" in caplog.text and "graph break" not in caplog.text
    model(tokens, tokens)[1].backward()
    watch.after_step(2, True)
    assert "new graph" not in caplog.text  # the same shape: the same graphs
    model(tokens[:, :8], tokens[:, :8])[1].backward()  # another shape: a graph of its own
    watch.after_step(3, True)
    assert "new graph(s) after step 3 (a recompile" in caplog.text
    ffn = model.layers[1].feed_forward.forward

    def talkative(x):
        torch._dynamo.graph_break()  # as any untraceable call: the block's graph breaks here
        return ffn(x)

    model.layers[1].feed_forward.forward = talkative
    model(tokens, tokens)[1].backward()
    watch.after_step(4, True)
    assert "graph break(s) by step 4" in caplog.text and "graph_break()" in caplog.text, caplog.text


@pytest.mark.unit
@pytest.mark.parametrize("deterministic, device, expected", [(False, "cuda", False), (True, "cuda", True), (False, "cpu", True)])
def test_a_compiled_run_pays_for_inductors_deterministic_mode_only_where_its_exactness_needs_it(eager_dynamo, deterministic,
                                                                                                device, expected):
    """On CUDA, runtime.deterministic=false compiles without Inductor's deterministic mode or torch's
    deterministic algorithms (no tuning given up, no slower kernel: docs/performance.md); =true turns
    both on and the watch checks them after every step. On the CPU both are on either way: the
    compiled run's exactness across world sizes rests on them there."""
    import torch
    import torch._inductor.config as inductor

    from model import MiniMindLM, ModelConfig

    torch.use_deterministic_algorithms(False)
    model = MiniMindLM(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, seq_len=16))
    watch = eager_dynamo.apply(model, True, "none", deterministic, device)
    assert inductor.deterministic is expected and torch.are_deterministic_algorithms_enabled() is expected
    assert watch.deterministic is expected


@pytest.mark.unit
def test_a_deterministic_mode_switched_off_after_a_compiled_step_fails_the_run(monkeypatch):
    import torch
    import torch._inductor.config as inductor

    from runtime import speed

    watch = speed.CompileWatch()
    monkeypatch.setattr(inductor, "deterministic", True)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    watch.after_step(1, False)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    with pytest.raises(RuntimeError, match="torch.use_deterministic_algorithms switched off after a compiled step"):
        watch.after_step(2, False)
    monkeypatch.setattr(inductor, "deterministic", False)
    with pytest.raises(RuntimeError, match=r"torch._inductor.config.deterministic and torch.use_deterministic_algorithms"):
        watch.after_step(3, False)


@pytest.mark.unit
@pytest.mark.parametrize("mode, n, blocks", [("none", 4, []), ("full", 3, [0, 1, 2]), ("every_2", 5, [0, 2, 4]), ("every_1", 2, [0, 1])])
def test_activation_checkpointing_names_its_blocks(mode, n, blocks):
    from runtime.speed import checkpointed_blocks

    assert checkpointed_blocks(mode, n) == blocks


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["every_0", "some", "every_x"])
def test_a_bad_activation_checkpointing_mode_is_refused_naming_the_key(mode):
    from configs import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"train.activation_checkpointing: expected none, full or every_K.*{mode}"):
        load_config("configs/tiny.yaml", [f"train.activation_checkpointing={mode}"])


@pytest.mark.e2e
def test_a_compiled_grpo_run_halted_on_2_and_resumed_on_1_equals_the_uninterrupted_one_its_rollouts_eager(tmp_path):
    """GRPO under train.compile (objectives/grpo.py): the rollout runs eagerly (each KV-cache length
    would be a static graph of its own, the recompile limit reached inside the first prompt, and which
    frames run compiled would then depend on the process's history); the training forwards stay
    compiled, the same graphs in every launch: halted inside a rollout's updates on 2 processes and
    resumed on 1, the weights and every logged figure are the uninterrupted compiled run's."""
    from test_grpo import REWARD, REWARDS, base

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {w}.", "answer": w}) + "\n" for w in "red blue green cat dog sun".split() * 4))
    (tmp_path / "rewards.py").write_text(REWARD)
    args = [*base((prompts, tmp_path / "rewards.py"), tmp_path / "cache"), "train.compile=true", "train.steps=4"]
    runs = [launch.run(0, *args, f"out_dir={tmp_path / 'one'}"),
            launch.run(2, *args, "train.halt_at=3", f"out_dir={tmp_path / 'moved'}"),
            launch.run(0, *args, f"out_dir={tmp_path / 'moved'}")]
    for proc in runs:
        assert "train.compile: the first step took" in proc.stderr, proc.stderr[-3000:]
        assert not re.search(r"recompile_limit|cache_size_limit|new graph|graph break", proc.stderr), proc.stderr[-3000:]
    launch.assert_identical(tmp_path / "moved", tmp_path / "one")
    got, want = launch.metrics(tmp_path / "moved"), launch.metrics(tmp_path / "one")
    for key in ("loss", *REWARDS):
        assert [r[key] for r in got] == [r[key] for r in want], key
