"""Reference density models for the results table (not part of the iresflow API).

Every model exposes ``log_prob(x, mask=None) -> (B,)`` and
``sample(num, seq_len=None, lengths=None) -> (num, N, D)``, the same calling convention as
``iresflow.models.flow.SequenceFlow``, so the trainer of ``iresflow train``
(:func:`iresflow.train.fit.fit`) and its evaluation
(:func:`iresflow.train.likelihood.split_log_prob`) serve all of them. They receive the splits
of the public dataset API (:func:`iresflow.data.load_dataset`: floating-point ``(B, N, D)``
sequences with boolean ``(B, N)`` masks) and check only what it does not guarantee, such as the
fixed length a flattened-sequence model needs.
"""
