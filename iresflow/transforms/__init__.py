"""iresflow.transforms."""
