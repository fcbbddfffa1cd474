"""Weight quantization: algorithms (RTN, GPTQ, AWQ, FP8, INT8/SmoothQuant), checkpoint formats
(AutoAWQ GEMM, GPTQ v1, compressed-tensors) and runtime modules that run quantized checkpoints."""
