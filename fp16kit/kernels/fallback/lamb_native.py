"""Optional native CPU kernel for FusedLAMB on fp32 tensors (opt-in; built with the system C++ compiler).

The torch path runs LAMB as torch's fused Adam kernel plus ~5 more per-tensor ops (2.6–2.9x the time of
``torch.optim.AdamW(fused=True)``, ``benchmarks/results/optim.md``). This module compiles (once, cached by torch
in its own directory under ``TORCH_EXTENSIONS_DIR``, :func:`build_directory`) a C++ version of the two LAMB
stages of ``fp16kit/kernels/triton/lamb.py``:
the same math and the same order of fp32 operations, with 16384-element chunks of all tensors spread over
threads by OpenMP (one parallel region per stage). It needs a C++ compiler and ninja, so it is opt-in:

    FP16KIT_CPU_NATIVE=1            # environment, or
    fp16kit.kernels.fallback.lamb_native.enable()

Only contiguous fp32 params/grads/moments without a model copy take it; everything else (and every call
when it is not enabled, not built yet, or failed to build) goes to the torch path (``fallback/lamb.py``,
itself fast on the CPU: torch's fused Adam kernel does LAMB's stage 1). A set ``found_inf`` is read directly:
CPU tensors have no queue to drain.

Measured reason for this fourth copy of the LAMB math (``docs/benchmarks.md``): it does LAMB in 2 passes
(44 B/param) where torch ops need ~6 (~52 B/param). Two rules keep it safe to opt into:

- the build is cached under a name keyed by the CPU features it was compiled for (``-march=native``): a cache
  shared between machines (a network home, a container image) never loads code built for another CPU;
- ``FP16KIT_CPU_NATIVE=1`` builds in a background thread on first use (~60 s) and the steps meanwhile take the
  torch path, so no step stalls; ``enable()`` is the explicit call that waits for the build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from collections.abc import Sequence

import torch

from . import l2norm as fb_l2norm
from .step import Rows

__all__ = ["check_and_norm", "enable", "enabled", "lamb_", "takes"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// Loops see only local scalars and raw pointers: with lambda captures by reference the compiler must assume
// that the stores to m, v, p may change the hyper-parameters, reloads them every iteration and cannot hoist
// the mode branches out of the loop (measured: 2x slower). OpenMP shares variables by reference too, hence
// the firstprivate lists. Chunks are handed out dynamically: on a shared
// machine a statically split loop waits at its barrier for a descheduled thread.

namespace {
constexpr int64_t CHUNK = 16384;

struct Chunks {
  std::vector<int64_t> tensor, start, len;
};

// Chunks of every tensor, tensor by tensor, in order.
Chunks chunk_list(const std::vector<at::Tensor>& ts) {
  Chunks c;
  for (int64_t t = 0; t < (int64_t)ts.size(); ++t)
    for (int64_t s = 0; s < ts[t].numel(); s += CHUNK) {
      c.tensor.push_back(t);
      c.start.push_back(s);
      c.len.push_back(std::min(CHUNK, ts[t].numel() - s));
    }
  return c;
}

// torch's thread count, fewer for small lists (a parallel region costs more than a few chunks).
int threads(int64_t nc) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nc / 4)));
}

std::vector<float*> ptrs(const std::vector<at::Tensor>& ts) {
  std::vector<float*> out;
  for (auto& t : ts) out.push_back(t.data_ptr<float>());
  return out;
}
}  // namespace

// Sum of squares of g * inv_scale over every element (fp32 per chunk, chunks summed in order in double),
// and whether any scaled value is inf/NaN. Returns float32 [2] = {sumsq, nonfinite}.
at::Tensor check_norm_fp32(std::vector<at::Tensor> g, double inv_scale_d) {
  const float inv_scale = static_cast<float>(inv_scale_d);
  const Chunks ch = chunk_list(g);
  const int64_t nc = ch.tensor.size();
  std::vector<float> part(nc);
  std::vector<char> nonfinite(nc, 0);
  const std::vector<float*> G = ptrs(g);
  float* const* gp = G.data();
  const int64_t *ct = ch.tensor.data(), *cs = ch.start.data(), *cl = ch.len.data();
  float* partp = part.data();
  char* badp = nonfinite.data();
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads(nc)) \
    firstprivate(gp, ct, cs, cl, partp, badp, inv_scale)
  for (int64_t c = 0; c < nc; ++c) {
    {
      const float* x = gp[ct[c]] + cs[c];
      const int64_t len = cl[c];
      float acc = 0.f, amax = 0.f;
#pragma omp simd reduction(+ : acc) reduction(max : amax)
      for (int64_t i = 0; i < len; ++i) {
        const float y = x[i] * inv_scale;
        acc += y * y;
        amax = std::max(amax, std::fabs(y));
      }
      partp[c] = acc;
      // An inf shows in amax; a NaN is dropped by max() but makes the sum NaN (a sum of squares of
      // finite values may overflow to inf, never to NaN, so this has no false positives).
      badp[c] = !(amax < INFINITY) || (acc != acc);
    }
  }
  double total = 0.0;
  bool bad = false;
  for (int64_t c = 0; c < nc; ++c) { total += part[c]; bad |= nonfinite[c] != 0; }
  return at::tensor({static_cast<float>(total), bad ? 1.f : 0.f});
}

// hp = [lr, beta1, beta2, beta3, 1 - beta2, eps, weight_decay, bc1, bc2, inv_scale, clip] (float32).
// One parallel region per stage over the chunks of every tensor; stage 2 recomputes the update from the new
// m, v (as the GPU kernel does). (A region per tensor, to reuse the cache, was 2.4x slower on a loaded
// 2-core machine: its thread barriers wait for descheduled threads.)
void lamb_fp32(std::vector<at::Tensor> p, std::vector<at::Tensor> g, std::vector<at::Tensor> m,
               std::vector<at::Tensor> v, at::Tensor hp, bool l2_mode, bool decoupled, bool trust) {
  const float* h = hp.data_ptr<float>();
  const float lr = h[0], beta1 = h[1], beta2 = h[2], beta3 = h[3], omb2 = h[4], eps = h[5], wd = h[6];
  const float bc1 = h[7], bc2 = h[8], inv_scale = h[9], clip = h[10];
  // Divisions by the per-step constants become multiplications by their (correctly rounded) reciprocals:
  // on CPUs the divider limits this loop. Each costs at most one extra rounding (<= 1 ulp).
  const float rclip = 1.f / clip, rbc1 = 1.f / bc1, rbc2 = 1.f / bc2;
  // The modes enter as coefficients, not branches (gcc vectorizes only one of the unswitched copies of a
  // loop with branches): x * 1 and x + 0 * p are exact, so a disabled mode changes no bit.
  const float wd_l2 = l2_mode ? wd : 0.f, wd_decoupled = decoupled ? wd : 0.f;
  const Chunks ch = chunk_list(p);
  const int64_t nc = ch.tensor.size();
  const int64_t *ct = ch.tensor.data(), *cs = ch.start.data(), *cl = ch.len.data();
  const std::vector<float*> P = ptrs(p), G = ptrs(g), M = ptrs(m), V = ptrs(v);
  float* const* pp = P.data();
  float* const* gp = G.data();
  float* const* mp = M.data();
  float* const* vp = V.data();
  std::vector<float> usum(nc), psum(nc);
  float *usp = usum.data(), *psp = psum.data();
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads(nc)) \
    firstprivate(pp, gp, mp, vp, ct, cs, cl, usp, psp, inv_scale, rclip, wd_l2, wd_decoupled) \
    firstprivate(beta1, beta2, beta3, omb2, rbc1, rbc2, eps)
  for (int64_t c = 0; c < nc; ++c) {
    {
      const float* pc = pp[ct[c]] + cs[c];
      const float* gc = gp[ct[c]] + cs[c];
      float* mc = mp[ct[c]] + cs[c];
      float* vc = vp[ct[c]] + cs[c];
      const int64_t len = cl[c];
      float su = 0.f, sq = 0.f;
#pragma omp simd reduction(+ : su, sq)
      for (int64_t i = 0; i < len; ++i) {
        const float pi = pc[i];
        const float gi = gc[i] * inv_scale * rclip + wd_l2 * pi;
        const float mi = mc[i] * beta1 + beta3 * gi;
        const float vi = vc[i] * beta2 + omb2 * gi * gi;
        mc[i] = mi;
        vc[i] = vi;
        const float u = (mi * rbc1) / (std::sqrt(vi * rbc2) + eps) + wd_decoupled * pi;
        su += u * u;
        sq += pi * pi;
      }
      usp[c] = su;
      psp[c] = sq;
    }
  }
  std::vector<float> un(p.size(), 0.f), pn(p.size(), 0.f), ratio(p.size(), lr);
  for (int64_t c = 0; c < nc; ++c) { un[ct[c]] += usum[c]; pn[ct[c]] += psum[c]; }
  if (trust)
    for (size_t t = 0; t < p.size(); ++t) {
      const float a = std::sqrt(pn[t]), b = std::sqrt(un[t]);
      if (a != 0.f && b != 0.f) ratio[t] = lr * (a / b);
    }
  const float* rp = ratio.data();
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads(nc)) \
    firstprivate(pp, mp, vp, ct, cs, cl, rp, rbc1, rbc2, eps, wd_decoupled)
  for (int64_t c = 0; c < nc; ++c) {
    {
      float* pc = pp[ct[c]] + cs[c];
      const float* mc = mp[ct[c]] + cs[c];
      const float* vc = vp[ct[c]] + cs[c];
      const int64_t len = cl[c];
      const float r = rp[ct[c]];
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        const float pi = pc[i];
        const float u = (mc[i] * rbc1) / (std::sqrt(vc[i] * rbc2) + eps) + wd_decoupled * pi;
        pc[i] = pi - r * u;
      }
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("check_norm_fp32", &check_norm_fp32);
  mod.def("lamb_fp32", &lamb_fp32);
}
"""

_module = None
_state = {"enabled": os.environ.get("FP16KIT_CPU_NATIVE", "0").strip().lower() in ("1", "true", "yes", "on")}
_lock = threading.Lock()
_build: dict[str, object] = {"thread": None, "error": None}


def cpu_features() -> str:
    """A stable description of the CPU features ``-march=native`` compiles for: the machine, the CPU model
    and the sorted instruction-set flags of ``/proc/cpuinfo`` (Linux), else ``platform.processor()``."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{platform.machine()}|{model or platform.processor()}|{flags}"


def build_name() -> str:
    """The extension's cache name: source version plus a hash of :func:`cpu_features`."""
    return "fp16kit_cpu_lamb_v15_" + hashlib.sha1(cpu_features().encode()).hexdigest()[:12]


def build_directory() -> str:
    """The extension's own build directory, ``<root>/fp16kit/<build_name()>`` (created on demand): ``root`` is
    ``TORCH_EXTENSIONS_DIR`` or torch's default, shared with every other extension; the private subdirectory
    keeps fp16kit's sources, objects and lock file out of theirs (and theirs out of ours)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    path = os.path.join(root, "fp16kit", build_name())
    os.makedirs(path, exist_ok=True)
    return path


def enable(on: bool = True) -> bool:
    """Switch the native CPU LAMB on (building it now, and waiting, if needed); returns whether it is usable."""
    _state["enabled"] = on
    if not on:
        return False
    _start_build()
    thread = _build["thread"]
    if isinstance(thread, threading.Thread):
        thread.join()
    return _ready()


def enabled() -> bool:
    """Whether the native kernel is enabled and built (starts the background build when enabled; never waits)."""
    if not _state["enabled"]:
        return False
    _start_build()
    return _ready()


def _ready() -> bool:
    if _build["error"] is not None:  # report a failed background build once, from the caller's thread
        exc, _build["error"] = _build["error"], None
        warnings.warn(f"fp16kit: native CPU LAMB unavailable ({exc}); using the torch path.", stacklevel=3)
        _state["enabled"] = False
    return bool(_state["enabled"]) and _module is not None


def _start_build() -> None:
    with _lock:
        if _module is not None or _build["thread"] is not None:
            return
        _build["thread"] = threading.Thread(target=_compile, name="fp16kit-cpu-native-build", daemon=True)
        _build["thread"].start()


def _compile() -> None:
    global _module
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(
            name=build_name(),
            build_directory=build_directory(),
            cpp_sources=_SOURCE,
            extra_cflags=["-O3", "-fno-math-errno", "-fopenmp", "-march=native"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler / ninja: stay on the torch path (reported by _ready)
        _build["error"] = exc


def _load():
    return _module


def takes(rows: Rows) -> bool:
    """Whether this row group (:data:`fp16kit.kernels.fallback.step.Rows`) can run natively: enabled, CPU, contiguous
    fp32 everywhere, no model copies."""
    *lists, models = rows
    if not _state["enabled"] or not lists[0] or lists[0][0].device.type != "cpu":
        return False
    if any(m is not None for m in models):
        return False
    return all(t.dtype == torch.float32 and t.is_contiguous() for lst in lists for t in lst) and enabled()


def lamb_(rows: Rows, hp32: torch.Tensor, found_inf: torch.Tensor, *, l2_mode: bool, decoupled: bool,
          trust: bool) -> None:
    """Both LAMB stages natively over ``rows`` (the caller checked :func:`takes`: no model copies); nothing happens
    when found_inf is set."""
    if bool(found_inf.reshape(()) != 0):
        return
    _load().lamb_fp32(*(list(x) for x in rows[:4]), hp32.contiguous(), l2_mode, decoupled, trust)


def takes_grads(grads: Sequence[torch.Tensor]) -> bool:
    """Whether the check-and-norm pass can run natively: enabled, CPU, contiguous fp32 grads."""
    if not _state["enabled"] or not grads or grads[0].device.type != "cpu":
        return False
    return all(g.dtype == torch.float32 and g.is_contiguous() for g in grads) and enabled()


def check_and_norm(grads: Sequence[torch.Tensor], inv_scale64: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
    """Global L2 norm of ``grads * inv_scale`` (0-dim fp32) in one read, raising ``found_inf`` on inf/NaN."""
    out = _load().check_norm_fp32(list(grads), float(inv_scale64.reshape(())))
    norm = out[0].sqrt()
    if float(out[1]) == 0 and not (2.0**-60 <= float(norm) < float("inf")):
        # The fp32 chunk sums over- or underflowed (a norm above ~1.8e19, or squares below fp32's range):
        # redo this step's norm with the torch fallback, which repairs such tensors in float64. Rare, and
        # reading CPU values back costs nothing.
        return fb_l2norm.check_and_norm(grads, inv_scale64, found_inf)
    flag = found_inf.reshape(1)
    torch.maximum(flag, out[1:2], out=flag)
    return norm
