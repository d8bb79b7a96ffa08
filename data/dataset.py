"""The packed dataset: sample index -> (input, target), read from a memmap, never loaded whole."""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from .chunked import Lazy, mapped
from .sources import DataError


def counts_path(bin_path: Path) -> Path:
    """The packed file's token counts (a .npy of uint64, one per id), written before its fingerprint."""
    return bin_path.with_name(bin_path.stem + ".counts.npy")


def taught_path(bin_path: Path) -> Path:
    """A packed chat file's taught-token count per row (a .npy of uint32), written before its fingerprint."""
    return bin_path.with_name(bin_path.stem + ".taught.npy")


def pairs_path(bin_path: Path) -> Path:
    """A packed preference file's pair count per row (a .npy of uint32), written before its fingerprint."""
    return bin_path.with_name(bin_path.stem + ".pairs.npy")


def lengths_path(bin_path: Path) -> Path:
    """A packed prompt file's prompt lengths (a .npy of uint32), written before its fingerprint."""
    return bin_path.with_name(bin_path.stem + ".lengths.npy")


class PackedDataset(Dataset):
    """Samples of `seq_len + 1` token ids (uint16 or uint32 in the file); `num_samples` > 0 keeps only the first N, and `start` skips
    the first samples (a held-out validation set is the tail of the file's first N)."""

    ROW_PLANES = None  # a row is seq_len + 1 ids

    def __init__(self, bin_path: Path, seq_len: int, num_samples: int = 0, start: int = 0, dtype: str = "uint16") -> None:
        self.bin_path, self.start, self.dtype, self.seq_len = Path(bin_path), start, np.dtype(dtype), seq_len
        self.row = seq_len + 1 if self.ROW_PLANES is None else self.ROW_PLANES * seq_len
        available = self.bin_path.stat().st_size // (self.dtype.itemsize * self.row)
        if num_samples > available:
            raise DataError(f"data.num_samples={num_samples}, but the corpus packs into only {available} samples of "
                            f"{seq_len + 1} tokens ({self.bin_path}); use at most {available}, or 0 for all")
        self.n = (num_samples or available) - start
        self._data: np.ndarray | None = None
        self._lazy: Lazy | None = None

    def _rows(self) -> np.ndarray:
        # Opened lazily so that DataLoader workers each map the file instead of pickling it.
        if self._data is None:
            self._lazy, rows = mapped(self.bin_path)  # a cache in the store's staging copy: read a chunk at a time
            # Samples are read at random places: without this, each page fault reads the disk's whole
            # read-ahead window around it (8 MiB here), hundreds of times what a sample needs.
            rows.madvise(mmap.MADV_RANDOM)
            self._data = np.frombuffer(rows, dtype=self.dtype).reshape(-1, self.row)
        return self._data

    def _row(self, index: int) -> np.ndarray:
        """Row `index` as stored (its chunks fetched and verified first, for a cache in the store)."""
        rows = self._rows()
        if self._lazy is not None:
            size = self.row * self.dtype.itemsize
            self._lazy.ensure((self.start + index) * size, size)
        return rows[self.start + index]

    def __getitems__(self, indices: list[int]) -> list:
        """A micro-batch's samples (the DataLoader's batched fetch): for a cache in the store, the chunks
        its rows need are fetched at once first."""
        self._rows()
        if self._lazy is not None:
            size = self.row * self.dtype.itemsize
            self._lazy.ensure_many([((self.start + i) * size, size) for i in indices if 0 <= i < self.n])
        return [self[i] for i in indices]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_data": None, "_lazy": None}

    def states(self, train_state) -> dict:
        """The dataset's own resume state: none, its position is the train state's (a mix's is its counts: data/mix.py)."""
        return {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        row = torch.from_numpy(self._row(index).astype(np.int64))
        return row[:-1], row[1:]


class ChatDataset(PackedDataset):
    """Rows of packed conversations (data/chat.py): (input ids, targets with -100 where nothing is
    taught, positions restarting at 0 for each conversation), each of seq_len; the file stores
    them as three planes, targets + 1 (0: not taught). `taught(indices)` counts the taught tokens of
    those rows from the count packing wrote beside the file, without reading the rows."""

    ROW_PLANES = 3
    chat = True

    def __init__(self, bin_path: Path, seq_len: int, num_samples: int = 0, start: int = 0, dtype: str = "uint16") -> None:
        super().__init__(bin_path, seq_len, num_samples, start, dtype)
        self._taught = np.load(taught_path(self.bin_path), mmap_mode="r", allow_pickle=False)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_taught": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._taught = np.load(taught_path(self.bin_path), mmap_mode="r", allow_pickle=False)

    def taught(self, indices: list[int]) -> int:
        return int(self._taught[np.asarray(indices, dtype=np.int64) + self.start].sum(dtype=np.int64))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        x, y, pos = torch.from_numpy(self._row(index).astype(np.int64)).view(3, self.seq_len)
        return x, y - 1 - 99 * (y == 0), pos  # stored + 1, 0 for "not taught": back to -100


class PreferenceDataset(ChatDataset):
    """Rows of packed preference pairs (data/preference.py): (input ids, targets with -100 where
    nothing is taught, positions, sides: 2k + 1 the k-th pair's chosen side, 2k + 2 its rejected,
    0 padding), each of seq_len. `pairs(indices)` counts the pairs of those rows from the count
    packing wrote beside the file; `max_pairs` is the most any row holds."""

    ROW_PLANES = 4

    def __init__(self, bin_path: Path, seq_len: int, num_samples: int = 0, start: int = 0, dtype: str = "uint16") -> None:
        PackedDataset.__init__(self, bin_path, seq_len, num_samples, start, dtype)
        self._taught = np.load(pairs_path(self.bin_path), mmap_mode="r", allow_pickle=False)
        self.max_pairs = int(self._taught.max()) if len(self._taught) else 0

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._taught = np.load(pairs_path(self.bin_path), mmap_mode="r", allow_pickle=False)

    def pairs(self, indices: list[int]) -> int:
        return self.taught(indices)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        x, y, pos, side = torch.from_numpy(self._row(index).astype(np.int64)).view(4, self.seq_len)
        return x, y - 1 - 99 * (y == 0), pos, side


class PromptDataset(PackedDataset):
    """Prompts for reinforcement learning (data/prompts.py): row i is (its ids padded to seq_len,
    its length, i); `fields(i)` is the line's fields (the reward functions' keywords)."""

    ROW_PLANES = 1

    def __init__(self, bin_path: Path, seq_len: int, num_samples: int = 0, start: int = 0, dtype: str = "uint16") -> None:
        super().__init__(bin_path, seq_len, num_samples, start, dtype)
        self._lengths = np.load(lengths_path(self.bin_path), mmap_mode="r", allow_pickle=False)
        self._fields: list[dict] | None = None

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_lengths": None, "_fields": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lengths = np.load(lengths_path(self.bin_path), mmap_mode="r", allow_pickle=False)

    def fields(self, index: int) -> dict:
        if self._fields is None:
            import json

            with open(self.bin_path.with_name(self.bin_path.stem + ".fields.jsonl"), encoding="utf-8") as f:
                self._fields = [json.loads(line) for line in f]
        return self._fields[self.start + index]

    def longest(self) -> tuple[int, int]:
        """(the longest prompt's length, its index)."""
        lengths = np.asarray(self._lengths[self.start: self.start + self.n])
        k = int(lengths.argmax())
        return int(lengths[k]), k

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        row = torch.from_numpy(self._row(index).astype(np.int64))
        return row, int(self._lengths[self.start + index]), index
