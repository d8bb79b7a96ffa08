"""train.objective=dpo over data.format=preference (data/preference.py, objectives/dpo.py,
docs/dpo.md): TRL's loss and rewards on the same pairs, a reference pinned by its hash, the
precomputed and the live reference the same bits, exact on any world size, bad input named."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

import launch
from test_tokenizers import MINIMIND, needs_minimind

ROOT = Path(__file__).resolve().parents[1]
WORDS = "red blue green cat dog sun moon tree river stone bird fish".split()


def pairs(n: int = 48, seed: int = 0) -> list[dict]:
    """Short pairs in both of MiniMind's and TRL's forms: implicit prompts (shared turns, a system
    turn on some, two exchanges on some) and explicit ones (strings)."""
    rnd = random.Random(seed)
    out = []
    for k in range(n):
        a, b = rnd.sample(WORDS, 2)
        q = {"role": "user", "content": f"Say {a}."}
        good, bad = {"role": "assistant", "content": f"{a}."}, {"role": "assistant", "content": f"{b} {b}."}
        if k % 4 == 3:
            out.append({"prompt": f"Say {a}.", "chosen": f"{a}.", "rejected": f"{b}."})
            continue
        head = [{"role": "system", "content": "Be brief."}] if k % 3 == 0 else []
        if k % 5 == 0:
            head += [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hi."}]
        out.append({"chosen": [*head, q, good], "rejected": [*head, q, bad]})
    return out


def rows_held(table: Path, segments: int = 2) -> dict:
    """The rows a DPO table holds, every chunk verified (objectives/tables.py)."""
    import numpy as np

    from objectives.tables import TableFiles, read_verified

    return read_verified(TableFiles(table), {"logps": np.zeros((0, segments), np.float32)}, str(table))[0]


def write(path: Path, lines) -> Path:
    path.write_text("".join((json.dumps(x, ensure_ascii=False) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def prefs(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("dpo") / "dpo.jsonl", pairs())


def base(prefs: Path, cache: Path) -> list[str]:
    return [f"data.path={prefs}", "data.format=preference", "train.objective=dpo", f"data.cache_dir={cache}",
            "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=96",
            "train.global_batch=12", "train.micro_batch=1", "train.steps=6", "train.warmup_steps=1", "train.lr=3e-3",
            "train.dpo.beta=0.2", "dist.reduce=canonical", "checkpoint.interval=0", "checkpoint.keep=10",
            "log.progress=false", "runtime.threads=1"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, prefs):
    """The uninterrupted one-process DPO run (precomputed reference: the seeded init)."""
    root = tmp_path_factory.mktemp("dpo-runs")
    code, err = launch.in_process(*base(prefs, root / "cache"), f"out_dir={root / 'one'}")
    assert code == 0, err
    return root


@pytest.mark.e2e
def test_the_first_step_is_ln_2_and_the_rewards_are_trls_names_and_move(reference_run):
    rows = launch.metrics(reference_run / "one")
    assert abs(rows[0]["loss"] - math.log(2)) <= 1e-6, rows[0]["loss"]  # the policy is its reference
    assert rows[0]["rewards/chosen"] == rows[0]["rewards/rejected"] == rows[0]["rewards/margins"] == 0.0
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"} <= set(rows[-1])
    assert rows[-1]["loss"] != rows[0]["loss"] and rows[-1]["rewards/margins"] != 0.0


@pytest.mark.e2e
def test_a_live_reference_gives_the_precomputed_references_bits(reference_run, prefs, tmp_path):
    code, err = launch.in_process(*base(prefs, reference_run / "cache"), "train.dpo.precompute=false", f"out_dir={tmp_path / 'live'}")
    assert code == 0 and "live beside the policy" in err, err
    launch.assert_identical(tmp_path / "live", reference_run / "one")
    rows = launch.metrics(tmp_path / "live")
    assert [r["rewards/margins"] for r in rows] == [r["rewards/margins"] for r in launch.metrics(reference_run / "one")]


@pytest.mark.e2e
def test_dpo_halted_on_2_processes_and_resumed_on_3_under_fsdp_equals_the_one_process_run(reference_run, prefs, tmp_path):
    args = [*base(prefs, tmp_path / "cache"), f"out_dir={tmp_path / 'moved'}"]
    launch.run(2, *args, "train.halt_at=3")
    resumed = launch.run(3, *args, "dist.strategy=fsdp")
    assert "verified" in resumed.stderr
    launch.assert_identical(tmp_path / "moved", reference_run / "one")
    want = launch.metrics(reference_run / "one")
    assert [r["rewards/accuracies"] for r in launch.metrics(tmp_path / "moved")] == [r["rewards/accuracies"] for r in want]


@pytest.mark.e2e
def test_a_resume_against_another_reference_is_refused_naming_both_hashes(reference_run, prefs, tmp_path):
    out = tmp_path / "run"
    args = [*base(prefs, reference_run / "cache"), f"out_dir={out}"]
    assert launch.in_process(*args, "train.halt_at=2")[0] == 0
    pinned = launch.storage_manifest(out, 2)["reference"]["sha256"]
    code, err = launch.in_process(*args, f"train.dpo.reference={reference_run / 'one'}")
    assert code == 2 and "Traceback" not in err, err
    assert f"but the steps of {out / 'checkpoints' / 'step_00000002'} were trained over identity {pinned}" in err, err
    assert [s.name for s in (out / "checkpoints").iterdir()] == ["step_00000002"]


@needs_minimind
@pytest.mark.e2e
def test_our_loss_and_rewards_on_packed_pairs_equal_trls_dpo_trainer_on_the_same_pairs(tmp_path):
    """TRL's DPOTrainer._compute_loss (its own collator, fused LM head and metrics) on transformers'
    Llama with our weights, the completions split as TRL splits them (the prompt rendered with the
    generation prompt by transformers' apply_chat_template), against our objective on our packed
    rows (two pairs to a row, the block-diagonal mask) with MiniMind's tokenizer and template."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    from data import tokenizer as tokenizers
    from data.chat import ChatOptions
    from data.dataset import PreferenceDataset
    from data.prepare import pack
    from model import MiniMindLM, ModelConfig
    from model.formats import hf_config, to_llama
    from objectives.dpo import DPO, DPOConfig

    lines = pairs(9, seed=3)
    bin_path, meta = pack(write(tmp_path / "p.jsonl", lines), 128, tmp_path / "cache", tokenizers.load(str(MINIMIND)),
                          chat=ChatOptions(kind="preference"))
    ds = PreferenceDataset(bin_path, 128, dtype=meta["dtype"])
    assert meta["pairs"] == 9 and ds.max_pairs >= 2
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=6400, seq_len=128)

    def models(seed: int):
        torch.manual_seed(seed)
        ours = MiniMindLM(cfg).eval()
        theirs = LlamaForCausalLM(LlamaConfig(**hf_config(cfg, 1, 2, 0)))
        theirs.load_state_dict(to_llama(ours.state_dict(), lm_head=True))
        return ours, theirs.eval()

    (policy, hf_policy), (reference, hf_reference) = models(0), models(1)
    objective = DPO(ds, 1, len(ds), DPOConfig(beta=0.1, precompute=False))
    objective.reference = reference
    objective.begin_step(list(range(len(ds))))
    batch = [torch.stack(t) for t in zip(*(ds[k] for k in range(len(ds))))]
    loss = objective.loss(policy, batch, torch.device("cpu"), 0)

    class One:
        def all_gather(self, x):
            return [x]

    ours = {"loss": loss.item(), **objective.step_metrics(One())}
    hf_tok = AutoTokenizer.from_pretrained(str(MINIMIND.parent))
    examples = []
    for p in lines:
        if "prompt" in p:
            prompt, c, r = [{"role": "user", "content": p["prompt"]}], [{"role": "assistant", "content": p["chosen"]}], \
                [{"role": "assistant", "content": p["rejected"]}]
        else:
            prompt, c, r = p["chosen"][:-1], p["chosen"][-1:], p["rejected"][-1:]
        ids = [hf_tok.apply_chat_template(m, add_generation_prompt=g, tokenize=True, return_dict=False)
               for m, g in ((prompt, True), (prompt + c, False), (prompt + r, False))]
        examples.append({"prompt_ids": ids[0], "chosen_ids": ids[1][len(ids[0]):], "rejected_ids": ids[2][len(ids[0]):]})
    args = TRLConfig(output_dir=str(tmp_path / "trl"), beta=0.1, report_to=[], per_device_train_batch_size=len(examples),
                     use_cpu=True, bf16=False)
    trainer = DPOTrainer(model=hf_policy, ref_model=hf_reference, args=args, processing_class=hf_tok,
                         train_dataset=Dataset.from_list([{"prompt": "hi", "chosen": " a", "rejected": " b"}]))
    trainer.model.train()
    theirs_loss = trainer._compute_loss(trainer.model, trainer.data_collator(examples), False)
    m = trainer._metrics["train"]
    theirs = {"loss": theirs_loss.item(), **{k: m[k][-1] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                                                     "rewards/margins")}}
    gaps = {k: abs(ours[k] - theirs[k]) for k in ours}
    print("ours", ours, "TRL", theirs, "gaps", gaps)
    # Packed rows against padded sequences round otherwise in fp32: measured at most 2.5e-07 (margins); 10x allowed.
    assert max(gaps.values()) <= 2.5e-6, gaps  # rewards/accuracies too: TRL's mean is fp32


@pytest.mark.e2e
@pytest.mark.parametrize("line, expected", [
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}]},
     ':1: expected an object with "chosen" and "rejected"'),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]}, ":1: chosen and rejected share no first turn"),
    ({"prompt": "x", "chosen": "same", "rejected": "same"}, ":1: chosen and rejected have identical completions"),
    ({"prompt": "x", "chosen": [{"role": "user", "content": "more?"}], "rejected": "b"}, ":1: the chosen completion begins with a user turn: it teaches no token"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "x"}]}, ":1: the rejected side has no turn after the prompt"),
])
def test_a_bad_pair_exits_2_naming_file_and_line_with_nothing_packed(tmp_path, prefs, line, expected):
    bad = write(tmp_path / "bad.jsonl", [line, *pairs(3)])
    code, err = launch.in_process(*base(bad, tmp_path / "cache"), f"out_dir={tmp_path / 'r'}")
    assert code == 2 and f"{bad}{expected}" in err and "Traceback" not in err, err
    assert not list((tmp_path / "cache").glob("*.bin"))


@pytest.mark.e2e
def test_a_reference_of_another_shape_or_tokenizer_is_refused_naming_it(reference_run, prefs, tmp_path, corpus):
    from conftest import train_in_process

    args = base(prefs, reference_run / "cache")
    wide = tmp_path / "wide"
    assert launch.in_process(*[a if not a.startswith("model.dim=") else "model.dim=64" for a in args], "train.steps=1",
                             f"out_dir={wide}")[0] == 0
    code, err = launch.in_process(*args, f"train.dpo.reference={wide}", f"out_dir={tmp_path / 'a'}")
    assert code == 2 and "shapes that differ from model.*" in err and "Traceback" not in err, err
    # the same shape, another tokenizer: a BPE of exactly 259 ids, as many as the byte tokenizer's
    assert train_in_process("--vocab-size", "259", "--out", str(tmp_path / "tok"), str(corpus)) == 0
    other = tmp_path / "other-tokenizer"
    code, err = launch.in_process(f"data.path={corpus}", f"data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}",
                                  f"data.cache_dir={tmp_path / 'c'}", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
                                  "model.n_kv_heads=2", "model.seq_len=96", "train.steps=1", "train.global_batch=2",
                                  "train.micro_batch=1", "log.progress=false", f"out_dir={other}")
    assert code == 0, err
    code, err = launch.in_process(*args, f"train.dpo.reference={other}", f"out_dir={tmp_path / 'b'}")
    assert code == 2 and f"train.dpo.reference: {other} was trained with another tokenizer" in err and "Traceback" not in err, err
    assert not (tmp_path / "b" / "checkpoints").exists()


@pytest.mark.unit
def test_segment_sums_are_the_taught_log_probabilities_of_each_side():
    from objectives.dpo import segment_logps

    logits = torch.randn(1, 6, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[-100, 1, 2, -100, 3, 4]])
    sides = torch.tensor([[1, 1, 1, 2, 2, 0]])
    got = segment_logps(logits, targets, sides, 2)
    lp = torch.log_softmax(logits, -1)[0]
    assert torch.allclose(got, torch.stack([lp[1, 1] + lp[2, 2], lp[4, 3]]).unsqueeze(0))  # position 5 is padding


@pytest.mark.e2e
def test_live_and_precomputed_references_give_the_same_bits_under_bfloat16_autocast(prefs, tmp_path):
    # The live reference runs inside the step's autocast; the table is computed under the same one.
    args = [*base(prefs, tmp_path / "cache"), "train.dtype=bfloat16", "train.steps=3"]
    for name, extra in (("pre", []), ("live", ["train.dpo.precompute=false"])):
        code, err = launch.in_process(*args, *extra, f"out_dir={tmp_path / name}")
        assert code == 0, err
    launch.assert_identical(tmp_path / "live", tmp_path / "pre")
    tables = [p for p in (tmp_path / "cache").rglob("*.ref-*") if p.is_dir()]
    assert len(tables) == 1 and "-ddp-bfloat16-" in tables[0].name, tables


@pytest.mark.e2e
def test_an_edited_preference_file_of_the_same_size_gets_a_new_table_and_the_stale_one_is_removed(prefs, tmp_path):
    edited = tmp_path / "dpo.jsonl"
    text = prefs.read_text()
    swapped = text.replace("red", "tmp").replace("sun", "red").replace("tmp", "sun")  # the same bytes' count, other rows
    assert len(swapped) == len(text) and swapped != text
    edited.write_text(text)
    args = [*base(edited, tmp_path / "cache"), "train.steps=2"]
    assert launch.in_process(*args, f"out_dir={tmp_path / 'a'}")[0] == 0
    first = sorted(p.name for p in (tmp_path / "cache").rglob("*.ref-*") if p.is_dir())
    edited.write_text(swapped)
    assert launch.in_process(*args, f"out_dir={tmp_path / 'b'}")[0] == 0
    second = sorted(p.name for p in (tmp_path / "cache").rglob("*.ref-*") if p.is_dir())
    assert len(first) == len(second) == 1 and first != second  # the old rows' table is gone, not reused
    assert launch.in_process(*args, "train.dpo.precompute=false", f"out_dir={tmp_path / 'live'}")[0] == 0
    launch.assert_identical(tmp_path / "b", tmp_path / "live")  # the edited rows' own reference figures


@pytest.mark.e2e
def test_the_precompute_computes_only_the_rows_the_run_reads_and_a_longer_run_adds_the_rest(prefs, tmp_path):
    cache = tmp_path / "cache"
    assert launch.in_process(*base(prefs, cache), "train.steps=2", f"out_dir={tmp_path / 'two'}")[0] == 0
    (table,) = (p for p in cache.rglob("*.ref-*") if p.is_dir())
    computed = lambda: len(rows_held(table))  # noqa: E731
    assert computed() == 2 * 12 < 48  # two steps of 12 distinct rows, of the epoch's
    code, err = launch.in_process(*base(prefs, cache), "train.steps=4", f"out_dir={tmp_path / 'four'}")
    assert code == 0, err
    assert 2 * 12 < computed() <= 4 * 12  # the rows of steps 3 and 4 that the first run did not read
    code, err = launch.in_process(*base(prefs, cache), "train.steps=4", "train.dpo.precompute=false", f"out_dir={tmp_path / 'live'}")
    assert code == 0, err
    launch.assert_identical(tmp_path / "four", tmp_path / "live")
