"""Yours: a decoder-only transformer (GPT) that predicts the next token, nanoGPT-style.

Pre-LayerNorm blocks of causal self-attention and a GELU MLP, learned position embeddings,
and an output layer that shares its weights with the token embedding: GPT-2's architecture, so
--init_from starts from a Hugging Face GPT-2 folder and export.py --format hf writes one
(language/hf_gpt2.py). Yours: task.py hands build_model and the hooks below to the machinery
(ddp_utils/contract.py lists them). The knobs are the ModelConfig fields below, each a --flag.
`generate` lives here with the model; sample.py and the --sample_every_steps hook call it.
"""

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddp_utils.contract import build_on_meta
from ddp_utils.data.shards import is_sharded, read_index
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob
from language import hf_gpt2
from language.tokenizer import from_text

# A checkpoint to resume must match these (the other fields may change between runs).
SHAPE_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


@dataclass(frozen=True)
class ModelConfig:
    """The model's knobs: fields of Config, each a --flag."""

    vocab_size: int = knob(0, "token ids the model knows, 0 = read from <data_dir>/meta.json")
    block_size: int = knob(256, "context length in tokens (each training window is this long)")
    n_layer: int = knob(6, "transformer blocks")
    n_head: int = knob(6, "attention heads per block")
    n_embd: int = knob(384, "width of the residual stream (a multiple of n_head)")
    dropout: float = knob(0.0, "dropout probability on embeddings, attention and residual branches, 0 = off")
    gelu: str = knob("exact", "the MLP's GELU: exact, or tanh (GPT-2's approximation)", choices=("exact", "tanh"))
    init_from: str = knob(
        "", "a local Hugging Face GPT-2 folder to start from (its config.json sets the shape), step 0 only"
    )

    def check_model(self):
        for name in ("block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        if self.vocab_size < 0:
            raise ConfigError("vocab_size", "must not be negative (0 = read from <data_dir>/meta.json)")
        if self.n_embd % self.n_head:
            raise ConfigError("n_embd", f"must be a multiple of --n_head ({self.n_head})")
        if not 0 <= self.dropout < 1:
            raise ConfigError("dropout", "must be at least 0 and less than 1")

    def resolve_model(self):
        if self.init_from:
            return self.pretrained_shape()
        if self.vocab_size:
            return {}
        if is_sharded(self.data_dir):  # make_shards.py copied meta.json's facts into the index
            vocab_size = read_index(self.data_dir).get("vocab_size")
            if not vocab_size:
                raise ConfigError(
                    "vocab_size", f"is 0, but the index of {self.data_dir} holds no vocab_size: pass --vocab_size"
                )
            return {"vocab_size": vocab_size}
        meta = Path(self.data_dir) / "meta.json"
        if not meta.is_file():
            raise ConfigError(
                "vocab_size",
                f"is 0 (read from <data_dir>/meta.json), but {meta} does not exist: run python prepare_data.py first",
            )
        try:
            vocab_size = int(json.loads(meta.read_text())["vocab_size"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError("vocab_size", f"is 0, but {meta} holds no vocab_size: pass --vocab_size") from None
        return {"vocab_size": vocab_size}

    def pretrained_shape(self):
        """The shape --init_from's config.json sets; a flag set to something else is refused."""
        pretrained = hf_gpt2.read_config(self.init_from)
        positions = pretrained.pop("n_positions")
        defaults = {field.name: field.default for field in fields(ModelConfig)}
        for name, value in pretrained.items():
            if getattr(self, name) not in (value, defaults[name]):
                raise ConfigError(name, f"is {getattr(self, name)}, but --init_from {self.init_from} has {value}")
        if self.block_size > positions:
            raise ConfigError(
                "block_size", f"is {self.block_size}, but --init_from {self.init_from} has {positions} positions"
            )
        return pretrained


class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        # One fused kernel (flash or memory-efficient where the device has one); is_causal masks
        # the future without building a T x T mask.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)
        # GPT-2 uses tanh's approximation.
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    """Pre-LayerNorm: the residual stream itself is never normalised, which keeps deep stacks stable."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """tokens [batch, time] (int64) -> logits [batch, time, vocab_size] for the token that follows each."""

    def __init__(self, cfg):
        super().__init__()
        self.block_size = cfg.block_size
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))  # one unit each, for sharding later
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying: reading a token in and writing it out share one matrix (fewer parameters,
        # and a small model learns faster).
        self.lm_head.weight = self.tok_emb.weight

        self.n_layer = cfg.n_layer
        for name, module in self.named_modules():
            self.init_weights(name, module)

    def init_weights(self, name, module):
        """GPT-2's initialisation of one module's own parameters (LayerNorm keeps PyTorch's); each
        residual projection is scaled by 1/sqrt(2 x n_layer) so the residual stream's variance
        does not grow with depth (two branches add to it per block). ddp_utils/parallel/strategy.py calls it module
        by module, from generators seeded by name, so a meta-device start gives the same weights."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.n_layer) if name.endswith("proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def shard_units(self):
        """What --strategy fsdp shards one by one: each block (the rest goes with the model)."""
        return self.blocks

    def forward(self, tokens):
        T = tokens.shape[1]
        if T > self.block_size:
            raise ValueError(f"{T} tokens do not fit the context of --block_size {self.block_size}")
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device)))
        for block in self.blocks:  # --activation_checkpointing checkpoints each (the machinery's)
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(cfg):
    return GPT(cfg)


def pretrained_weights(cfg):
    """--init_from's weights under this GPT's names, or None: train.py copies them in on a fresh
    start, never on resume (the run's own checkpoint holds its weights)."""
    if not cfg.init_from:
        return None
    weights = hf_gpt2.read_weights(cfg.init_from, cfg.block_size)
    hf_gpt2.check_weights(weights, build_on_meta(build_model, cfg).state_dict(), cfg.init_from)
    return weights


@torch.no_grad()
def generate(model, tokens, max_new_tokens, block_size, temperature, top_k, vocab_size):
    """Append one sampled token at a time to `tokens` [1, T]; the model sees the last block_size.
    Only the tokenizer's `vocab_size` ids are drawn (a model may have more: a pretrained one's)."""
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -block_size:])[:, -1, :vocab_size].float()
        if temperature == 0:
            next_token = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth_best] = -float("inf")
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
        # Where the model computed it: under --cpu_offload the parameters (and the prompt) are in
        # host memory while FSDP computes on the GPU.
        tokens = torch.cat((tokens, next_token.to(tokens.device)), dim=1)
    return tokens


def sample_text(model, cfg, data):
    """--sample_every_steps: 64 tokens after a newline, from a fixed seed, decoded with the
    training set's tokenizer (its data_state())."""
    tokenizer = from_text((data or {}).get("tokenizer"))
    torch.manual_seed(cfg.seed)
    device = next(model.parameters()).device
    prompt = torch.tensor([tokenizer.encode("\n")], dtype=torch.long, device=device)
    tokens = generate(model, prompt, 64, cfg.block_size, temperature=0.8, top_k=200, vocab_size=tokenizer.vocab_size)
    return tokenizer.decode(tokens[0].tolist())


def write_hf(exported, out):
    """export.py --format hf: a Hugging Face GPT-2 folder of an exported checkpoint."""
    hf_gpt2.write_folder(exported["model"], exported["config"], (exported["data"] or {}).get("tokenizer"), out)


def tokens_per_sample(cfg):
    """Predictions per sample, one per token of the window: train.py reports tokens/s."""
    return cfg.block_size
