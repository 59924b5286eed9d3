"""Quantized expert weights: MXFP4 / NVFP4 (torchao layouts) and FP8 (e4m3, rowwise) base-weight
containers, quantization at load and the dequantize the expert backends call, the FP8 GEMMs. It may import
gpu/ and nothing else of ours.

    from quant import quantize_experts, QuantizedWeight
    quantize_experts(experts, "mxfp4" | "nvfp4" | "fp8")   # in place; experts.base_weight(p) is then a
                                                           # QuantizedWeight (FP4Weight or FP8Weight)
"""

from quant.weight import FORMATS, FP4Weight, FP8Weight, QuantizedWeight, quantize_experts

__all__ = ["FORMATS", "FP4Weight", "FP8Weight", "QuantizedWeight", "quantize_experts"]
