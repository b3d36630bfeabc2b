"""Offline sequence datasets, user-file loaders and their preprocessing."""

from iresflow.data.datasets import available_datasets, load_dataset
from iresflow.data.splits import SequenceDataset, SequenceSplit

__all__ = ["SequenceDataset", "SequenceSplit", "available_datasets", "load_dataset"]
