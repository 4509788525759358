"""Repository-wide test settings (every test folder).

The engine's CPU tests run tiny models whose matmuls are far too small to gain from intra-op
threads; on a 2-core CI box the threads only contend (5-50x slower generations were seen on a
loaded box). ``SPARSE_TEST_THREADS`` overrides.
"""

import os

import torch

torch.set_num_threads(int(os.environ.get("SPARSE_TEST_THREADS", "1")))
