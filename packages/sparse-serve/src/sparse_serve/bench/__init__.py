"""Decode benchmark (``sparse-serve bench``): tok/s, ms/step and achieved bandwidth against the
device's measured copy bandwidth, with HF transformers as a side-by-side baseline.

``suite.run_bench`` runs one engine config over prompt lengths x batch sizes; ``decode`` times
one case; ``hf_baseline`` the HF side; ``probes`` the roofline's bytes and ceiling; ``report``
writes JSON, markdown and a plot.
"""
