"""iresflow.train."""
