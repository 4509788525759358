"""The module-level switches that change kernel timings, for reports to record with their numbers."""

from __future__ import annotations

import sys


def launch_settings() -> dict:
    """``pdl``: decode-path kernels use programmatic dependent launch on Hopper
    (``sparse_kernels._triton.launch.PDL``); ``small_m_linear_max_rows``: the most rows the small-M
    linear kernel takes (``sparse_kernels.linear.SMALL_M_MAX``); ``quantized_swap_ab``: the quantized decode's
    transposed dots, per-token schemes / KIVI (``SWAP_AB`` in ``quantized_decode_launch``'s configs);
    ``kivi_pairs``: KIVI's codes unpacked two per word in inline PTX (``PAIRS``); ``kivi_grouped``: KIVI's values
    one dot per channel group, the scales folded into the probabilities (``GROUPED``); ``kivi_maxnreg``: the
    register cap of KIVI's decode (0: none)."""
    from sparse_kernels._triton import launch
    from sparse_kernels._triton import quantized_decode_launch as quantized

    linear_module = sys.modules["sparse_kernels.linear"]  # the package attribute of that name is the function
    swap = [bool(c.get("SWAP_AB")) for c in (quantized.QUANT_DECODE_CONFIG, quantized.KIVI_DECODE_CONFIG)]
    return {
        "pdl": launch.PDL,
        "small_m_linear_max_rows": linear_module.SMALL_M_MAX,
        "quantized_swap_ab": swap,
        "kivi_pairs": bool(quantized.KIVI_DECODE_CONFIG.get("PAIRS")),
        "kivi_grouped": bool(quantized.KIVI_DECODE_CONFIG.get("GROUPED")),
        "kivi_maxnreg": int(quantized.KIVI_DECODE_CONFIG.get("maxnreg") or 0),
    }
