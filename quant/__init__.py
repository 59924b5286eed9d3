"""Quantized expert weights: MXFP4 / NVFP4 base-weight containers (torchao layouts), quantization at
load and the dequantize the expert backends call. Empty until the FP4 issue brings them; it may import
gpu/ and nothing else of ours."""
