"""Expert parallelism and the batched layout of a layer: the kernel of an expert-parallel call and
:class:`LayerParallel`, which builds the kernels of a :class:`~fusedmoe.layer.FusedMoE` that runs them.

The collectives they run over, :class:`~fusedmoe.transport.Transport` and its ``torch.distributed``
implementation :class:`~fusedmoe.transport.TorchDistributedTransport`, live in :mod:`fusedmoe.transport`, below
both this module and :mod:`fusedmoe.prepare_finalize.all_to_all`; they are importable from here too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .experts.base import ExpertsInputs
from .kernel import MoEKernel
from .prepare_finalize.all_to_all import AllToAllPrepareFinalize, contiguous_expert_map
from .prepare_finalize.batched import BatchedPrepareFinalize
from .problem import Layout, MoEProblem
from .transport import TorchDistributedTransport, Transport


class ExpertParallelKernel(MoEKernel):
    """A :class:`MoEKernel` whose prepare/finalize exchanges tokens between ranks.

    Unlike the single-rank kernel it runs prepare and finalize even when this rank has no tokens (M = 0): the
    other ranks may send it rows, and every rank must take part in every collective.
    """

    skip_empty = False

    def __call__(self, x: ExpertsInputs, p: MoEProblem, *, workspace13=None, workspace2=None, **kwargs) -> torch.Tensor:
        """:meth:`MoEKernel.__call__` (same keywords) with scratch from the manager only."""
        if workspace13 is not None or workspace2 is not None:
            raise ValueError("expert parallelism takes its scratch from a WorkspaceManager, not caller tensors")
        return super().__call__(x, p, **kwargs)


__all__ = ["ExpertParallelKernel", "TorchDistributedTransport", "Transport"]


class LayerParallel:
    """How a :class:`~fusedmoe.layer.FusedMoE` runs when it is expert-parallel or uses the batched layout.

    Built by the layer from ``ep_group`` (a ``torch.distributed`` group, or any :class:`Transport`), ``layout``
    ("standard" | "batched"), ``max_tokens_per_rank`` and ``max_tokens_per_expert``. Rank r of W keeps the
    experts ``[r * E / W, (r + 1) * E / W)``. Without a configured ``max_tokens_per_rank`` every forward first
    max-reduces M over the ranks (one small collective) and rounds it up to a power of two, so the receive
    buffers and plans are reused across nearby batch sizes.
    """

    def __init__(
        self,
        num_experts: int,
        ep_group=None,
        layout: str = "standard",
        max_tokens_per_rank: int | None = None,
        max_tokens_per_expert: int | None = None,
    ):
        try:
            self.layout = Layout(layout)
        except ValueError:
            raise ValueError(f"layout must be 'standard' or 'batched', got {layout!r}") from None
        if ep_group is None:
            self.transport = None
        elif isinstance(ep_group, Transport) and not isinstance(ep_group, dist.ProcessGroup):
            self.transport = ep_group
        else:
            self.transport = TorchDistributedTransport(ep_group)
        self.world = self.transport.world_size if self.transport is not None else 1
        self.rank = self.transport.rank if self.transport is not None else 0
        if num_experts % self.world:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the expert-parallel world size {self.world}"
            )
        for name, v in (("max_tokens_per_rank", max_tokens_per_rank), ("max_tokens_per_expert", max_tokens_per_expert)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.max_tokens_per_rank = max_tokens_per_rank
        self.max_tokens_per_expert = max_tokens_per_expert
        self._kernels: dict[tuple, MoEKernel] = {}

    def expert_map(self, device=None) -> torch.Tensor | None:
        if self.transport is None:
            return None
        return contiguous_expert_map(self.num_experts, self.rank, self.world, device)

    def kernel(self, backend: str, cap: int) -> MoEKernel:
        key = (backend, cap)
        k = self._kernels.get(key)
        if k is None:
            if self.layout == Layout.BATCHED:
                if backend == "triton":
                    from .experts.batched_triton_experts import BatchedTritonExperts

                    experts = BatchedTritonExperts()
                else:
                    from .experts.batched_torch_experts import BatchedTorchExperts

                    experts = BatchedTorchExperts()
            else:
                from .api import get_kernel

                experts = get_kernel(backend).experts
            if self.transport is None:
                k = MoEKernel(BatchedPrepareFinalize(self.max_tokens_per_expert), experts)
            else:
                k = ExpertParallelKernel(
                    AllToAllPrepareFinalize(
                        self.transport,
                        self.num_experts,
                        cap,
                        layout=self.layout,
                        max_tokens_per_expert=self.max_tokens_per_expert,
                    ),
                    experts,
                )
            if len(self._kernels) > 64:
                self._kernels.clear()
            self._kernels[key] = k
        return k

    def cap(self, num_tokens: int, device: torch.device, collective: bool = True) -> int:
        """The static bound on tokens per rank for this call."""
        if self.transport is None:
            return 0
        if self.max_tokens_per_rank is not None:
            return self.max_tokens_per_rank
        m = self.transport.max_int(num_tokens, device) if collective else num_tokens
        return 1 << max(0, (max(m, 1) - 1).bit_length())

    def plan(self, layer, num_tokens: int, dtype=None):
        from .api import resolve_backend

        backend = resolve_backend(layer.backend, layer.w1.device)
        cap = self.cap(num_tokens, layer.w1.device, collective=False)
        return self.kernel(backend, cap).plan(layer.problem(num_tokens, dtype))

    @property
    def static(self) -> bool:
        """Whether the kernel of a problem is fixed (no per-call collective sizes it), so a layer may cache it."""
        return self.transport is None or self.max_tokens_per_rank is not None

    def kernel_for(self, layer, p, device: torch.device) -> MoEKernel:
        """The kernel that runs the layer's validated problem ``p`` (one max-reduce over the ranks first when
        ``max_tokens_per_rank`` is not configured). Raises ValueError when its experts cannot run ``p``."""
        from .api import resolve_backend

        kernel = self.kernel(resolve_backend(layer.backend, device), self.cap(p.M, device))
        reason = kernel.experts.supports(kernel.prepare_finalize.problem(p))
        if reason is not None:
            raise ValueError(f"backend {kernel.experts.name!r} cannot run this problem: {reason}")
        return kernel


__all__ += ["LayerParallel"]
