"""A resume at another model.seq_len (data.resume_seq_len=repack): the epoch's unread tokens repacked
at the new length, a new phase (docs/data.md "Another seq_len on a resume").

A text corpus is one token stream (data/prepare.py: documents end to end) cut into rows of
seq_len + 1, so a row is a span of stream positions at any length. At a resume in epoch E after P
samples of its order at the old length L, the phase is: the training rows at L that the order had not
reached (positions P.. of `make_order(data.order, N_L, seed, E)`), as stream spans, adjacent ones
merged, clipped to the training rows at the new length L' (what lies past them is validation or the
packer's tail at L'); laid end to end and cut into rows of L' + 1 (the last partial row dropped, as
the packer drops its tail); read in epoch E's order of that count, `make_order(data.order, N_rem,
seed, E)`. Epoch E + 1 on reads the corpus packed at L'. The run's position in epoch E is then in
rows of the remainder; the phase is written into every later manifest (its data fingerprint's
`repacked`), so a later resume, on any world size, reads the same remainder. A second change of
seq_len inside the remainder is refused (the phase would be a remainder of a remainder)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from . import chunked
from .chunked import Lazy
from .sampler import make_order
from .sources import DataError


def remaining_spans(num_samples: int, seq_len: int, consumed: list[int], end: int) -> np.ndarray:
    """The stream spans [start, stop) of rows 0..num_samples-1 (of seq_len + 1 tokens) not in `consumed`,
    adjacent rows merged, clipped to [0, end): an (n, 2) int64 array in stream order."""
    row = seq_len + 1
    unread = np.ones(num_samples, dtype=bool)
    unread[np.asarray(consumed, dtype=np.int64)] = False
    rows = np.flatnonzero(unread)
    if not len(rows):
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # where a run of adjacent rows ends
    firsts, lasts = rows[np.r_[0, breaks]], rows[np.r_[breaks - 1, len(rows) - 1]]
    spans = np.stack([firsts * row, (lasts + 1) * row], axis=1).astype(np.int64)
    spans[:, 1] = np.minimum(spans[:, 1], end)
    return spans[spans[:, 0] < spans[:, 1]]


class Repacked(Dataset):
    """Rows of seq_len + 1 tokens cut from `spans` of the packed file's stream laid end to end: the
    epoch's remainder at the new length. (input, target) as PackedDataset's."""

    def __init__(self, bin_path: Path, seq_len: int, spans: np.ndarray, dtype: np.dtype) -> None:
        self.bin_path, self.seq_len, self.dtype, self.start = Path(bin_path), seq_len, np.dtype(dtype), 0
        self.spans, self.row = spans, seq_len + 1
        self.cum = np.r_[0, np.cumsum(spans[:, 1] - spans[:, 0])].astype(np.int64)  # each span's start in the remainder
        self.n = int(self.cum[-1]) // self.row
        self._flat: np.ndarray | None = None
        self._lazy: Lazy | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_flat": None, "_lazy": None}

    def states(self, train_state) -> dict:
        return {}

    def __len__(self) -> int:
        return self.n

    def tokens(self, index: int) -> np.ndarray:
        """Row `index`: its seq_len + 1 token ids, read span by span."""
        if not 0 <= index < self.n:
            raise IndexError(index)
        if self._flat is None:
            self._lazy, rows = chunked.mapped(self.bin_path)  # a cache in the store's staging copy: read a chunk at a time
            self._flat = np.frombuffer(rows, dtype=self.dtype)
        lo, hi = index * self.row, (index + 1) * self.row
        k, parts = int(np.searchsorted(self.cum, lo, side="right")) - 1, []
        while lo < hi:
            first = int(self.spans[k, 0]) + lo - int(self.cum[k])
            n = min(hi - lo, int(self.cum[k + 1]) - lo)
            if self._lazy is not None:
                self._lazy.ensure(first * self.dtype.itemsize, n * self.dtype.itemsize)
            parts.append(self._flat[first:first + n])
            lo, k = lo + n, k + 1
        return np.concatenate(parts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = torch.from_numpy(self.tokens(index).astype(np.int64))
        return row[:-1], row[1:]


def phase(saved: dict | None, fingerprint: dict, train_state, global_batch: int, order: str, seed: int) -> tuple[dict | None, str | None]:
    """The repack phase a resumed run is in, and the line that says a new one begins (None: carried or
    none). `saved` is the checkpoint's data fingerprint, `fingerprint` this run's (the phase is written
    into it, so every later manifest carries it). A new phase sets the train state's position to the
    remainder's start (or past the epoch, when the old length had read it all)."""
    if not saved:
        return None, None
    if saved.get("seq_len") == fingerprint["seq_len"]:
        carried = saved.get("repacked")
        if carried:
            fingerprint["repacked"] = carried
        return carried, None
    old = saved.get("repacked")
    epoch, seen = train_state.epoch, train_state.samples_seen
    if old and old["epoch"] == epoch and seen // global_batch < old["samples"] // global_batch:
        raise DataError(f"data.resume_seq_len=repack: epoch {epoch} already reads a remainder repacked from seq_len "
                        f"{old['from_seq_len']} at step {old['step']}; another seq_len inside it is not supported: resume at "
                        f"model.seq_len={saved['seq_len']} until the epoch ends (step "
                        f"{train_state.step + old['samples'] // global_batch - seen // global_batch})")
    n_old, l_old, l_new = int(saved["num_samples"]), int(saved["seq_len"]), int(fingerprint["seq_len"])
    if old and old["epoch"] == epoch:  # the remainder read to its end: nothing of the epoch is left
        n_old = seen = 0
    done, reads = seen // global_batch * global_batch, n_old // global_batch * global_batch  # its tail fills no batch
    record = {"epoch": epoch, "step": train_state.step, "from_seq_len": l_old, "from_samples": n_old, "consumed": done,
              "reads": reads, "samples": 0}
    spans = _unread(record, order, seed, fingerprint["num_samples"] * (l_new + 1))
    record["samples"] = int(spans[:, 1].sum() - spans[:, 0].sum()) // (l_new + 1)
    fingerprint["repacked"] = record
    train_state.samples_seen = 0
    return record, (f"data.resume_seq_len=repack: a new phase from step {train_state.step}: seq_len {l_old} -> {l_new}; "
                    f"epoch {epoch}'s {reads - done} unread samples of {l_old + 1} tokens repacked into {record['samples']} of "
                    f"{l_new + 1}; the corpus at seq_len {l_new} from epoch {epoch + 1} on")


def _unread(record: dict, order: str, seed: int, end: int) -> np.ndarray:
    """The stream spans of the rows the epoch would still have read at the old length: positions
    consumed..reads of its order (past `reads`, the tail that fills no global batch, which the epoch
    never reads), clipped to [0, end)."""
    n_old = record["from_samples"]
    if not n_old:
        return np.zeros((0, 2), dtype=np.int64)
    positions, reads = make_order(order, n_old, seed, record["epoch"]), record.get("reads", n_old)
    skipped = positions.take(0, record["consumed"]) + positions.take(reads, n_old - reads)
    return remaining_spans(n_old, record["from_seq_len"], skipped, end)


def remainder(dataset, record: dict, order: str, seed: int) -> Repacked:
    """The phase's remainder over `dataset` (the corpus at the new length), computed again from the record."""
    rem = Repacked(dataset.bin_path, dataset.seq_len, _unread(record, order, seed, len(dataset) * (dataset.seq_len + 1)), dataset.dtype)
    if len(rem) != record["samples"]:
        raise DataError(f"data.resume_seq_len=repack: the remainder of epoch {record['epoch']} has {len(rem)} samples now, "
                        f"{record['samples']} when the phase began at step {record['step']}: the corpus changed")
    return rem
