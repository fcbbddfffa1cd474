"""What the model runs besides float nn.Linear: the quantized linear modules of each checkpoint
format (modules.py, modules_w8a8.py) and the swap into them before loading (runtime.py), the
formats' layouts as they are read (formats/), the canonical quantized weight (types.py), W8A8's
activation quantization (activations.py), load-time 8-bit weights (fp8.py, int8.py), fused q/k/v
and gate/up (fuse.py), and the tensor-parallel layout of the layers (tp.py, shard_quant.py).

Imported by llmopt.models, llmopt.engine and llmopt.quant (the offline algorithms); imports
neither the model nor the quantizers."""
