"""Token generation on top of :mod:`olv_runtime.state`: :func:`~olv_runtime.generation.generate.generate`
(prefill, then one decode step per token), next-token selection
(:mod:`~olv_runtime.generation.sampling`), chat templates and conversations
(:mod:`~olv_runtime.generation.chat`) and perplexity / KL evaluation
(:mod:`~olv_runtime.generation.evaluate`)."""
