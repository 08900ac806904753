"""The executor: :class:`~olv_runtime.executor.session.InferenceSession` validates a model once,
builds a plan (:mod:`~olv_runtime.executor.steps`, fused by :mod:`~olv_runtime.executor.passes`)
and runs it; a run of decoder layers becomes one compiled step
(:mod:`~olv_runtime.executor.decoder_step`, :mod:`~olv_runtime.executor.paged_decoder_step`).
The layers above reach it through the session's public methods only (docs/architecture.md)."""
