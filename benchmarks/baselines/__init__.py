"""Reference density models for the results table (not part of the iresflow API).

Every model exposes ``log_prob(x, mask=None) -> (B,)`` and
``sample(num, seq_len=None, lengths=None) -> (num, N, D)``, the same calling convention as
``iresflow.models.flow.SequenceFlow``, so the trainer of ``iresflow train``
(:func:`iresflow.train.fit.fit`) and its evaluation
(:func:`iresflow.train.likelihood.split_log_prob`) serve all of them.
"""
