"""The full-scale check: every rank's program of a plan executed on fake tensors, proven to agree.

``rank_step.run_rank`` builds one rank's ``CompiledModel`` on fake tensors (no memory) under torch's
fake process group and runs one training step with the real runtime, while ``recorder.Recorder`` logs
every collective, send, receive, host read and allocation; ``proofs`` checks the logs of every rank
(by classes of ranks whose programs are the same up to rank ids) against each other and the devices.
The API and the CLI (``xirang.check``, ``xirang check``) are in xirang_compile/check_api.py.
"""
