"""Quantized expert weights: MXFP4 / NVFP4 base-weight containers (torchao layouts), quantization at
load and the dequantize the expert backends call. It may import gpu/ and nothing else of ours.

    from quant import quantize_experts, FP4Weight
    quantize_experts(experts, "mxfp4" | "nvfp4")    # in place; experts.base_weight(p) is then an FP4Weight
"""

from quant.fp4 import FORMATS
from quant.weight import FP4Weight, quantize_experts

__all__ = ["FORMATS", "FP4Weight", "quantize_experts"]
