"""The collective interface of expert parallelism, and its ``torch.distributed`` implementation.

:class:`Transport` is all the EP path needs from a communication library: exchange per-rank counts (the
receiver learns how many rows each source sends), one variable-split all-to-all, and a max-reduce of a host
integer (to size receive buffers when no static bound is configured). :class:`TorchDistributedTransport`
implements it with ``torch.distributed`` (NCCL on GPUs, gloo on CPU: both support uneven and empty splits in
``all_to_all_single``). A transport with device-side splits (torchcomms' ``device_alltoallv_single``) or
NVSHMEM could implement the same methods and keep the count exchange on the device.

Host synchronization: ``all_to_all_single`` takes its splits as host lists, so ``exchange_counts`` reads the
counts on the host (one D2H sync per dispatch) and the EP path over ``torch.distributed`` is not CUDA-graph
capturable (``ProcessGroupNCCL`` collectives also cannot be replayed safely). That is inherent to this transport,
not to the prepare/finalize logic.

Imported by :mod:`fusedmoe.prepare_finalize.all_to_all` (which runs over a transport) and by
:mod:`fusedmoe.distributed` (which builds one for a layer), and re-exported there.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Transport(Protocol):
    """What expert parallelism needs from a communication backend."""

    rank: int
    world_size: int

    def exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """``send_counts``: int64 [world] on the data's device (rows this rank sends to each rank).
        Returns (send counts, receive counts) as host lists (receive[r] = rows rank r sends here)."""
        ...

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> None:
        """Send ``input`` rows split by ``send_splits`` (to ranks 0..world-1), receive into ``output`` rows
        split by ``recv_splits``. Both contiguous; splits may be zero."""
        ...

    def max_int(self, value: int, device: torch.device) -> int:
        """The maximum of ``value`` over all ranks."""
        ...


class TorchDistributedTransport:
    """:class:`Transport` over a ``torch.distributed`` process group (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"TorchDistributedTransport(rank={self.rank}, world_size={self.world_size})"

    def exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        both = torch.empty((2, self.world_size), dtype=torch.int64, device=send_counts.device)
        both[0].copy_(send_counts)
        dist.all_to_all_single(both[1], both[0], group=self.group)
        send, recv = both.tolist()  # the host sync of this transport
        return send, recv

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, send_splits: list[int], recv_splits: list[int]
    ) -> None:
        if input.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bool):  # not every backend has them
            input, output = input.view(torch.uint8), output.view(torch.uint8)
        dist.all_to_all_single(
            output, input, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=self.group
        )

    def max_int(self, value: int, device: torch.device) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())


__all__ = ["TorchDistributedTransport", "Transport"]
