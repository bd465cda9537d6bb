"""Model zoo: GPT, Llama-2, GShard MoE and BERT, each split into Embed / Layer / Head.

Typical use::

    from cfp.models import get_config, train_step
    ts = train_step("gpt", get_config("gpt", "tiny"))
    params, opt_state = ts.init(0)
    params, opt_state, loss = jax.jit(ts.step)(params, opt_state, ts.make_batch(8, 1))
"""
from cfp.models.configs import (CONFIG_CLASSES, CONFIGS, MODEL_NAMES, BertConfig, Config,
                                GPTConfig, LlamaConfig, MoEConfig, MoEModelConfig, get_config)
from cfp.models.zoo import (TrainStep, build_model, init_params, loss_fn, make_batch,
                            min_batch_size, stage_modules, train_step)

__all__ = [
    "MODEL_NAMES", "CONFIGS", "CONFIG_CLASSES", "Config", "GPTConfig", "LlamaConfig",
    "MoEConfig", "MoEModelConfig", "BertConfig", "get_config", "build_model", "stage_modules",
    "init_params", "min_batch_size", "loss_fn", "make_batch", "TrainStep", "train_step",
]
