"""Reading samples: one split of one ``.bin/.idx`` pair (``GPTSamples``) and blends of them.

``GPTSamples[i]`` is megatron-core's ``GPTDataset[i]`` as numpy arrays: the S+1 tokens that
sample ``shuffle_index[i]`` covers, split into ``tokens``/``labels``, with the loss mask and
position ids of ``_get_ltor_masks_and_position_ids`` (and its attention mask, True = masked,
when ``reset_attention_mask`` is on), computed without a loop over the EOD positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mega.plugins.datasets.indexed import IndexedDataset

NO_PAD = -1  # megatron_dataset._PAD_TOKEN_ID: a value no token has


def pad_token_id(tokenizer: Any) -> int:
    """The pad id Megatron masks out of the loss: the tokenizer's, unless it is special too.

    As ``MegatronDataset.__init__``: a missing pad, or a pad equal to another special token (from
    ``special_tokens_dict``, else eos and eod), becomes -1, which never matches a token.
    """
    pad = getattr(tokenizer, "pad", None)
    if pad is None:
        return NO_PAD
    try:
        specials = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        specials = []
    if not specials:
        specials = [getattr(tokenizer, name, None) for name in ("eos", "eod")]
    return NO_PAD if pad in specials else int(pad)


@dataclass(frozen=True)
class SampleOptions:
    """What shapes a sample besides the indices (none of it is in the cache key)."""

    seq_length: int
    eod: int | None
    pad: int = NO_PAD
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    add_extra_token: int = 1


def masks_and_position_ids(tokens: np.ndarray, options: SampleOptions) -> dict[str, np.ndarray]:
    """loss_mask, position_ids (and attention_mask) as Megatron's left-to-right helper makes them."""
    length = len(tokens)
    positions = np.arange(length, dtype=np.int64)
    loss_mask = np.ones(length, dtype=np.float32)
    is_eod = tokens == options.eod if options.eod is not None else np.zeros(length, dtype=bool)
    if options.eod_mask_loss:
        loss_mask[is_eod] = 0.0
    out = {"loss_mask": loss_mask, "position_ids": positions}
    if options.reset_position_ids or options.reset_attention_mask:
        # Each position's document starts right after the last EOD before it (or at 0).
        after_eod = np.where(is_eod, positions + 1, 0)
        segment_start = np.zeros(length, dtype=np.int64)
        if length > 1:
            segment_start[1:] = np.maximum.accumulate(after_eod[:-1])
        if options.reset_position_ids:
            out["position_ids"] = positions - segment_start
        if options.reset_attention_mask:
            keys = positions[None, :]
            visible = (keys <= positions[:, None]) & (keys >= segment_start[:, None])
            out["attention_mask"] = ~visible[None, :, :]
    return out


class GPTSamples:
    """One split of one prefix: ``len`` samples of ``seq_length`` tokens (map-style)."""

    def __init__(
        self,
        dataset: IndexedDataset,
        document_index: np.ndarray,
        sample_index: np.ndarray,
        shuffle_index: np.ndarray,
        options: SampleOptions,
        name: str = "gpt",
    ) -> None:
        self.dataset = dataset
        self.document_index = document_index
        self.sample_index = sample_index
        self.shuffle_index = shuffle_index
        self.options = options
        self.name = name

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def text(self, index: int) -> np.ndarray:
        """The S+X token ids of sample ``index`` (int64; padded with the pad id if short)."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name} sample {index} out of range [0, {len(self)})")
        extra = self.options.add_extra_token
        j = int(self.shuffle_index[index])
        first, first_offset = (int(v) for v in self.sample_index[j])
        last, last_offset = (int(v) for v in self.sample_index[j + 1])
        docs = self.document_index
        if first == last:
            parts = [
                self.dataset.get(int(docs[first]), first_offset, last_offset - first_offset + extra)
            ]
        else:
            parts = [self.dataset.get(int(docs[first]), first_offset)]
            parts += [self.dataset.get(int(docs[k])) for k in range(first + 1, last)]
            parts.append(self.dataset.get(int(docs[last]), 0, last_offset + extra))
        text = np.concatenate(parts).astype(np.int64, copy=False)
        wanted = self.options.seq_length + extra
        if len(text) < wanted:
            text = np.concatenate((text, np.full(wanted - len(text), self.options.pad, np.int64)))
        return text

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        text = self.text(index)
        tokens, labels = text[:-1].copy(), text[1:].copy()
        sample = {"tokens": tokens, "labels": labels}
        sample.update(masks_and_position_ids(tokens, self.options))
        pad = self.options.pad  # padding: no loss, and an id the embedding can look up
        sample["loss_mask"][labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
        return sample


class BlendedSamples:
    """Megatron's BlendedDataset: sample i is sample ``dataset_sample_index[i]`` of dataset
    ``dataset_index[i]``."""

    def __init__(
        self,
        datasets: list[GPTSamples],
        dataset_index: np.ndarray,
        dataset_sample_index: np.ndarray,
        name: str = "blend",
    ) -> None:
        self.datasets = datasets
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset_index)

    def source(self, index: int) -> tuple[int, int]:
        """(dataset number, sample number within it) of blended sample ``index``."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name} sample {index} out of range [0, {len(self)})")
        return int(self.dataset_index[index]), int(self.dataset_sample_index[index])

    def text(self, index: int) -> np.ndarray:
        dataset, sample = self.source(index)
        return self.datasets[dataset].text(sample)

    def __getitem__(self, index: int) -> dict[str, Any]:
        dataset, sample = self.source(index)
        return self.datasets[dataset][sample]
