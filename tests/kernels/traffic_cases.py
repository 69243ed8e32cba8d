"""The kernel variants the optimizers and the multi-tensor ops launch, and the bytes per element each must move.

Plain data (no Triton import): ``aot_compile.py traffic`` turns a :class:`Variant` into a kernel and its
constexprs; ``test_kernel_traffic.py`` holds the PTX's bytes (``ptx_traffic.py``) against :func:`expected`.

**The count, from first principles** (bytes per element of the tensors a launch walks; every tensor the math
needs is read once and every tensor it changes written once; fp32 4 B, fp16/bf16 2 B):

* weights: ``fp32`` param (read + write 4 + 4), grads fp32 (4); ``fp16``/``bf16`` params without masters (2 + 2),
  grads of the param's dtype (2); ``master-*``: the fp32 master read and written (4 + 4), the low-precision grad
  read (2) and the model copy written (2); ``split``: the bf16 param and its int16 low half, each read and written
  (2 + 2 and 2 + 2), bf16 grads (2); ``stochastic``: the bf16 param (2 + 2), bf16 grads (2).
* moments (Adam's and LAMB's m and v): fp32, 4 read + 4 written each; 8-bit (``state_bits=8``): one code byte
  read and written each, plus one fp32 absmax per 256 elements read and written (``4 / 256`` B each way);
  tensors below ``state8.SMALL_NUMEL`` elements keep fp32 moments (the worst path of an 8-bit kernel).
* Adam: param r/w, grad r, m r/w, v r/w, model w. LAMB stage 1: param r (split: both halves), grad r, m r/w, v r/w.
  LAMB stage 2: param r/w (split: both halves), m r, v r, model w (the update ``u`` is recomputed, never stored).
* SGD (momentum), Adagrad, NovoGrad: param r/w, grad r, one fp32 state r/w, model w; their result check
  (``VERIFY``) reads param, grad and state and writes nothing.
* the check pass: grad r; ``l2norm``'s sum of squares: tensor r; ``unscale``: input r + output w (in place: the
  same tensor); ``copy_``: source r + destination w.

A step's total is the check pass plus its update kernels (docs/optim.md: Adam 4 + 28 = 32 B with fp32 params,
4 + 16.06 = 20.1 with 8-bit moments; LAMB 4 + 24 + 16 = 44, 4 + 12.06 + 10.03 = 26.1).
"""

from __future__ import annotations

from dataclasses import dataclass

SIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
#: bytes of one 8-bit moment each way: the code plus its share of the block's fp32 absmax
Q8 = 1 + 4 / 256
WEIGHTS = ("fp32", "fp16", "bf16", "master-fp16", "master-bf16", "split", "stochastic")


@dataclass(frozen=True)
class Variant:
    """One kernel specialization. ``kernel``: adam, lamb1, lamb2, sgd, adagrad, novograd (update or result check),
    check (the device step's check pass), sumsq (``l2norm``), unscale, copy, absmax (NovoGrad's max norm)."""

    kernel: str
    weights: str = "fp32"  # see WEIGHTS; for unscale/copy/check/sumsq: the input dtype
    out: str = ""  # unscale/copy: the output dtype ("" = in place)
    bits: int = 32
    device: bool = True  # device step (hyper-parameters derived on the device) / host-built vector
    verify: bool = False  # apex optimizers: the result check launch
    norm: bool = True  # check pass: with the norm (LAMB, clipping) or the flag alone (Adam)
    row_idx: bool = False  # stochastic rounding's row table (FSDP2 shards, sub-lists)

    @property
    def name(self) -> str:
        if self.kernel in ("unscale", "copy"):
            return f"{self.kernel} {self.weights}->{self.out or self.weights}{'' if self.out else ' in place'}"
        if self.kernel in ("check", "sumsq", "absmax"):
            return f"{self.kernel} {self.weights}" + ("" if self.kernel != "check" else (" +norm" if self.norm
                                                                                       else " flag only"))
        parts = [self.kernel, self.weights]
        if self.kernel in ("adam", "lamb1", "lamb2"):
            parts.append(f"m{self.bits}")
        parts.append("device" if self.device else "host")
        if self.verify:
            parts.append("verify")
        if self.row_idx:
            parts.append("row table")
        return " ".join(parts)

    @property
    def param_dtype(self) -> str:
        return "fp32" if self.weights.startswith("master") or self.weights == "fp32" else (
            "bf16" if self.weights in ("split", "stochastic") else self.weights)

    @property
    def grad_dtype(self) -> str:
        if self.weights.startswith("master-"):
            return self.weights[len("master-"):]
        return self.param_dtype

    @property
    def model_dtype(self) -> str | None:
        return self.weights[len("master-"):] if self.weights.startswith("master-") else None


def _moment(bits: int) -> float:
    return 4.0 if bits == 32 else Q8


def expected(v: Variant, *, small_tensor: bool = False) -> tuple[float, float]:
    """``(loaded, stored)`` bytes per element ``v`` must move. ``small_tensor``: an 8-bit kernel's path for a tensor
    that keeps fp32 moments (below ``state8.SMALL_NUMEL``)."""
    if v.kernel == "unscale":
        return SIZE[v.weights], SIZE[v.out or v.weights]
    if v.kernel == "copy":
        return SIZE[v.weights], SIZE[v.out]
    if v.kernel in ("check", "sumsq", "absmax"):
        return SIZE[v.weights], 0.0
    p, g = SIZE[v.param_dtype], SIZE[v.grad_dtype]
    low = 2 if v.weights == "split" else 0  # the int16 low half of split mode, read and written like the param
    model = SIZE[v.model_dtype] if v.model_dtype else 0
    mom = _moment(32 if small_tensor else v.bits)
    if v.kernel == "adam":
        return p + low + g + 2 * mom, p + low + 2 * mom + model
    if v.kernel == "lamb1":
        return p + low + g + 2 * mom, 2 * mom
    if v.kernel == "lamb2":
        return p + low + 2 * mom, p + low + model
    if v.kernel in ("sgd", "adagrad", "novograd"):
        if v.verify:
            return p + g + 4, 0.0
        return p + g + 4, p + 4 + model
    raise ValueError(v.kernel)


def all_variants() -> list[Variant]:
    """Every variant of the sweep (``slow``: both architectures, ~150 kernels each)."""
    out: list[Variant] = []
    for kernel in ("adam", "lamb1", "lamb2"):
        for weights in WEIGHTS:
            for bits in (32, 8):
                for device in (True, False):
                    out.append(Variant(kernel, weights, bits=bits, device=device))
        if kernel != "lamb1":  # the stochastic epilogue's row table (host-vector launches of sub-lists and shards)
            out.append(Variant(kernel, "stochastic", device=False, row_idx=True))
    for dtype in ("fp32", "fp16", "bf16"):
        out.append(Variant("check", dtype, norm=True))
        out.append(Variant("check", dtype, norm=False))
        out.append(Variant("sumsq", dtype))
        out.append(Variant("unscale", dtype))
    out += [Variant("unscale", "fp16", "fp32"), Variant("unscale", "bf16", "fp32"), Variant("unscale", "fp32", "fp16"),
            Variant("unscale", "fp32", "bf16")]
    out += [Variant("copy", "fp32", "fp16"), Variant("copy", "fp32", "bf16"), Variant("copy", "fp16", "fp32"),
            Variant("copy", "bf16", "fp32"), Variant("copy", "fp32", "fp32")]
    for kernel in ("sgd", "adagrad", "novograd"):
        for weights in ("fp32", "master-fp16", "master-bf16", "bf16"):
            for device in (True, False):
                for verify in (False, True):
                    out.append(Variant(kernel, weights, device=device, verify=verify))
    out.append(Variant("absmax", "bf16"))
    out.append(Variant("absmax", "fp32"))
    return out


#: The default run's subset (each kernel, each weights mode, both moment widths, both step kinds at least once).
REPRESENTATIVE = (
    "adam fp32 m32 device",
    "adam master-bf16 m8 host",
    "lamb1 stochastic m8 device",
    "lamb2 fp32 m32 device",
    "lamb2 split m8 host",
    "check fp16 +norm",
    "unscale fp16->fp32",
    "sgd master-fp16 device verify",
)
#: ... compiled for sm_80 as well in the default run
REPRESENTATIVE_SM80 = ("adam fp32 m32 device", "lamb2 split m8 host")
