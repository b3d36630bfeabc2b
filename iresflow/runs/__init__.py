"""Using a finished run: load it, evaluate it, sample it, classify with it, draw it; one job per
module.

- :mod:`~iresflow.runs.settings`: the settings records of loading, evaluating, sampling and
  inspecting a run (the flags of ``iresflow evaluate``, ``sample`` and ``info``).
- :mod:`~iresflow.runs.load`: :func:`~iresflow.runs.load.load_run` (a run folder) and
  :func:`~iresflow.runs.load.trained_run` (a run just trained), with the re-checked guarantees.
- :mod:`~iresflow.runs.evaluate`: the NLL of a split, per-sequence scores, ``evaluation.json``.
- :mod:`~iresflow.runs.reference`: the closed-form AR(p) Gaussian beside the flow in every
  evaluation, and the warnings when the flow is worse.
- :mod:`~iresflow.runs.classify`: generative classification with a label-conditional flow.
- :mod:`~iresflow.runs.sample`: sequences drawn from a run, with their inversion report.
- :mod:`~iresflow.runs.plots`: the figures (drawing); :mod:`~iresflow.runs.figures`: the figures
  of a run.
- :mod:`~iresflow.runs.report`: what the commands print about a run.
- :mod:`~iresflow.runs.finish`: train, then evaluate and draw (``iresflow train``).

Training itself is :mod:`iresflow.train`; this package depends on it, never the other way.
"""
