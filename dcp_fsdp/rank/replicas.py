"""Loads with replicas (model.replicas > 1, HSDP): every replica reads (R x the egress), or
replica 0 reads and broadcasts along the mesh's "replicate" dimension (`read_once_load`: only
public API; torch's cooperative load planner is in none of the releases supported). Both
steps are inside the caller's timer: the broadcast is part of what the load costs.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dcp_fsdp.models.build import REPLICATE_DIM, SHARD_DIM, local_tensor, unique_shards
from dcp_fsdp.models.tensor_parallel import TP_DIM
from dcp_fsdp.rank.device import sync_device
from dcp_fsdp.rank.state import flat_tensors


def replica_share(nbytes: int, replicas: int, replica: int) -> int:
    """This replica's share of `nbytes` every replica holds: over replicas 0..R-1 they sum to it."""
    return nbytes * (replica + 1) // replicas - nbytes * replica // replicas


def held_bytes(state_dict: dict[str, Any], mesh: DeviceMesh | None) -> int:
    """Bytes of this rank's shards, split so that over all ranks they sum to the checkpoint's
    state bytes: a shard every TP rank holds whole (FSDP alone shards the norms, embeddings and
    head: no "tp" in their mesh) counts 1/tp on each; a plain tensor (AdamW's step scalars),
    on every rank and written once, is split over the ranks of a replica."""
    tp, tp_rank = 1, 0
    if mesh is not None and TP_DIM in (mesh.mesh_dim_names or ()):
        tp, tp_rank = mesh[TP_DIM].size(), mesh.get_local_rank(TP_DIM)
    total = everywhere = 0
    for tensor in flat_tensors(state_dict).values():
        nbytes = local_tensor(tensor).nbytes
        if not isinstance(tensor, DTensor):
            everywhere += nbytes
        elif TP_DIM not in (tensor.device_mesh.mesh_dim_names or ()):  # whole on every TP rank
            total += replica_share(nbytes, tp, tp_rank)
        else:
            total += nbytes
    return total + replica_share(everywhere, *_place_in_replica(mesh))


def _place_in_replica(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(ranks in a replica, this rank's place among them): every mesh dimension but
    "replicate" (replica_share splits over the replicas), row-major; (1, 0) without a mesh."""
    if mesh is None:
        return 1, 0
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    size, place = 1, 0
    for name, extent, index in zip(names, mesh.shape, coordinate):
        if name != REPLICATE_DIM:
            size, place = size * extent, place * extent + index
    return size, place


def read_once_load(state_dict: dict[str, Any], storage_reader: StorageReader | None, mesh: DeviceMesh,
                   replica: int, device: torch.device | None = None,
                   host_group: dist.ProcessGroup | None = None,
                   load_group: dist.ProcessGroup | None = None) -> float:
    """Replica 0 loads from storage, then the replicate dimension broadcasts what it read. The
    seconds this rank spent in the broadcast, `device` synchronized at both ends."""
    if replica == 0:
        # with model.tp replica 0 spans (shard, tp): `load_group` holds its ranks
        dcp.load(state_dict, storage_reader=storage_reader,
                 process_group=load_group if load_group is not None else mesh.get_group(SHARD_DIM))
    sync_device(device)  # the load's copies are not the broadcast's
    started = time.monotonic()
    broadcast_from_first_replica(state_dict, mesh.get_group(REPLICATE_DIM), host_group)
    sync_device(device)  # NCCL: wait() returns before the copy has landed
    return time.monotonic() - started


def broadcast_from_first_replica(state_dict: dict[str, Any], group: dist.ProcessGroup,
                                 host_group: dist.ProcessGroup | None = None) -> None:
    """Every local shard (each storage once) from the group's first rank to the others, in key
    order, all issued before any is waited on. `host_group` (gloo over the same ranks) carries
    the CPU tensors (AdamW's `step`), which NCCL refuses."""
    source = dist.get_global_rank(group, 0)
    pending = []
    for _, local, _, _ in unique_shards(state_dict):
        over = host_group if host_group is not None and local.device.type == "cpu" else group
        # a collective needs a contiguous buffer; FSDP2's dim-0 shards are, but keep any
        # other layout correct (receivers copy the result back into the live tensor)
        buffer = local.contiguous()  # `local` itself where it already is
        pending.append((local, buffer, dist.broadcast(buffer, src=source, group=over,
                                                      async_op=True)))
    for local, buffer, work in pending:
        work.wait()
        if buffer is not local:
            with torch.no_grad():
                local.copy_(buffer)
