"""RMSNorm with a replicated DTensor weight (drop-in for the HF Llama/Qwen/Mistral RMSNorm)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from reshard import empty_dtensor
from reshard.layers._base import Redistributable, Targets, local_tensor


class RMSNorm(Redistributable, nn.Module):
    """``w * x / rms(x)`` over the last dim, computed in fp32 exactly as HF does.

    The weight is Replicate() on ``mesh``; input and output have the same placements.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        mesh: DeviceMesh,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(
            empty_dtensor((hidden_size,), mesh, [Replicate()] * mesh.ndim, dtype=dtype, device=device)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """HF's arithmetic, op for op (so bit for bit), with no op where a cast is to its own dtype."""
        input_dtype = hidden_states.dtype
        x = hidden_states if input_dtype == torch.float32 else hidden_states.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * variance.add_(self.variance_epsilon).rsqrt_()  # (the fresh mean, in place)
        return local_tensor(self.weight) * (x if input_dtype == torch.float32 else x.to(input_dtype))

    def redistribute_targets(self, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Targets:
        """The (small) weight takes ``placements``; the forward needs it whole (Replicate)."""
        return {"weight": (mesh, placements)}

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
