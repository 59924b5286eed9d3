"""FP8 training of a built model (quant.train_fp8), applied once before parallelize:

    apply_fp8_training(model, "experts" | "experts+dense")

experts: every GroupedExperts trains its base GEMMs in FP8 with rowwise scales (GroupedExperts.fp8_training; the
grouped_mm backend runs them through quant.fp8_training, scattermoe through its FP8 kernels in eager mode).
experts+dense also swaps the decoder layers' dense linears (attention and GDN projections, shared experts, dense
MLPs) for torchao's Float8Linear, tensorwise (its default recipe, the fastest), where torchao's own filter expects
FP8 to pay: dims multiples of 16 and large enough (at Qwen3-30B-A3B's dims q_proj and o_proj, not the 512-wide
k_proj and v_proj). The embedding, the
router and the lm_head stay in the model dtype. Parameters keep their names and dtypes: checkpoints do not change.
"""

from __future__ import annotations

from torch import nn

from moe.experts import GroupedExperts

DENSE_RECIPE = "tensorwise"


def apply_fp8_training(model: nn.Module, mode: str) -> None:
    """Marks the experts (and, for experts+dense, converts the dense linears) in place; "none" does nothing."""
    if mode == "none":
        return
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.fp8_training = True
    if mode == "experts+dense":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe  # private: torchao is pinned

        pays = _auto_filter_for_recipe(DENSE_RECIPE, filter_fqns=[])
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(DENSE_RECIPE),
                                   module_filter_fn=lambda m, fqn: fqn.startswith("model.layers.") and pays(m, fqn))
