"""data.mix: weighted corpora interleaved by Megatron's blending rule, resumed sample-exactly on any
world size from the counts consumed per source (docs/data.md "Mixtures and phases")."""
import json
import random
import subprocess
import sys

import pytest

import launch
from data.mix import MixOrder

WORDS = "the a model data step epoch resume checkpoint rank world size batch order seed loss weight".split()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three corpora: a (about 900 samples of 32 tokens), b (about 360), c (about 25: it runs out
    within a few steps, so its next epochs are read while the others go on)."""
    root = tmp_path_factory.mktemp("mix")
    for name, docs in (("a", 300), ("b", 120), ("c", 8)):
        rnd = random.Random(name)
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(docs):
                f.write(json.dumps({"text": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 30))) + "."}) + "\n")
    return root


def mix(root, **weights) -> str:
    return "data.mix=[" + ", ".join(f"{{path: {root / n}.jsonl, weight: {w}, name: {n}}}" for n, w in weights.items()) + "]"


@pytest.fixture(scope="module")
def args(tiny):
    """M = 12 / 2 = 6 micro-batches a step: 1, 2 and 3 processes divide it."""
    return [*(o for o in tiny if not o.startswith("data.path=")), "dist.reduce=canonical", "model.dropout=0.1", "train.global_batch=12", "train.micro_batch=2", "train.steps=10",
            "checkpoint.interval=1", "checkpoint.keep=100", "log.sample_ids=true"]


@pytest.mark.unit
def test_the_interleave_takes_the_next_sample_from_the_source_furthest_behind_its_share():
    order = MixOrder(["a", "b"], [100, 7], [3.0, 1.0], seed=5, kind="randperm", global_batch=4)
    picks = [order.source_of(i) for s in range(12) for i in order.step_samples(s)]
    assert picks[:8] == [0, 0, 1, 0, 0, 0, 1, 0]  # a=0.75, b=0.25: the share a source is behind decides, a tie goes to a
    for n in range(1, len(picks) + 1):  # after every sample each source is within one sample of its share
        assert abs(picks[:n].count(1) - 0.25 * n) <= 1
    # b (7 samples) is read whole in its epoch 0 order, then its epoch 1 order (seed + 1) follows
    from data.sampler import epoch_order

    b = [i - 100 for s in range(12) for i in order.step_samples(s) if i >= 100]
    assert b[:7] == epoch_order(7, 5, 0).tolist() and b[7:] == epoch_order(7, 5, 1).tolist()[: len(b) - 7]
    assert order.counts_at(12) == [picks.count(0), picks.count(1)]


@pytest.mark.unit
def test_weights_whose_sum_overflows_a_float_are_normalized_to_their_shares_and_interleave_as_those_shares_do():
    big = MixOrder(["a", "b"], [100, 70], [1e308, 9e307], seed=5, kind="randperm", global_batch=4)
    assert big.weights == pytest.approx([10 / 19, 9 / 19], rel=1e-15)  # the sum, 1.9e308, is past a float's largest: not 0 and 0
    small = MixOrder(["a", "b"], [100, 70], [10.0, 9.0], seed=5, kind="randperm", global_batch=4)
    assert [big.step_samples(s) for s in range(20)] == [small.step_samples(s) for s in range(20)]
    from data.mix import normalize

    assert normalize([0.1, 0.2, 0.7]) == [w / sum([0.1, 0.2, 0.7]) for w in (0.1, 0.2, 0.7)]  # a finite sum: the same bits as before


@pytest.mark.unit
@pytest.mark.parametrize("entry, match", [
    ("{path: x.jsonl, weight: 0, name: a}", r"data.mix\[0\].weight: expected a number > 0, got 0"),
    ("{path: x.jsonl, weight: -1, name: a}", r"data.mix\[0\].weight: expected a number > 0, got -1"),
    ("{path: x.jsonl, name: a}, {path: y.jsonl, name: a}", r"data.mix\[1\].name: 'a' names two sources"),
    ("{path: x.jsonl, name: loss}", r"data.mix\[0\].name: 'loss' cannot name a source"),
    ("{path: x.jsonl, name: a/b}", r"data.mix\[0\].name: 'a/b' cannot name a source"),
    ("{path: x.jsonl, name: a, format: chat}", r"data.mix\[0\].format: 'chat'"),
    ("{path: x.jsonl, name: a, size: 3}", r"data.mix\[0\]: unknown key 'size'"),
    ("{path: x.jsonl, name: a, weight: 1e-3}", r"x.jsonl"),  # YAML 1.1's string '1e-3' read as the number: the path is what fails
    ("{path: x.jsonl, name: a, weight: 1e308}, {path: y.jsonl, name: b, weight: 1e-300}",
     r"data.mix\[1\].weight: 1e-300 beside the largest weight 1e\+308: its share of the sum underflows to 0"),
])
def test_a_bad_mix_exits_2_naming_the_key(tmp_path, entry, match):
    code, err = launch.in_process(f"data.mix=[{entry}]", f"out_dir={tmp_path}")
    assert code == 2 and "Traceback" not in err, err
    import re

    assert re.search(match, err), err


@pytest.mark.unit
def test_a_mix_beside_data_path_or_under_another_objective_is_refused_naming_both():
    from configs import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data.path=y.jsonl with data.mix: give the corpus as one of data.mix's sources"):
        load_config(None, ["data.mix=[{path: x.jsonl}]", "data.path=y.jsonl"])
    with pytest.raises(ConfigError, match=r"train.objective=distill with data.mix: not supported"):
        load_config(None, ["data.mix=[{path: x.jsonl}]", "train.objective=distill", "train.distill.teacher=t"])


@pytest.mark.e2e
def test_a_mix_halted_on_two_processes_and_resumed_on_three_is_the_run_on_one(tmp_path, args, sources):
    """Every loss (the step's and each source's loss/<name>, tokens/<name>), every step's sample ids
    and the weights at every step equal the one-process run's; c (about 25 samples at a quarter of
    each step) runs out and starts its next epochs on the way."""
    the_mix = mix(sources, a=2, b=1, c=1)
    one = tmp_path / "one"
    launch.run(0, *args, the_mix, f"out_dir={one}")
    out = tmp_path / "two-three"
    launch.run(2, *args, the_mix, f"out_dir={out}", "train.halt_at=4")
    launch.run(3, *args, the_mix, f"out_dir={out}")
    launch.assert_identical(out, one)
    for step in range(1, 11):
        assert launch.sha_at(out, step) == launch.sha_at(one, step), step
    figures = lambda run: [{k: v for k, v in m.items() if k.startswith(("loss/", "tokens/"))} for m in launch.metrics(run)]  # noqa: E731
    assert figures(out) == figures(one) and all(len(f) == 6 for f in figures(one))  # every source's loss and tokens, every step
    before = dict.fromkeys("abc", 0)
    for m in launch.metrics(one):  # each source's loss weighted by its samples is the step's loss
        taken = {n: (m[f"tokens/{n}"] - before[n]) // 32 for n in "abc"}
        before = {n: m[f"tokens/{n}"] for n in "abc"}
        assert sum(taken.values()) == 12
        # float64 sums of rows against the step's float32 loss: 5.2e-7 apart at most measured, 10x allowed
        assert abs(sum(taken[n] * m[f"loss/{n}"] for n in "abc") / 12 - m["loss"]) < 5e-6
    fingerprint = launch.inspect(out)["data_fingerprint"]["mix"]  # `python -m checkpoint inspect` names each source
    assert set(fingerprint) == {"a", "b", "c"} and all(len(v["source_sha256"]) == 64 for v in fingerprint.values())
    c = [i for m in launch.metrics(one) for i in m["sample_ids"] if i >= fingerprint["a"]["samples"] + fingerprint["b"]["samples"]]
    assert len(c) > fingerprint["c"]["samples"]  # c was read past its first epoch


@pytest.mark.e2e
def test_weights_changed_and_a_source_added_on_a_resume_start_a_phase_equal_to_the_same_change_at_the_same_step(tmp_path, args, sources):
    """Phase 1 (a=2, b=1) for 4 steps, then phase 2 (a=1, b=2, c=4) from the counts reached: on 2,
    then 3 processes (halted inside phase 2, so its start is read back from the checkpoint), then
    1, equal to one process making the same change at step 4 in every loss, sample id and weight.
    Sevenths do not divide a step's 12 samples, so a phase that restarted at step 7 would differ."""
    first, second = mix(sources, a=2, b=1), mix(sources, a=1, b=2, c=4)
    one = tmp_path / "one"
    launch.run(0, *args, first, f"out_dir={one}", "train.halt_at=4")
    said = launch.run(0, *args, second, f"out_dir={one}").stderr
    assert "data.mix: a new phase from step 4: weights a=0.6667, b=0.3333 -> a=0.1429, b=0.2857, c=0.5714; counts kept: a=32, b=16, c=0" in said
    out = tmp_path / "phases"
    launch.run(2, *args, first, f"out_dir={out}", "train.halt_at=4")
    launch.run(3, *args, second, f"out_dir={out}", "train.halt_at=7")
    again = launch.run(0, *args, second, f"out_dir={out}", "data.num_workers=2").stderr  # workers read the samples, the trainer orders
    assert "new phase" not in again  # the same weights: phase 2 goes on
    launch.assert_identical(out, one)
    for step in range(1, 11):
        assert launch.sha_at(out, step) == launch.sha_at(one, step), step
    sizes = launch.storage_manifest(one, 10)["data_fingerprint"]["mix"]
    from_c = [sum(i >= sizes["a"]["samples"] + sizes["b"]["samples"] for i in m["sample_ids"]) for m in launch.metrics(one)]
    assert from_c[:4] == [0] * 4 and abs(sum(from_c[4:]) - 4 / 7 * 72) <= 1  # c joins at step 5 with 4/7 of what follows


@pytest.mark.e2e
def test_a_source_removed_on_a_resume_is_refused_unless_data_mix_drop_names_it(tmp_path, tiny, sources):
    run = [*(o for o in tiny if not o.startswith("data.path=")), "train.global_batch=4", "train.micro_batch=2", "checkpoint.interval=1",
           "log.sample_ids=true", f"out_dir={tmp_path}"]
    assert launch.in_process(*run, mix(sources, a=1, b=1), "train.steps=2")[0] == 0
    code, err = launch.in_process(*run, mix(sources, a=1), "train.steps=3")
    assert code == 2 and "data.mix: source 'b' was in the mix at step 2 and is not now" in err and "data.mix_drop" in err, err
    code, err = launch.in_process(*run, mix(sources, a=1), "train.steps=3", "data.mix_drop=bb")
    assert code == 2 and "data.mix_drop: 'bb' is no source of the checkpoint's mix (a, b)" in err, err
    code, err = launch.in_process(*run, mix(sources, a=1), "train.steps=3", "data.mix_drop=b")
    assert code == 0 and "data.mix: a new phase from step 2" in err and "dropped b" in err, err
    assert [m["step"] for m in launch.metrics(tmp_path)] == [1, 2, 3]
    # The same command again, further on: 'b' was dropped by an earlier phase, not a typo; no new phase.
    code, err = launch.in_process(*run, mix(sources, a=1), "train.steps=4", "data.mix_drop=b")
    assert code == 0 and "new phase" not in err, err
    assert [m["step"] for m in launch.metrics(tmp_path)] == [1, 2, 3, 4]
    # 'b' named again goes on from the samples it had given at step 2, not from its first one.
    b_at_2 = sum(1 for m in launch.metrics(tmp_path)[:2] for i in m["sample_ids"] if i >= launch.storage_manifest(tmp_path, 2)[
        "data_fingerprint"]["mix"]["a"]["samples"])
    code, err = launch.in_process(*run, mix(sources, a=1, b=1), "train.steps=5", "data.mix_drop=b")
    assert code == 2 and "data.mix_drop: 'b' is also a source of data.mix" in err, err
    code, err = launch.in_process(*run, mix(sources, a=1, b=1), "train.steps=5")
    assert code == 0 and "data.mix: a new phase from step 4" in err and f", b={b_at_2}" in err and b_at_2 > 0, err


@pytest.mark.e2e
def test_validation_holds_out_each_sources_tail_and_logs_each_sources_loss_the_same_on_any_world_size(tmp_path, args, sources,
                                                                                                     cache_dir):
    """data.val_samples=5 with a mix: the last 5 samples of each source, never in a training batch;
    val_loss/<name> per source and val_loss their weighted mean, the same bits on 2 processes as on
    one. A resume with another data.val_samples (each source's training samples change) is refused."""
    the_mix, extra = mix(sources, a=2, b=1, c=1), ["data.val_samples=5", "eval.interval=3", "train.steps=6"]
    one, two = tmp_path / "one", tmp_path / "two"
    launch.run(0, *args, the_mix, *extra, f"out_dir={one}")
    launch.run(2, *args, the_mix, *extra, f"out_dir={two}")
    figures = lambda run: [{k: v for k, v in m.items() if k.startswith("val_loss")} for m in launch.metrics(run)]  # noqa: E731
    assert figures(one) == figures(two)
    evaluated = [f for f in figures(one) if f]
    assert len(evaluated) == 2 and all(set(f) == {"val_loss", "val_loss/a", "val_loss/b", "val_loss/c"} for f in evaluated)
    assert all(f["val_loss"] == (f["val_loss/a"] * 5 + f["val_loss/b"] * 5 + f["val_loss/c"] * 5) / 15 for f in evaluated)
    from data.prepare import pack, resolve_source

    sizes = launch.storage_manifest(one, 6)["data_fingerprint"]["mix"]
    for name in "abc":  # each source trains on all but its last 5 samples (the ids index those training samples only)
        packed = pack(resolve_source(str(sources / f"{name}.jsonl"), cache_dir), 32, cache_dir)[1]["num_samples"]
        assert sizes[name]["samples"] == packed - 5
    code, err = launch.in_process(*args, the_mix, "data.val_samples=4", "eval.interval=3", "train.steps=8", f"out_dir={one}")
    assert code == 2 and "data.mix: source 'a' changed since the checkpoint" in err and "samples" in err, err


@pytest.mark.e2e
def test_a_mix_of_chat_sources_halted_on_two_processes_and_resumed_on_three_is_the_run_on_one(tmp_path, args):
    """data.format=chat: the built-in conversations under two names (1:2). Each step's loss is its
    taught tokens' (I17) whoever computes what; loss/<name> is each source's taught tokens' loss."""
    chat = ["data.format=chat", "data.mix=[{path: stdlib-chat, weight: 1, name: x}, {path: stdlib-chat, weight: 2, name: y}]",
            "model.seq_len=128", "train.steps=6"]
    one, out = tmp_path / "one", tmp_path / "two-three"
    launch.run(0, *args, *chat, f"out_dir={one}")
    launch.run(2, *args, *chat, f"out_dir={out}", "train.halt_at=3")
    launch.run(3, *args, *chat, f"out_dir={out}")
    launch.assert_identical(out, one)
    figures = lambda run: [{k: v for k, v in m.items() if "/" in k} for m in launch.metrics(run)]  # noqa: E731
    assert figures(out) == figures(one) and all(set(f) == {"loss/x", "loss/y", "tokens/x", "tokens/y"} for f in figures(one))
    assert [m["tokens/y"] for m in launch.metrics(one)] == [m["tokens/x"] * 2 for m in launch.metrics(one)]  # 1:2, 12 rows a step


@pytest.mark.e2e
@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_a_mix_of_one_source_is_the_run_on_that_corpus(tmp_path, args, corpus, fmt):
    """One source at any weight: its order is the corpus's randperm(seed + epoch), so every sample id,
    loss (a chat step's over its taught tokens, I17) and weight equal the plain data.path run's;
    loss/<name> is then the step's loss."""
    path, extra = (str(corpus), []) if fmt == "text" else ("stdlib-chat", ["data.format=chat", "model.seq_len=128"])
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    launch.run(0, *args, *extra, f"data.path={path}", "train.steps=4", f"out_dir={plain}")
    launch.run(0, *args, *extra, f"data.mix=[{{path: {path}, weight: 3, name: only}}]", "train.steps=4", f"out_dir={mixed}")
    launch.assert_identical(mixed, plain)
    # float64 row sums against the step's float32 loss: 5.2e-7 apart at most measured on text, 10x allowed
    assert all(abs(m["loss/only"] - m["loss"]) < 5e-6 for m in launch.metrics(mixed))


@pytest.mark.unit
def test_the_command_line_form_of_data_mix_the_docs_show_is_the_list_a_config_file_gives():
    import re
    import shlex

    from configs import load_config

    text = (launch.ROOT / "docs" / "data.md").read_text()
    command = next(line for line in text.splitlines() if line.startswith("bash scripts/train.sh 'data.mix="))
    overrides = [a for a in shlex.split(command)[2:] if not a.startswith("out_dir=")]
    assert re.search(r"^```bash\n" + re.escape(command) + r"\n```", text, re.M)  # a bash block: tests/test_docs.py runs it as written
    cfg = load_config(launch.ROOT / "configs" / "tiny.yaml", overrides)
    assert cfg.data.mix == [{"path": "pretrain.jsonl", "weight": 3, "name": "web"},
                            {"path": "corpus/*.jsonl.gz", "weight": 1, "name": "books"}]
    from data.mix import parse_mix

    assert [(s.name, s.weight) for s in parse_mix(cfg.data.mix)] == [("books", 1.0), ("web", 3.0)]
