"""train.objective=orpo (objectives/orpo.py, docs/preference.md): TRL's ORPO loss refereed against TRL's own
functions on one micro-batch, and a run halted on 2 processes and resumed on 3 equal to the 1-process run."""
from __future__ import annotations

import types

import pytest
import torch

import launch
from test_dpo import base as dpo_base
from test_dpo import prefs  # noqa: F401  (the preference pairs: a fixture)

FIGURES = ("loss", "nll_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "log_odds_ratio",
           "log_odds_chosen")


def base(prefs, cache) -> list[str]:
    return [a.replace("train.objective=dpo", "train.objective=orpo").replace("train.dpo.beta=0.2", "train.orpo.beta=0.2")
            for a in dpo_base(prefs, cache)]


@pytest.mark.unit
def test_the_loss_on_one_micro_batch_is_trls_odds_ratio_loss_plus_its_chosen_nll():
    """Two packed rows holding three pairs; the same logits laid out as TRL's concatenated batch (a pair's side a
    sequence, its prompt and the other sides -100): TRL's get_batch_logps(average_log_prob=True), odds_ratio_loss
    and ORPO's chosen cross-entropy give the loss ours gives with one micro-batch of the whole batch, bit for bit."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    from objectives.orpo import ORPO, ORPOConfig

    torch.manual_seed(0)
    b, t, v = 2, 16, 11
    logits = torch.randn(b, t, v) * 3
    y = torch.randint(0, v, (b, t))
    side = torch.zeros(b, t, dtype=torch.long)
    spans = {(0, 1): (2, 5), (0, 2): (7, 10), (1, 1): (1, 4), (1, 2): (5, 9), (1, 3): (10, 12), (1, 4): (13, 15)}
    for (row, s), (lo, hi) in spans.items():
        side[row, lo:hi] = s
    y[side == 0] = -100
    net = lambda x, positions=None: (logits, None)  # noqa: E731  (the same logits whatever the ids)
    orpo = ORPO(types.SimpleNamespace(max_pairs=2, pairs=lambda indices: 3), 1, ORPOConfig(beta=0.2))
    orpo.begin_step([0, 1])
    orpo.prepare(None, [(None, y, None, side)], types.SimpleNamespace(world_size=1, rank=0, all_gather=lambda o: [o]), None)
    ours = orpo.loss(net, (torch.zeros(b, t, dtype=torch.long), y, torch.zeros(b, t, dtype=torch.long), side), "cpu")

    def trl_side(row: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A side as TRL's sequence: logits[:, :-1] predict labels[:, 1:]; only the side's targets taught."""
        lab = torch.full((t + 1,), -100)
        lab[1:] = torch.where(side[row] == s, y[row], -100)
        return torch.cat([logits[row], torch.zeros(1, v)]), lab

    pairs = [(0, 1), (1, 1), (1, 3)]  # (row, chosen side); rejected = chosen + 1
    chosen = [trl_side(r, s) for r, s in pairs]
    rejected = [trl_side(r, s + 1) for r, s in pairs]
    all_logits = torch.stack([lg for lg, _ in chosen + rejected])
    labels = torch.stack([lab for _, lab in chosen + rejected])
    logps = ORPOTrainer.get_batch_logps(all_logits, labels, average_log_prob=True)
    trainer = types.SimpleNamespace(beta=0.2, accelerator=types.SimpleNamespace(device="cpu"))
    losses = ORPOTrainer.odds_ratio_loss(trainer, logps[:3], logps[3:])[0]
    nll = torch.nn.CrossEntropyLoss()(all_logits[:3, :-1].reshape(-1, v), labels[:3, 1:].reshape(-1))  # TRL's chosen_nll_loss
    theirs = nll - losses.mean()
    assert float(ours) == float(theirs), (float(ours), float(theirs))  # measured: the same bits (4.106196403503418)


@pytest.fixture(scope="module")
def orpo_run(tmp_path_factory, prefs):  # noqa: F811
    root = tmp_path_factory.mktemp("orpo-runs")
    code, err = launch.in_process(*base(prefs, root / "cache"), f"out_dir={root / 'one'}")
    assert code == 0, err
    return root


@pytest.mark.e2e
def test_orpo_halted_on_2_processes_and_resumed_on_3_equals_the_one_process_run(orpo_run, prefs, tmp_path):  # noqa: F811
    args = [*base(prefs, tmp_path / "cache"), f"out_dir={tmp_path / 'moved'}"]
    launch.run(2, *args, "train.halt_at=3")
    launch.run(3, *args)
    launch.assert_identical(tmp_path / "moved", orpo_run / "one")
    got, want = launch.metrics(tmp_path / "moved"), launch.metrics(orpo_run / "one")
    for key in FIGURES:
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert want[-1]["loss"] < want[0]["loss"] and want[-1]["rewards/margins"] != want[0]["rewards/margins"]
    assert "reference" not in launch.storage_manifest(orpo_run / "one", 6) or not launch.storage_manifest(orpo_run / "one", 6)["reference"]
