"""iresflow.data."""
