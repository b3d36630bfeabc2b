"""Offline sequence datasets, user-file loaders and their preprocessing."""

from iresflow.data.datasets import SequenceDataset, SequenceSplit, available_datasets, load_dataset

__all__ = ["SequenceDataset", "SequenceSplit", "available_datasets", "load_dataset"]
