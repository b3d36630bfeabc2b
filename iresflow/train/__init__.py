"""Training a run, one job per module (using a finished run is :mod:`iresflow.runs`).

- :mod:`~iresflow.train.config`: :class:`~iresflow.train.config.TrainConfig`, the settings of a
  run (its model settings are a :class:`~iresflow.models.config.ModelConfig`).
- :mod:`~iresflow.train.paths`: the run folder and its preparation.
- :mod:`~iresflow.train.factories`: the device, the data and the model of a configuration.
- :mod:`~iresflow.train.epoch`: the optimisation state, a training epoch, validation.
- :mod:`~iresflow.train.averaging`: the moving average of the weights.
- :mod:`~iresflow.train.likelihood`: what a trainable model is (``DensityModel``),
  log-densities of whole splits, the inverse check.
- :mod:`~iresflow.train.fit`: the epoch loop of every run, and :func:`~iresflow.train.fit.fit`,
  training in memory from Python (the benchmarks train every model with it).
- :mod:`~iresflow.train.loop`: :func:`~iresflow.train.loop.train`, the orchestration of a run.
- :mod:`~iresflow.train.metrics`: metrics tables, TensorBoard events, progress lines, scores.
- :mod:`~iresflow.train.checkpoint`: atomic, code-free checkpoint files.
- :mod:`~iresflow.train.distributed`: data-parallel processes and the one launcher of every
  command (``--nproc`` and ``torchrun``).
"""
