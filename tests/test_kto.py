"""train.objective=kto over data.format=unpaired (data/formats/unpaired.py, objectives/kto.py, docs/preference.md):
TRL's KTO loss refereed against TRL's own KTOTrainer._compute_loss on one micro-batch, bad lines named, and a run
halted on 2 processes and resumed on 3 equal to the 1-process run (its KL term over the global batch)."""
from __future__ import annotations

import random
import types
from pathlib import Path

import pytest
import torch

import launch
from test_dpo import WORDS, write

FIGURES = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def examples(n: int = 48, seed: int = 0) -> list[dict]:
    """Short unpaired examples in both forms (messages, strings), about half desirable."""
    rnd = random.Random(seed)
    out = []
    for k in range(n):
        a, b = rnd.sample(WORDS, 2)
        good = rnd.random() < 0.5
        answer = f"{a}." if good else f"{b} {b}."
        if k % 4 == 3:
            out.append({"prompt": f"Say {a}.", "completion": answer, "label": good})
            continue
        head = [{"role": "system", "content": "Be brief."}] if k % 3 == 0 else []
        out.append({"prompt": [*head, {"role": "user", "content": f"Say {a}."}],
                    "completion": [{"role": "assistant", "content": answer}], "label": good})
    return out


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("kto") / "kto.jsonl", examples())


def base(data: Path, cache: Path) -> list[str]:
    return [f"data.path={data}", "data.format=unpaired", "train.objective=kto", f"data.cache_dir={cache}",
            "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=128",
            "train.global_batch=12", "train.micro_batch=1", "train.steps=6", "train.warmup_steps=1", "train.lr=3e-3",
            "train.kto.beta=0.2", "train.kto.desirable_weight=2.0", "dist.reduce=canonical", "checkpoint.interval=0",
            "checkpoint.keep=10", "log.progress=false", "runtime.threads=1"]


@pytest.fixture(scope="module")
def kto_run(tmp_path_factory, unpaired):
    root = tmp_path_factory.mktemp("kto-runs")
    code, err = launch.in_process(*base(unpaired, root / "cache"), f"out_dir={root / 'one'}")
    assert code == 0, err
    return root


@pytest.mark.e2e
def test_kto_trains_from_its_reference_and_logs_trls_figures(kto_run):
    rows = launch.metrics(kto_run / "one")
    assert rows[0]["kl"] == 0.0 and rows[0]["rewards/chosen"] == 0.0 == rows[0]["rewards/rejected"]  # the policy is its reference
    assert set(FIGURES) <= set(rows[-1]), rows[-1]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["rewards/margins"] > 0, rows


def synthetic(seed: int = 0, rows: int = 3, t: int = 16, v: int = 11):
    """Three packed rows holding five examples (row 0: two, row 1: one, row 2: two), each with its KL sequence, random
    logits per row, and reference sums that put every example's KL term above zero by a different amount."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, t, v, generator=g) * 3
    y = torch.randint(0, v, (rows, t), generator=g)
    side, label = torch.zeros(rows, t, dtype=torch.long), torch.zeros(rows, t, dtype=torch.long)
    spans = {(0, 1): (1, 4), (0, 2): (4, 7), (0, 3): (8, 11), (0, 4): (11, 15), (1, 1): (0, 6), (1, 2): (6, 12),
             (2, 1): (2, 5), (2, 2): (5, 8), (2, 3): (9, 12), (2, 4): (12, 16)}
    labels = {(0, 0): 1, (0, 1): 2, (1, 0): 2, (2, 0): 1, (2, 1): 2}
    for (row, s), (lo, hi) in spans.items():
        side[row, lo:hi], label[row, lo:hi] = s, labels[(row, (s - 1) // 2)]
    y[side == 0] = -100
    x = torch.arange(rows).unsqueeze(1).expand(rows, t).clone()  # row r's ids all r: the stand-in net knows its row
    from objectives.dpo import segment_logps

    policy = segment_logps(logits, y, side, 4)
    ref = policy - torch.rand(rows, 4, generator=g) * 4  # the policy's sums above the reference's: KL > 0
    ref[:, 0::2] = policy[:, 0::2] + torch.randn(rows, 2, generator=g)
    return logits, (x, y, torch.zeros(rows, t, dtype=torch.long), side, label), ref, spans, labels


def ours(cfg, logits, batch, ref, micro_batch: int):
    """Our loss of the step (the reducers' mean over its micro-batches) and the KTO object, one rank."""
    from objectives.kto import KTO

    rows = len(batch[0])
    net = lambda x, positions=None: (logits[x[:, 0]], None)  # noqa: E731
    kto = KTO(types.SimpleNamespace(max_pairs=2, pairs=lambda idx: 5, start=0), rows // micro_batch, micro_batch, cfg)
    kto.table = ref.numpy()
    kto.begin_step(list(range(rows)))
    micro = [tuple(p[j:j + micro_batch] for p in batch) for j in range(0, rows, micro_batch)]
    kto.prepare(net, micro, types.SimpleNamespace(world_size=1, rank=0, all_gather=lambda o: [o], device="cpu"), None)
    losses = [kto.loss(net, m, "cpu", i) for i, m in enumerate(micro)]
    return sum(losses) / len(losses), kto


@pytest.mark.unit
def test_the_loss_on_one_micro_batch_is_trls_kto_compute_loss():
    """The same per-token log-probabilities laid out as TRL's KTO batch (each example a sequence with its completion
    mask, its KL sequence under KL_*, the reference's sums as TRL's precomputed ref_logps and ref_KL_logps): TRL's own
    KTOTrainer._compute_loss, with its KL estimate, weights and mean, gives our loss with one micro-batch of the batch."""
    from collections import defaultdict

    from trl.trainer.kto_trainer import KTOTrainer

    from objectives.kto import KTOConfig

    cfg = KTOConfig(beta=0.3, desirable_weight=1.0, undesirable_weight=1.7)
    logits, batch, ref, spans, labels = synthetic()
    mine, kto = ours(cfg, logits, batch, ref, micro_batch=3)
    y, t = batch[1], batch[1].shape[1]
    examples = sorted(labels)  # (row, k) in row order: TRL's batch
    store = {}

    def sequence(code: int, row: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A side as TRL's sequence of t + 1 ids (all `code`): logits[:, :-1] predict [1:]; only the side's targets taught."""
        store[code] = (logits[row], torch.where(batch[3][row] == s, y[row], -100))
        mask = torch.zeros(t + 1, dtype=torch.long)
        mask[1:] = (store[code][1] != -100).long()
        return torch.full((t + 1,), code), mask

    seqs = [sequence(n, r, 2 * k + 1) for n, (r, k) in enumerate(examples)]
    kls = [sequence(100 + n, r, 2 * k + 2) for n, (r, k) in enumerate(examples)]

    def model(input_ids, attention_mask=None, labels=None, use_cache=None, fused_lm_head=None):
        """TRL's fused head's outputs: per-token log-probabilities of the labels, zero where the label is -100."""
        rows = []
        for ids, lab in zip(input_ids, labels):
            lg, target = store[int(ids[0])]
            lp = torch.log_softmax(lg.float(), -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            rows.append(torch.where(lab[1:] != -100, lp, 0.0))
        lp = torch.stack(rows)
        return types.SimpleNamespace(log_probs=lp, entropy=torch.zeros_like(lp), mean_logits=torch.zeros_like(lp))

    trl_batch = {
        "input_ids": torch.stack([s for s, _ in seqs]), "attention_mask": torch.ones(len(seqs), t + 1, dtype=torch.long),
        "completion_mask": torch.stack([m for _, m in seqs]),
        "KL_input_ids": torch.stack([s for s, _ in kls]), "KL_attention_mask": torch.ones(len(kls), t + 1, dtype=torch.long),
        "KL_completion_mask": torch.stack([m for _, m in kls]),
        "label": torch.tensor([labels[e] == 1 for e in examples]),
        "ref_logps": torch.stack([ref[r, 2 * k] for r, k in examples]), "ref_KL_logps": torch.stack([ref[r, 2 * k + 1] for r, k in examples]),
    }
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x),
        calculate_KL=True, precompute_ref_logps=True, loss_type="kto", beta=cfg.beta, desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
    theirs = KTOTrainer._compute_loss(trainer, model, trl_batch, return_outputs=False)
    assert trainer._metrics["train"]["kl"][0] > 0  # the KL term is in play, not clamped to zero
    # measured: the same bits, KL 1.6371395587921143 and loss 0.6372568607330322 both
    assert float(kto.kl) == trainer._metrics["train"]["kl"][0], (float(kto.kl), trainer._metrics)
    assert float(mine) == float(theirs), (float(mine), float(theirs))


@pytest.mark.unit
def test_the_kl_term_and_the_mean_are_the_global_batchs_whatever_the_micro_batch():
    """The step's loss with one micro-batch of three rows equals its loss with three micro-batches of one (the KL
    term differs per row: a KL over the micro-batch would not)."""
    from objectives.kto import KTOConfig

    cfg = KTOConfig(beta=0.3, undesirable_weight=1.7)
    logits, batch, ref, _, _ = synthetic(seed=1)
    whole, a = ours(cfg, logits, batch, ref, micro_batch=3)
    split, b = ours(cfg, logits, batch, ref, micro_batch=1)
    assert float(a.kl) == float(b.kl) > 0
    assert abs(float(whole) - float(split)) <= 1e-6 * abs(float(whole)), (float(whole), float(split))


@pytest.mark.unit
@pytest.mark.parametrize("line, message", [
    ('{"prompt": "Hi.", "completion": "Hi."}', ':2: expected an object with "prompt", "completion" and "label"'),
    ('{"prompt": "Hi.", "completion": "Hi.", "label": 1}', ":2: label must be true (desirable) or false (undesirable), got 1"),
    ('{"prompt": "Hi.", "completion": [], "label": true}', ":2: completion must be a non-empty list of messages (or a string)"),
    ('{"prompt": "Hi.", "completion": [{"role": "user", "content": "x"}], "label": true}', ":2: the completion begins with a user turn"),
])
def test_a_bad_unpaired_line_exits_2_naming_file_line_and_key(tmp_path, line, message, capsys):
    from data.prepare import main

    data = tmp_path / "kto.jsonl"
    data.write_text('{"prompt": "Say red.", "completion": "red.", "label": true}\n' + line + "\n")
    code = main([str(data), "--format", "unpaired", "--seq-len", "64", "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 2 and f"{data}{message}" in err and "Traceback" not in err, err
    assert not list((tmp_path / "cache").glob("*.bin"))


@pytest.mark.e2e
def test_kto_halted_on_2_processes_and_resumed_on_3_equals_the_one_process_run(kto_run, unpaired, tmp_path):
    args = [*base(unpaired, tmp_path / "cache"), f"out_dir={tmp_path / 'moved'}"]
    launch.run(2, *args, "train.halt_at=3")
    launch.run(3, *args)
    launch.assert_identical(tmp_path / "moved", kto_run / "one")
    got, want = launch.metrics(tmp_path / "moved"), launch.metrics(kto_run / "one")
    for key in FIGURES:
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
    assert any(r["kl"] > 0 for r in want), [r["kl"] for r in want]  # the global KL term is in play


@pytest.mark.e2e
def test_the_live_reference_and_the_precomputed_one_give_the_same_bits(kto_run, unpaired, tmp_path):
    code, err = launch.in_process(*base(unpaired, kto_run / "cache"), "train.kto.precompute=false", f"out_dir={tmp_path / 'live'}")
    assert code == 0, err
    launch.assert_identical(tmp_path / "live", kto_run / "one")
    got, want = launch.metrics(tmp_path / "live"), launch.metrics(kto_run / "one")
    for key in FIGURES:
        assert [r.get(key) for r in got] == [r.get(key) for r in want], key
