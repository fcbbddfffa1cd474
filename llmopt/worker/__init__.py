"""What runs a step: the model runner (one process), its compiled and C++ decode paths, and the
executor interface the engine drives (one process or tensor-parallel ranks, llmopt.distributed)."""
