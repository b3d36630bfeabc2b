"""Settings of the tiny training runs shared by the tests of iresflow.train."""

#: One block of width 8 on a dozen sequences, one epoch on the CPU.
TINY = dict(
    n_blocks=1, hidden=8, max_train=12, max_eval=6, batch_size=6, epochs=1, device="cpu",
    scheduler="plateau", eval_method="exact",
)
