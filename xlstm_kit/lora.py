"""LoRA fine-tuning: adapters on the blocks' linear maps, through PEFT (``pip install 'xlstm-kit[lora]'``).

    model = apply_lora(model, rank=8)           # adapters (B = 0), every other parameter frozen
    train(model, data, TrainConfig(...))        # or TrainConfig(lora=8) on the base model
    save_adapters(model, "adapters/")           # the adapters alone
    load_adapters(base, "adapters/")            # onto the base model they were trained on
    merge_lora(model).save_pretrained("hf/")    # folded into the weights: a plain model again

Every path of the blocks honours unmerged adapters (the Triton training and decode kernels
read W + (alpha / rank) B A); `merge_lora` makes inference as fast as the base model's.
See xlstm_kit.models.lora and xlstm_kit.io.lora.
"""
from .io.lora import load_adapters, save_adapters
from .layers.lora import has_adapters
from .models.lora import DEFAULT_TARGETS, apply_lora, block_linear_names, lora_settings, merge_lora

__all__ = ["apply_lora", "merge_lora", "save_adapters", "load_adapters", "has_adapters", "lora_settings",
           "block_linear_names", "DEFAULT_TARGETS"]
