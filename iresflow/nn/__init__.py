"""iresflow.nn."""
