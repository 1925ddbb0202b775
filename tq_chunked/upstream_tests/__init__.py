"""Test code that the vendored change (``python -m tq_chunked.vendor``) writes into
vLLM's ``tests/``: written in vLLM's test style, to run there (not imported by
tq_chunked, not collected by its own test run).

* ``test_turboquant_chunked_prefill.py``: added as
  ``tests/quantization/test_turboquant_chunked_prefill.py``;
* ``turboquant_reservation.py``: the methods of vLLM's
  ``TestTurboQuantWorkspaceReservation`` (``tests/quantization/test_turboquant.py``,
  vLLM 0.24 onwards) that assert the old (1, Hk, max_model_len, D) reservation, as the
  change rewrites them.
"""
