# Appended to a language bake's model.py by tests/test_zoo.py, as a user would: a tiny, randomly
# initialised architecture from the Hugging Face zoo (built from its config, offline) wrapped in
# a module that returns the logits, and build_model returning it. ZOO_MODEL picks which.
import os

import transformers
from torch import nn


class HuggingFaceLM(nn.Module):
    """A causal LM from transformers: token ids in, logits out (the task's loss_fn)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, tokens):
        return self.inner(input_ids=tokens).logits


def zoo_config(cfg):
    shape = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer}
    heads = {"num_attention_heads": cfg.n_head, "max_position_embeddings": cfg.block_size}
    # The eager implementations compute in the dtype they are given: float64 for the doctor's and the
    # tests' exact comparisons (grouped experts' matmul refuses float64, a GPU's fused attention too).
    eager = {"attn_implementation": "eager"}
    name = os.environ["ZOO_MODEL"]
    if name == "llama":  # RoPE, RMSNorm, grouped-query attention, SwiGLU
        return transformers.LlamaConfig(**shape, **heads, **eager, num_key_value_heads=1, intermediate_size=64)
    if name == "gpt_neox":  # parallel attention and MLP, partial rotary
        return transformers.GPTNeoXConfig(**shape, **heads, **eager, intermediate_size=64)
    if name == "mixtral":  # a mixture of 4 experts, 2 per token
        return transformers.MixtralConfig(
            **shape,
            **heads,
            **eager,
            num_key_value_heads=1,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",
        )
    if name == "mamba":  # a selective state-space model, no attention
        return transformers.MambaConfig(**shape, state_size=4, expand=2, conv_kernel=2)
    raise ValueError(f"ZOO_MODEL={name}")


def build_model(cfg):
    return HuggingFaceLM(transformers.AutoModelForCausalLM.from_config(zoo_config(cfg)))
