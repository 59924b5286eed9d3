"""FP8 training of a built model (quant.train_fp8), applied once before parallelize:

    apply_fp8_training(model, "experts" | "experts+dense")

experts: every GroupedExperts trains its base GEMMs in FP8 (GroupedExperts.fp8_training; the grouped_mm
backend runs them through quant.fp8_training). experts+dense also swaps the decoder layers' dense linears
(attention and GDN projections, shared experts, dense MLPs) for torchao's Float8Linear with rowwise scales,
the recipe the expert GEMMs use. The embedding, the router, the lm_head and linears whose dims are not multiples
of 16 (the shared-expert gate's single output) stay in the model dtype: the FP8 GEMMs cannot take them, or
precision matters most there. Parameters keep their names and dtypes: checkpoints do not change.
"""

from __future__ import annotations

from torch import nn

from moe.experts import GroupedExperts


def _dense_fp8_eligible(module: nn.Module, fqn: str) -> bool:
    return (isinstance(module, nn.Linear) and fqn.startswith("model.layers.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def apply_fp8_training(model: nn.Module, mode: str) -> None:
    """Marks the experts (and, for experts+dense, converts the dense linears) in place; "none" does nothing."""
    if mode == "none":
        return
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.fp8_training = True
    if mode == "experts+dense":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=_dense_fp8_eligible)
