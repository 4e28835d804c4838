"""Triton kernels for the small element-wise parts of a CUDA step: RMSNorm (with the residual add),
rotary embedding of q and k, and SiLU(gate) * up.

Written out in torch, these are about 40 kernels per layer (casts, powers, means, slices, a concat),
each a few microseconds of launch and memory traffic: more than the weight reads of a batch-1 decode
step on a GPU (an H200 decoded a Llama-3-8B shape at 52% of its bandwidth bound with them). Here each is
one kernel. Each computes what the torch code of ``models/llama.py`` and ``layers/rotary.py`` computes,
in the same order and the same roundings (float32 math, rounded to the model's dtype where torch
rounds), so a model gives the same tokens either way. The model runner turns them on for CUDA after
``self_check`` (the same shapes, against the torch code) passes; otherwise the torch code runs.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn.functional as F

from cachegw.backend.executor.layers.triton_attention import triton, triton_available

log = logging.getLogger(__name__)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        out_ptr,
        res_out_ptr,
        w_ptr,
        stride_x,
        stride_res,
        stride_out,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # x + residual, rounded to the model's dtype as torch's add is: the next residual
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
        h = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        normed = (h * inv).to(x.dtype).to(tl.float32)  # Llama rounds the normalized row, then scales it
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # torch rounds silu's output
        tl.store(out_ptr + row * n_cols + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        out_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        stride_xt,
        stride_xh,
        num_heads,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        mask = cols < HALF
        pos = tl.load(pos_ptr + token)
        cos = tl.load(cos_ptr + pos * HALF + cols, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos * HALF + cols, mask=mask, other=0.0)
        src = x_ptr + token * stride_xt + head * stride_xh
        x1 = tl.load(src + cols, mask=mask, other=0.0)
        x2 = tl.load(src + HALF + cols, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        dst = out_ptr + (token * num_heads + head) * (2 * HALF)
        tl.store(dst + cols, (a * cos - b * sin).to(x1.dtype), mask=mask)
        tl.store(dst + HALF + cols, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` of rows ``[n, hidden]`` (unit column stride): the normalized rows, and with a
    residual also ``x + residual`` (the next residual)."""
    n, cols = x.shape
    out = torch.empty((n, cols), dtype=torch.result_type(weight, x), device=x.device)
    res_out = torch.empty((n, cols), dtype=x.dtype, device=x.device) if residual is not None else out
    res = residual if residual is not None else x
    _rms_norm_kernel[(n,)](
        x, res, out, res_out, weight, x.stride(0), res.stride(0), out.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols), num_warps=_warps(cols),
    )  # fmt: skip
    return out if residual is None else (out, res_out)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of ``[n, 2 * intermediate]`` rows (gate first, as ``gate_up_proj`` stores them)."""
    n, width = x.shape
    cols = width // 2
    out = torch.empty((n, cols), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(cols))
    _silu_mul_kernel[(n, triton.cdiv(cols, block))](x, out, x.stride(0), cols, BLOCK=block, num_warps=4)
    return out


def rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[n, heads, head_dim]`` (head_dim stride 1) rotated by ``positions``: a new contiguous tensor."""
    n, heads, dim = x.shape
    out = torch.empty((n, heads, dim), dtype=x.dtype, device=x.device)
    half = dim // 2
    _rotary_kernel[(n, heads)](
        x, out, positions, cos, sin, x.stride(0), x.stride(1), heads,
        HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
    )  # fmt: skip
    return out


def _warps(cols: int) -> int:
    return 1 if cols <= 256 else 4 if cols <= 2048 else 8


def enable(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Turn the kernels on in ``model``'s Llama-style norms, SiLU MLPs and rotaries, after each passed
    ``self_check`` on the model's first module of its kind. False (torch code everywhere) otherwise."""
    from cachegw.backend.executor.layers.rotary import RotaryEmbedding
    from cachegw.backend.executor.models.llama import LlamaMLP, RMSNorm

    if not triton_available():
        return False
    kinds: dict[type, list[torch.nn.Module]] = {RMSNorm: [], LlamaMLP: [], RotaryEmbedding: []}
    for module in model.modules():
        if type(module) in kinds and (not isinstance(module, LlamaMLP) or module.act is F.silu):
            kinds[type(module)].append(module)
    try:
        with torch.no_grad():
            ok = all(self_check(found[0], device, dtype) for found in kinds.values() if found)
    except Exception:
        log.exception("the fused Triton norm/rotary/SiLU kernels failed their self-check: not used")
        return False
    if not ok:
        log.warning("the fused Triton norm/rotary/SiLU kernels differ from torch's: not used")
        return False
    for found in kinds.values():
        for module in found:
            module.triton = True  # type: ignore[assignment]
    return any(kinds.values())


def self_check(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """One module's kernel against its torch code on its own shapes, 1 and 5 rows: equal within one
    rounding or two of ``dtype`` (sums may be taken in another order; Triton's CPU interpreter, which
    the tests use, truncates where a GPU rounds)."""
    from cachegw.backend.executor.layers.rotary import RotaryEmbedding
    from cachegw.backend.executor.models.llama import LlamaMLP, RMSNorm

    g = torch.Generator(device=device).manual_seed(0)
    tol = 0.0 if dtype == torch.float32 else 2.0**-6  # a few units in the last place

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)

    for n in (1, 5):
        if isinstance(module, RMSNorm):
            x, r = rand(n, module.weight.shape[0]), rand(n, module.weight.shape[0])
            want, want_r = module(x, r)
            got, got_r = rms_norm(x, r, module.weight, module.eps)
            ok = _close(got, want, tol) and _close(got_r, want_r, tol)
            alone = rms_norm(x, None, module.weight, module.eps)
            ok = ok and _close(cast(torch.Tensor, alone), module(x), tol)
        elif isinstance(module, LlamaMLP):
            gu = rand(n, module.gate_up_proj.out_features)
            gate, up = gu.chunk(2, dim=-1)
            ok = _close(silu_mul(gu), module.act(gate) * up, tol)
        else:
            assert isinstance(module, RotaryEmbedding)
            q = rand(n, 3, 2 * module.cos.shape[1])[:, 1:]  # a strided view, as split q/k are
            pos = torch.randint(0, module.cos.shape[0], (n,), device=device, generator=g)
            ok = _close(rotate(q, pos, module.cos, module.sin), module.rotate(pos, q), tol)
        if not ok:
            return False
    return True


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Within ``tol`` relative (and 1e-5 absolute) of the torch result; float32 within 1e-5 relative."""
    rel = max(tol, 1e-5)
    return got.shape == want.shape and bool(
        torch.allclose(got.float(), want.float(), rtol=rel, atol=1e-5 if tol == 0 else rel)
    )
