"""Benchmarks (``sparse-serve bench``): decode tok/s, ms/step and achieved bandwidth against the
device's measured copy bandwidth; prefill seconds, tokens/s and TFLOP/s; end-to-end batches; with
HF transformers as a side-by-side baseline.

``suite.run_bench`` runs one engine config over prompt lengths x batch sizes (or request counts,
``e2e``); ``decode`` times one decode case, ``prefill`` a batch's prefill (``flops`` counts its
work), ``e2e`` one end-to-end batch; ``hf_baseline`` the HF side; ``probes`` the roofline's bytes
and ceiling and the profiler; ``report`` and ``report_tables`` write JSON, markdown and a plot.
"""
