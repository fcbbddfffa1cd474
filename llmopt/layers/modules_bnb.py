"""The runtime module of bitsandbytes 4-bit checkpoints (transformers' `load_in_4bit`, nf4 or fp4).

Its buffers hold a Linear4bit's checkpoint tensors (llmopt.layers.formats.bnb) until
`finish_loading` turns them into Fp4Linear's runtime form (codes, float32 scales). Checkpoint names
with dots map to buffer names through `checkpoint_names` (LlamaForCausalLM.load_weights reads it):

  weight                                  -> weight (the packed codes, in bnb_4bit_quant_storage)
  weight.absmax, weight.quant_map         -> weight_absmax, weight_quant_map
  weight.nested_absmax, .nested_quant_map -> weight_nested_absmax, weight_nested_quant_map (double quant)
  weight.quant_state.bitsandbytes__nf4|fp4 -> weight_quant_state

The block size lives in each Linear's quant_state, not in config.json: the absmax buffers and the
quant_state take the checkpoint's shapes (`free_shape`) and `block` is set from the quant_state.
"""

from __future__ import annotations

import torch

from llmopt.errors import ModelLoadError
from llmopt.layers.formats import bnb
from llmopt.layers.formats.fp4 import Fp4Quantized
from llmopt.layers.modules_fp4 import Fp4Linear

_DEFAULT_BLOCK = 64   # until the quant_state says otherwise (transformers always writes 64)


class Bnb4bitLinear(Fp4Linear):
    """A bitsandbytes Linear4bit's weight, run as 4-bit float codes with float32 block scales."""

    free_shape = ("weight_absmax", "weight_nested_absmax", "weight_quant_state")

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: bnb.BnbConfig) -> None:
        super().__init__(in_features, out_features, bias, bnb.QUANT_TYPES[cfg.quant_type], _DEFAULT_BLOCK)
        self.quant_type, self.double_quant = cfg.quant_type, cfg.double_quant
        nbytes = -(-in_features * out_features // 2)
        if nbytes % cfg.storage.itemsize:
            raise ModelLoadError(f"{nbytes} bytes of 4-bit codes do not fill {cfg.storage} elements")
        self._declare("weight", (nbytes // cfg.storage.itemsize, 1), cfg.storage)
        self._declare("weight_absmax", (0,), torch.uint8 if cfg.double_quant else torch.float32)
        self._declare("weight_quant_map", (16,), torch.float32)
        names = {"weight": "weight", "weight.absmax": "weight_absmax", "weight.quant_map": "weight_quant_map"}
        if cfg.double_quant:
            self._declare("weight_nested_absmax", (0,), torch.float32)
            self._declare("weight_nested_quant_map", (256,), torch.float32)
            names.update({"weight.nested_absmax": "weight_nested_absmax",
                          "weight.nested_quant_map": "weight_nested_quant_map"})
        self._declare("weight_quant_state", (0,), torch.uint8)
        for t in bnb.QUANT_TYPES:   # (a quant_state of the other type is refused by name in canonical)
            names[f"weight.quant_state.bitsandbytes__{t}"] = "weight_quant_state"
        self.checkpoint_names = names

    def canonical(self) -> Fp4Quantized:
        tensors = {ck: self._buffers[buf] for ck, buf in self.checkpoint_names.items()
                   if not ck.startswith("weight.quant_state")}
        tensors[f"weight.quant_state.bitsandbytes__{self._state_type()}"] = self._buffers["weight_quant_state"]
        if self.bias is not None:
            tensors["bias"] = self.bias
        q = bnb.unpack(tensors)
        if q.quant_type != self.quant_type or q.double_quant != self.double_quant:
            raise ModelLoadError(f"a Linear's bitsandbytes quant_state ({q.quant_type}, double quant {q.double_quant}) "
                                 f"differs from config.json's ({self.quant_type}, {self.double_quant})")
        if q.shape != (self.out_features, self.in_features):
            raise ModelLoadError(f"a bitsandbytes quant_state's shape {list(q.shape)} is not the layer's "
                                 f"[{self.out_features}, {self.in_features}]")
        self.block = q.blocksize
        return q.as_fp4()

    def _state_type(self) -> str:
        """The quant_type the quant_state tensor itself names (its JSON)."""
        return bnb.state_of(self._buffers["weight_quant_state"])["quant_type"]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bitsandbytes={self.quant_type}, double_quant={self.double_quant}"
