"""Invertible residual flows on sequences."""
