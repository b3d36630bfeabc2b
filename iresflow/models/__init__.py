"""iresflow.models."""
