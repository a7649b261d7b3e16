# Appended to a vision bake's model.py by tests/test_zoo.py, as a user would: a tiny, randomly
# initialised Vision Transformer from the Hugging Face zoo (built from its config, offline)
# wrapped in a module that returns the logits, and build_model returning it.
import transformers
from torch import nn


class HuggingFaceViT(nn.Module):
    """An image classifier from transformers: images in, logits out (the task's cross-entropy)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, images):
        return self.inner(pixel_values=images).logits


def build_model(cfg):
    config = transformers.ViTConfig(
        image_size=cfg.image_size,
        patch_size=4,
        num_channels=3,
        hidden_size=8 * cfg.width,
        num_hidden_layers=cfg.depth,
        num_attention_heads=2,
        intermediate_size=16 * cfg.width,
        num_labels=cfg.num_classes,
        attn_implementation="eager",  # exact float64 comparisons: see docs/your-model.md
    )
    return HuggingFaceViT(transformers.ViTForImageClassification(config))
