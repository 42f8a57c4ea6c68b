"""vLLM's weight transfer from the trainer's side: the IPC payload of an in-memory load, and the
NCCL sender (rank 0 of vLLM's own trainer group) for distributed loads.

Both follow ``vllm==0.26.0``'s ``vllm/distributed/weight_transfer/{ipc_engine,nccl_engine,
nccl_common}.py`` (what ``IPCWeightTransferEngine.trainer_send_weights`` and
``NCCLWeightTransferEngine.trainer_send_weights`` do), and import torch (and, for NCCL, vLLM) only
when called: the GPU side's, never the CPU CI's.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Sequence
from typing import Any

from rollout_backends import InvalidRequest, WeightBucket

__all__ = ["VllmNcclSender", "ipc_update_info"]


def ipc_update_info(items: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``update_info`` for ``POST /update_weights`` on a server with ``--weight-transfer-config
    '{"backend": "ipc"}'`` (and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the pickled handles
    need): per tensor its name, dtype name and shape, and a CUDA IPC handle keyed by the GPU's UUID
    (the server opens the handle of the GPU it runs on: the tensors must live on its GPU).

    The handles keep no storage alive: the caller keeps the tensors until the load returned."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    handles: list[dict[str, Any]] = []
    for i, (name, tensor) in enumerate(items):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda or not tensor.is_contiguous():
            raise InvalidRequest(f"named_tensors[{i}]", "vLLM's IPC transfer takes contiguous CUDA tensors")
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
        names.append(name)
        dtypes.append(str(tensor.dtype).split(".")[-1])
        shapes.append(list(tensor.shape))
        handles.append({uuid: reduce_tensor(tensor.detach())[1]})  # type: ignore[no-untyped-call]
    pickled = base64.b64encode(pickle.dumps(handles)).decode("ascii")
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, "ipc_handles_pickled": pickled}


class VllmNcclSender:
    """The trainer (rank 0) of vLLM's NCCL weight-transfer group (a ``conformance.WeightSender``).

    vLLM's group is not a torch.distributed one: both sides join a ``StatelessProcessGroup``
    (a TCP store at ``master_address:master_port``) and broadcast with vLLM's ``PyNcclCommunicator``
    (``nccl_common.trainer_init``), so the sender needs vLLM installed next to the trainer."""

    def __init__(self, master_address: str, master_port: int, world_size: int, *, device: str = "cuda:0") -> None:
        self.master_address, self.master_port, self.world_size = master_address, master_port, world_size
        #: The trainer's GPU (each rank of the group needs its own: not an engine's).
        self.device = device
        self._group: Any = None

    def connect(self) -> None:
        import torch
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        info = {"master_address": self.master_address, "master_port": self.master_port, "world_size": self.world_size}
        with torch.cuda.device(self.device):  # trainer_init takes the current device (called from a thread)
            self._group = trainer_init(info)

    def broadcast(self, named_tensors: Sequence[tuple[str, Any]]) -> WeightBucket:
        import torch
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        if self._group is None:
            raise RuntimeError("connect() first")
        with torch.cuda.device(self.device):
            named = [(n, t.to(self.device)) for n, t in named_tensors]
            bucket = WeightBucket.from_named_tensors(named)
            NCCLWeightTransferEngine.trainer_send_weights(iter(named), {"group": self._group, "packed": False})
            torch.cuda.synchronize(self.device)
        return bucket

    def close(self) -> None:
        self._group = None
