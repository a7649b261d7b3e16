"""Hugging Face GPT-2 folders: start from one (--init_from), write one (export.py --format hf).

A folder is what `transformers`' `save_pretrained` writes: config.json, and model.safetensors
or pytorch_model.bin. GPT-2 is model.py's GPT with --gelu tanh: the same pre-LayerNorm blocks,
biases, LayerNorm epsilon (1e-5), learned positions and tied embeddings. Its linear layers are
`Conv1D`s, whose weight is [in, out]: transposed here to nn.Linear's [out, in]. Nothing here
imports `transformers`; the tests check both directions against it.
"""

import json
import shutil
from pathlib import Path

import torch

from ddp_utils.core.files import replace_folder
from ddp_utils.errors import CheckpointError, ConfigError

# GPT-2's module names -> this GPT's (one part of a dotted name at a time).
OURS = {"wte": "tok_emb", "wpe": "pos_emb", "h": "blocks", "c_attn": "qkv", "c_proj": "proj", "c_fc": "fc"}
THEIRS = {ours: theirs for theirs, ours in OURS.items()}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}  # activation_function -> --gelu
# config.json settings this GPT computes differently: such a folder is refused, not run wrongly.
REQUIRED = {"layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "add_cross_attention": False, "tie_word_embeddings": True}  # fmt: skip


def read_config(folder):
    """The model fields a GPT-2 folder's config.json sets: vocab_size, n_layer, n_head, n_embd,
    gelu, and n_positions (the longest --block_size it has positions for)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("init_from", f"{folder} has no config.json: pass a Hugging Face GPT-2 folder") from None
    except (OSError, ValueError) as error:
        raise ConfigError("init_from", f"{path} is not readable JSON ({error})") from None
    if config.get("model_type") != "gpt2":
        raise ConfigError("init_from", f"{path} has model_type {config.get('model_type')!r}: only gpt2 folders load")
    for key, wanted in REQUIRED.items():
        if config.get(key, wanted) != wanted:
            raise ConfigError("init_from", f"{path} has {key} {config[key]!r}: this GPT supports {wanted!r} only")
    if config.get("activation_function", "gelu_new") not in GELU:
        raise ConfigError("init_from", f"{path} has activation_function {config['activation_function']!r}")
    if config.get("n_inner") not in (None, 4 * config.get("n_embd", 0)):
        raise ConfigError("init_from", f"{path} has n_inner {config['n_inner']}: this GPT's MLP is 4 x n_embd wide")
    try:
        fields = {name: int(config[name]) for name in ("vocab_size", "n_layer", "n_head", "n_embd", "n_positions")}
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError("init_from", f"{path} has no usable {error}") from None
    return {**fields, "gelu": GELU[config.get("activation_function", "gelu_new")]}


def read_weights(folder, block_size):
    """A GPT-2 folder's weights under this GPT's names (positions cut to `block_size`, the
    output layer tied to the embedding), as float32 CPU tensors."""
    folder = Path(folder)
    try:
        if (folder / "model.safetensors").is_file():
            from safetensors.torch import load_file

            tensors = load_file(folder / "model.safetensors")
        elif (folder / "pytorch_model.bin").is_file():
            tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise CheckpointError(f"--init_from {folder} has neither model.safetensors nor pytorch_model.bin")
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - junk bytes raise whatever the reader raises
        raise CheckpointError(f"--init_from {folder}: its weights are unreadable ({type(error).__name__})") from None
    weights = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the tied output layer; old files' causal masks (buffers)
        if name.endswith(CONV1D):
            tensor = tensor.t()
        weights[".".join(OURS.get(part, part) for part in name.split("."))] = tensor.float().contiguous()
    if "pos_emb.weight" in weights:
        weights["pos_emb.weight"] = weights["pos_emb.weight"][:block_size]
    if "tok_emb.weight" in weights:
        weights["lm_head.weight"] = weights["tok_emb.weight"]
    return weights


def check_weights(weights, model_state, folder):
    """The weights a folder gave, against the model's own state dict: one line per problem."""
    for name, tensor in model_state.items():
        if name not in weights:
            raise CheckpointError(f"--init_from {folder} has no weight for {name} (GPT-2's {theirs(name)})")
        if weights[name].shape != tensor.shape:
            raise CheckpointError(
                f"--init_from {folder}: {theirs(name)} has shape {list(weights[name].shape)}, "
                f"config.json implies {list(tensor.shape)}"
            )
    extra = sorted(set(weights) - set(model_state))
    if extra:
        raise CheckpointError(f"--init_from {folder} has weights this GPT lacks: {', '.join(map(theirs, extra[:3]))}")


def theirs(name):
    """This GPT's parameter name as GPT-2 names it (the Conv1D weights are also transposed)."""
    return "transformer." + ".".join(THEIRS.get(part, part) for part in name.split("."))


def write_folder(weights, config, tokenizer, out):
    """A folder `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json and
    model.safetensors, plus tokenizer.json when the model learned one (not bytes). Written
    next to `out` and renamed into place: complete or absent."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in weights.items():
        if name == "lm_head.weight":
            continue  # tied: transformers ties it to the embedding again
        hf_name = theirs(name)
        tensors[hf_name] = (tensor.t() if hf_name.endswith(CONV1D) else tensor).float().contiguous()
    settings = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config["vocab_size"],
        "n_positions": config["block_size"],
        "n_embd": config["n_embd"],
        "n_layer": config["n_layer"],
        "n_head": config["n_head"],
        "n_inner": None,
        "activation_function": "gelu_new" if config.get("gelu", "exact") == "tanh" else "gelu",
        "layer_norm_epsilon": 1e-5,
        **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), config.get("dropout", 0.0)),
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    if tokenizer not in (None, "bytes"):
        (tmp / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
    replace_folder(tmp, out)
