"""The packed dataset: sample index -> (input, target), read from a memmap, never loaded whole."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


class PackedDataset(Dataset):
    """Samples of `seq_len + 1` token ids (uint16 or uint32 in the file); `num_samples` > 0 keeps only the first N, and `start` skips
    the first samples (a held-out validation set is the tail of the file's first N)."""

    def __init__(self, bin_path: Path, seq_len: int, num_samples: int = 0, start: int = 0, dtype: str = "uint16") -> None:
        self.bin_path, self.row, self.start, self.dtype = Path(bin_path), seq_len + 1, start, np.dtype(dtype)
        available = self.bin_path.stat().st_size // (self.dtype.itemsize * self.row)
        if num_samples > available:
            from .prepare import DataError

            raise DataError(f"data.num_samples={num_samples}, but the corpus packs into only {available} samples of "
                            f"{seq_len + 1} tokens ({self.bin_path}); use at most {available}, or 0 for all")
        self.n = (num_samples or available) - start
        self._data: np.ndarray | None = None

    def _rows(self) -> np.ndarray:
        # Opened lazily so that DataLoader workers each map the file instead of pickling it.
        if self._data is None:
            self._data = np.memmap(self.bin_path, dtype=self.dtype, mode="r").reshape(-1, self.row)
        return self._data

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_data": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        row = torch.from_numpy(self._rows()[self.start + index].astype(np.int64))
        return row[:-1], row[1:]
