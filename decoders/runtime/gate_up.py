"""Each MLP's gate and up weights moved into one buffer [2I, H], so the runtime can run one GEMM.

The model's ``gate_proj.weight`` and ``up_proj.weight`` stay the same Parameter objects with the
same values, shapes and strides; only their storage moves: they become the two halves of one new
contiguous buffer (gate rows first). No memory is added (the old storage is freed), and HF's own
forward, the control's, runs its own ops on the same values. The up half starts I*H elements into
the buffer; the buffer is made only where that offset is a multiple of ``ALIGN_BYTES`` (the CUDA
caching allocator's own granularity), so each half is aligned as a fresh allocation is and a
library picks its kernel for either weight as before.

The layout is the model's, not a runtime's: every runtime built on the model finds the buffer the
first one made (whatever it decides about the GEMM, see ``Calibration.gate_up``), so no runtime's
CUDA graphs ever read a storage another one freed. It is made before any graph is captured.
"""
from __future__ import annotations

import torch

ALIGN_BYTES = 512


def stack_gate_up(lm) -> dict[int, torch.Tensor]:
    """Layer index -> the [2I, H] buffer that layer's gate and up weights are views of, for every
    decoder layer whose MLP can be stacked (made on the first call, found on later ones)."""
    out, moved = {}, False
    for idx, layer in enumerate(lm.model.layers):
        weight = stacked_weight(layer.mlp)
        if weight is None and stackable(layer.mlp):
            weight, moved = move_into_one_buffer(layer.mlp), True
        if weight is not None:
            out[idx] = weight
    if moved and next(iter(out.values())).device.type == "cuda":
        torch.cuda.empty_cache()  # the old weights' blocks, now free, go back to the device
    return out


def stackable(mlp) -> bool:
    """Two plain bias-free Linears (whose forward is ``F.linear(x, weight)``) of one shape, dtype
    and device, with contiguous weights, whose stacked buffer would start the up half on an
    ``ALIGN_BYTES`` boundary."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not all(type(m) is torch.nn.Linear and m.bias is None and type(m.weight) is torch.nn.Parameter
               for m in (gate, up)):
        return False
    g, u = gate.weight, up.weight
    return (g.shape == u.shape and g.dtype == u.dtype and g.device == u.device and g.device.type != "meta"
            and g.is_contiguous() and u.is_contiguous() and g.numel() * g.element_size() % ALIGN_BYTES == 0)


def stacked_weight(mlp) -> torch.Tensor | None:
    """The [2I, H] buffer if the gate and up weights already are its two halves, else None."""
    if not stackable(mlp):
        return None
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    same = g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
    if not (same and g.storage_offset() == 0 and u.storage_offset() == g.numel()):
        return None
    n, k = g.shape
    return g.detach().as_strided((2 * n, k), (k, 1), 0)


def move_into_one_buffer(mlp) -> torch.Tensor:
    """Copy both weights into one new buffer and point each Parameter at its half (``.data``:
    the Parameter objects, their values and requires_grad stay). The buffer is an inference tensor
    exactly when the weights are (a model loaded under ``torch.inference_mode``), whatever mode
    the caller is in: ordinary weights stay usable under autograd, and an inference Parameter
    pointed at an ordinary tensor could no longer run a forward."""
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    n = g.shape[0]
    with torch.inference_mode(g.is_inference()), torch.no_grad():
        buf = torch.empty((2 * n, g.shape[1]), dtype=g.dtype, device=g.device)
        buf[:n].copy_(g)
        buf[n:].copy_(u)
        g.data = buf[:n]
        u.data = buf[n:]
    return buf.detach()
