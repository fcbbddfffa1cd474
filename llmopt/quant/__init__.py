"""Offline weight quantization: the algorithms (RTN, GPTQ, AWQ, SmoothQuant; the 8-bit quantizers
live in llmopt.layers, which load time uses too), calibration, the layer-by-layer pipeline and the
checkpoints it writes (formats/: AutoAWQ GEMM, GPTQ v1, compressed-tensors). The runtime side, the
modules that run those checkpoints, is llmopt.layers."""
