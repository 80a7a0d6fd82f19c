"""`expert_fingerprint`: a digest of every byte the kernel reads for one expert row."""

from __future__ import annotations

import ctypes
import hashlib

import torch

from ascend_eplb.quant_views._storage import ExpertStorage
from ascend_eplb.quant_views._validate import is_int

__all__ = ["expert_fingerprint"]


def expert_fingerprint(storage: ExpertStorage, local_row: int) -> str:
    """BLAKE2b-128 hex digest of local row ``local_row`` of every kernel tensor of ``storage``.

    Reads the kernel tensors, never the weight views (a tensor the views forget then shows as unmoved):
    per tensor, in order, its name and the row's bytes in logical element order. dtype and shape are not
    hashed (stacked int32 and per-expert int8 W4A8 storages agree); unread tensors are excluded.
    Returns 32 hex characters, equal iff every row is byte-identical (up to collisions); ``IndexError``
    for ``local_row`` outside ``[0, p)``.
    """
    if not is_int(local_row):
        raise IndexError(f"local_row must be an int, got {local_row!r}")
    digest = hashlib.blake2b(digest_size=16)
    for name in storage.kernel_tensors:
        row = storage.expert_tensors(name, local_row)
        data = row.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        digest.update(name.encode())
        digest.update(len(data).to_bytes(8, "little"))
        # The row's bytes straight from its (contiguous, CPU) memory: this package needs no numpy.
        digest.update(ctypes.string_at(data.data_ptr(), data.numel()))
    return digest.hexdigest()
