"""iresflow.inverse."""
