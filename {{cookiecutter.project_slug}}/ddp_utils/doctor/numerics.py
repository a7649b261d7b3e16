"""How closely doctor.py's two runs of a float64 model must agree, and what they leave out.

Two float64 runs that differ only in how the work is split (1 process or 2, accumulation,
sharding) agree to float64's rounding, ~1e-16 of the largest entry of what is compared: EXACT
(1e-10) leaves a millionfold margin, and any real fault (a loss that sums, a forward that
depends on the world size, a batch norm without synchronisation) is far above it.

- **Against the whole set**: each tensor is compared at the scale of the largest entry of every
  gradient (or parameter, or buffer) compared, not its own. An entry that is zero in exact
  arithmetic (an attention key bias: softmax ignores it) is rounding noise in both runs, and
  noise against its own noise would fail a correct model.
- **Noise left out after steps**: AdamW scales such an entry's noise up to a whole step, in
  each run its own way. Parameters whose gradient is at the noise level of the comparison are
  left out of the comparisons after steps; the "zero gradients" row reports them.
- **What the model really computes**: a model that computes part of its forward in a lower
  precision whatever dtype it is given (Mamba's A_log.float(), a norm or a softmax kept in
  float32) sums in that precision where the batch is split, and its runs agree only to that
  precision's rounding (TOLERANCES). A difference between EXACT and
  that is a warning naming the module that casts, not a fault; a fault is still far above it.
"""

import contextlib
import re
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

EXACT = 1e-10  # of the largest entry: float64 throughout
# Of the largest entry, where the model computes in that precision: about 10 of its epsilons (float32's
# is 1.2e-7; a tiny Mamba, which keeps its scan in float32, differs by 2e-9 between 1 and 2 processes).
TOLERANCES = {torch.float32: 1e-6, torch.float16: 1e-2, torch.bfloat16: 5e-2}
NOISE = 10  # an entry within NOISE x the tolerance of zero, against the largest, is rounding noise

FLOAT64_FIX = ("the doctor compares float64 runs: pick the model's float64 implementation for it (Hugging Face "
               'models: attn_implementation="eager", experts_implementation="eager")')  # fmt: skip


def float64_fix(error):
    """FLOAT64_FIX where `error` is a kernel refusing float64 (a fused attention or grouped
    experts' matmul, "expected ... got Double"), else nothing to say."""
    return FLOAT64_FIX if re.search(r"double|float64", str(error), re.IGNORECASE) else ""


class CastWatch(TorchFunctionMode):
    """Records each call that turns a float64 tensor depending on the parameters (one that
    requires grad) into a lower-precision one: the parameter cast, or the innermost module
    running the call."""

    def __init__(self):
        super().__init__()
        self.modules, self.found = [], {}  # found: (id of the parameter or module, call name) -> dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracked = [t for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.requires_grad]  # fmt: skip
        lower = [t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype in TOLERANCES]
        if tracked and lower:
            # A parameter cast is named by the parameter, anything else by the module running it.
            where = next((t for t in tracked if isinstance(t, torch.nn.Parameter)), None)
            where = where if where is not None else self.modules[-1] if self.modules else None
            self.found.setdefault((id(where), getattr(func, "__name__", str(func))), lower[0])
        return out


@contextlib.contextmanager
def watching_casts():
    """A CastWatch over the forwards, losses and backwards run in the block."""
    watch = CastWatch()

    def entered(module, args):
        watch.modules.append(module)

    def left(module, args, output):  # returns None: the output stays the module's
        watch.modules.pop()

    pre = torch.nn.modules.module.register_module_forward_pre_hook(entered)
    post = torch.nn.modules.module.register_module_forward_hook(left)
    try:
        with watch:
            yield watch
    finally:
        pre.remove()
        post.remove()


@dataclass(frozen=True)
class Tolerance:
    """How closely two runs of one float64 model agree: EXACT, or the rounding of the lowest
    precision it computes in (`casts`: "module (call)" -> that dtype)."""

    casts: dict = field(default_factory=dict)

    @classmethod
    def watched(cls, model, watch):
        names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        names.update((id(p), name) for name, p in model.named_parameters())
        casts = {}
        for (where, call), dtype in watch.found.items():
            casts.setdefault(f"{names.get(where, 'the loss')} ({call})", dtype)
        return cls(casts)

    @property
    def lowest(self):
        """The lowest precision the model computes in: float64 when it casts nowhere."""
        return max(self.casts.values(), key=TOLERANCES.__getitem__, default=torch.float64)

    @property
    def loose(self):
        return TOLERANCES.get(self.lowest, EXACT)

    def noise(self, gradients):
        """The entries of `gradients` (name -> tensor) at this comparison's noise level."""
        largest = max((g.abs().max().item() for g in gradients.values() if g.numel()), default=0.0)
        return {name: g.abs() <= NOISE * self.loose * largest for name, g in gradients.items()}

    def compare(self, expected, got, noise=None):
        """("same", None), ("close", name) or ("differs", name) for the tensors `got` against
        `expected` (name -> tensor), at the scale of the largest entry of them all, the entries
        in `noise` (name -> mask) left out."""
        floats = [t for t in expected.values() if t.is_floating_point() and t.numel()]
        scale = max((t.abs().max().item() for t in floats), default=0.0) or 1.0
        verdict, which = "same", None
        for name, tensor in expected.items():
            other = got.get(name)
            if other is None or other.shape != tensor.shape:
                return "differs", name
            if not tensor.is_floating_point() or not tensor.numel():
                if not torch.equal(tensor, other):
                    return "differs", name
                continue
            difference = (tensor - other.to(tensor.dtype)).abs()
            if noise is not None and name in noise and noise[name].shape == difference.shape:
                difference = difference.masked_fill(noise[name], 0.0)
            worst = difference.max().item()
            if not worst <= self.loose * scale:  # NaN too
                return "differs", name
            if worst > EXACT * scale and verdict == "same":
                verdict, which = "close", name
        return verdict, which

    def close_row(self, what):
        """Why and fix of a warning: `what` agree only to the rounding of the lowest precision."""
        names = [name for name, dtype in self.casts.items() if dtype == self.lowest]
        where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        dtype = str(self.lowest).removeprefix("torch.")
        verb = "computes in {} whatever dtype it is" if len(names) == 1 else "compute in {} whatever dtype they are"
        why = f"{what} agree to {self.loose:g} of the largest entry, not {EXACT:g}: {where} {verb.format(dtype)} given"
        fix = (f"nothing, where {dtype} is meant there (a norm, a scan or a softmax often is); the doctor then sees "
               f"faults above {self.loose:g} only. To compare exactly, compute in the input's dtype")  # fmt: skip
        return why[:400], fix
