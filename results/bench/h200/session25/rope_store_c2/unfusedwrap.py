"""Run the sparse-serve CLI with the attention's rotation applied before the KV store (two launches a layer, as
before rope_store): sparse_serve.paged_attention.rope_store replaced by Rotation.apply then store_kv."""
import runpy
import sys

import sparse_serve.paged_attention as pa
from sparse_kernels import store_kv


def unfused(q, k, v, rotation, k_cache, v_cache, slot_mapping, *, copy_into=None, copy_index=None, num_copy=0):
    q, k = rotation.apply(q, k)
    copy = dict(copy_rows=q[:num_copy], copy_into=copy_into, copy_index=copy_index) if num_copy else {}
    store_kv(k, v, k_cache, v_cache, slot_mapping, **copy)
    return q


pa.rope_store = unfused
print("rope_store unfused", flush=True)
sys.argv = ["sparse_serve.cli"] + sys.argv[1:]
runpy.run_module("sparse_serve.cli", run_name="__main__")
