"""Reference density models for the results table (not part of the iresflow API).

Every model exposes ``log_prob(x, mask=None) -> (B,)`` and
``sample(num, seq_len=None, lengths=None) -> (num, N, D)``, the same calling convention as
``iresflow.models.transformer.ResidualFlowTransformer``, so one trainer and one evaluation
routine serve all of them.
"""
