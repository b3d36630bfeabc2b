"""iresflow.logdet."""
