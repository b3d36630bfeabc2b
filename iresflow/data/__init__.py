"""Offline sequence datasets, user-file loaders (tables too) and their preprocessing."""

from iresflow.data.datasets import available_datasets, load_dataset
from iresflow.data.splits import SequenceDataset, SequenceSplit
from iresflow.data.tables import TableLayout, read_table

__all__ = ["SequenceDataset", "SequenceSplit", "TableLayout", "available_datasets", "load_dataset",
           "read_table"]
