"""The CPU kernel of the map-and-record ops: one fused pass in C, compiled once per host.

On CPU the device-neutral torch form of ``map_to_physical_and_record`` costs several elementwise
passes over ``(T, K)`` plus an ``index_add_``, each a separate ATen call; this kernel does the
range check, the table gather, the ``-1`` fill and the masked count in one loop, reading the record
flag and the unpadded token count from their (CPU) tensors inside the kernel, like any device
kernel reads its scalar arguments: no Python-side read, no data-dependent shape.

The C source below is compiled with the host C compiler (``$CC``, else ``cc``/``gcc``) on first
use into ``$ASCEND_EPLB_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ascend_eplb`` or
``~/.cache/ascend_eplb``), named by the hash of source and flags, and loaded with ``ctypes`` (as
torch inductor builds its CPU kernels). Without a compiler, :func:`load` returns ``None`` and the
ops keep their device-neutral torch form on CPU too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["CpuKernel", "load"]

_LOG = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 64 /* tokens mapped before their block is counted: the block's ids stay in L1 */

/* out[t, k] = table[t % rows, ids[t, k]] for ids in [0, E), else -1. When *record, the entries of
   out in rows t < n that lie in [0, P) (so never a -1) are counted block by block, in 4 private
   histograms (neighbouring increments of one bin do not wait on each other), added to load. */
#define MAP_AND_RECORD(NAME, ID_T, LOAD_T)                                                      \
void NAME(const ID_T* restrict ids, int64_t num_tokens, int64_t top_k,                           \
          const int32_t* restrict table, int64_t rows, int64_t num_experts, int64_t row_stride,  \
          int64_t col_stride, ID_T* restrict out, LOAD_T* restrict load, int64_t num_physical,   \
          int64_t load_stride, const uint8_t* restrict record, const void* restrict unpadded,    \
          int unpadded_is_int64) {                                                               \
    int64_t counted = 0;                                                                         \
    uint32_t* hist = 0;                                                                          \
    if (load && *record && num_physical > 0) {                                                   \
        counted = unpadded_is_int64 ? *(const int64_t*)unpadded                                  \
                                    : (int64_t)*(const int32_t*)unpadded;                        \
        if (counted > num_tokens) counted = num_tokens;                                          \
        if (counted > 0) hist = (uint32_t*)calloc(4 * (size_t)num_physical, sizeof(uint32_t));   \
        if (!hist) counted = 0;                                                                  \
    }                                                                                            \
    const uint64_t bins = (uint64_t)num_physical;                                                \
    int64_t row = 0;                                                                             \
    for (int64_t t0 = 0; t0 < num_tokens; t0 += BLOCK) {                                         \
        const int64_t t1 = t0 + BLOCK < num_tokens ? t0 + BLOCK : num_tokens;                    \
        for (int64_t t = t0; t < t1; ++t) {                                                      \
            const int32_t* restrict table_row = table + row * row_stride;                        \
            for (int64_t k = 0; k < top_k; ++k) {                                                \
                const ID_T e = ids[t * top_k + k];                                               \
                out[t * top_k + k] = (uint64_t)(int64_t)e < (uint64_t)num_experts                \
                    ? (ID_T)table_row[(int64_t)e * col_stride] : (ID_T)-1;                       \
            }                                                                                    \
            if (++row == rows) row = 0;                                                          \
        }                                                                                        \
        const int64_t c1 = t1 < counted ? t1 : counted;                                          \
        for (int64_t i = t0 * top_k; i < c1 * top_k; ++i) {                                      \
            const uint64_t p = (uint64_t)(int64_t)out[i];                                        \
            if (p < bins) hist[(i & 3) * bins + p] += 1;                                         \
        }                                                                                        \
    }                                                                                            \
    if (hist) {                                                                                  \
        for (uint64_t p = 0; p < bins; ++p)                                                      \
            load[p * load_stride] += (LOAD_T)(hist[p] + hist[bins + p] + hist[2 * bins + p]      \
                                              + hist[3 * bins + p]);                             \
        free(hist);                                                                              \
    }                                                                                            \
}

MAP_AND_RECORD(map_i32_load_i32, int32_t, int32_t)
MAP_AND_RECORD(map_i32_load_i64, int32_t, int64_t)
MAP_AND_RECORD(map_i64_load_i32, int64_t, int32_t)
MAP_AND_RECORD(map_i64_load_i64, int64_t, int64_t)
"""

_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99")

_ARGTYPES = [
    ctypes.c_void_p,  # ids
    ctypes.c_int64,  # num_tokens
    ctypes.c_int64,  # top_k
    ctypes.c_void_p,  # table
    ctypes.c_int64,  # rows
    ctypes.c_int64,  # num_experts
    ctypes.c_int64,  # row_stride
    ctypes.c_int64,  # col_stride
    ctypes.c_void_p,  # out
    ctypes.c_void_p,  # load (NULL: map only)
    ctypes.c_int64,  # num_physical
    ctypes.c_int64,  # load_stride
    ctypes.c_void_p,  # record (uint8 / bool)
    ctypes.c_void_p,  # unpadded
    ctypes.c_int,  # unpadded_is_int64
]

_NO_FLAG = ctypes.c_uint8(0)
_NO_FLAG_ADDRESS = ctypes.addressof(_NO_FLAG)


class CpuKernel:
    """The loaded kernel library; one entry point per (ids dtype, load dtype)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library
        self._entry = {}
        for ids_dtype, ids_name in ((torch.int32, "i32"), (torch.int64, "i64")):
            for load_dtype, load_name in ((torch.int32, "i32"), (torch.int64, "i64")):
                fn = getattr(library, f"map_{ids_name}_load_{load_name}")
                fn.argtypes = _ARGTYPES
                fn.restype = None
                self._entry[ids_dtype, load_dtype] = fn

    def map_to_physical(self, topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``map_to_physical`` on checked CPU arguments (dtypes, ranks, one device)."""
        return self._run(topk_ids, table, None, None, None)

    def map_to_physical_and_record(
        self,
        topk_ids: torch.Tensor,
        table: torch.Tensor,
        expert_load_view: torch.Tensor,
        record_enabled: torch.Tensor,
        num_unpadded_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """``map_to_physical_and_record`` on checked CPU arguments (dtypes, ranks, one device)."""
        return self._run(topk_ids, table, expert_load_view, record_enabled, num_unpadded_tokens)

    def _run(
        self,
        topk_ids: torch.Tensor,
        table: torch.Tensor,
        expert_load_view: torch.Tensor | None,
        record_enabled: torch.Tensor | None,
        num_unpadded_tokens: torch.Tensor | None,
    ) -> torch.Tensor:
        # Without a load view the kernel maps only (no load pointer, the constant-false flag).
        ids = topk_ids.contiguous()
        out = torch.empty_like(ids)
        num_tokens, top_k = ids.shape
        rows, num_experts = table.shape
        row_stride, col_stride = table.stride()
        if expert_load_view is None or record_enabled is None or num_unpadded_tokens is None:
            load_dtype, load = torch.int32, (None, 0, 0, _NO_FLAG_ADDRESS, None, 0)
        else:
            load_dtype = expert_load_view.dtype
            load = (
                expert_load_view.data_ptr(), expert_load_view.shape[0], expert_load_view.stride(0),
                record_enabled.data_ptr(), num_unpadded_tokens.data_ptr(),
                num_unpadded_tokens.dtype == torch.int64,
            )  # fmt: skip
        self._entry[ids.dtype, load_dtype](
            ids.data_ptr(), num_tokens, top_k, table.data_ptr(), rows, num_experts, row_stride,
            col_stride, out.data_ptr(), *load,
        )  # fmt: skip
        return out


def _cache_dir() -> Path:
    if "ASCEND_EPLB_CACHE_DIR" in os.environ:
        return Path(os.environ["ASCEND_EPLB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ascend_eplb"


def _build() -> CpuKernel | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _LOG.warning("no C compiler found: ascend_eplb map-and-record ops use their torch form on CPU")
        return None
    digest = hashlib.sha256("\0".join((_SOURCE, *_FLAGS)).encode()).hexdigest()[:16]
    cache = _cache_dir()
    library = cache / f"dataplane_cpu_{digest}.so"
    try:
        if not library.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                source = Path(tmp) / "kernel.c"
                source.write_text(_SOURCE)
                built = Path(tmp) / library.name
                subprocess.run(
                    [compiler, *_FLAGS, "-o", str(built), str(source)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                os.replace(built, library)  # atomic: concurrent builders race harmlessly
        return CpuKernel(ctypes.CDLL(str(library)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        _LOG.warning("building the ascend_eplb CPU kernel failed (%s); using the torch form on CPU", detail)
        return None


_LOCK = threading.Lock()
_KERNEL: list[CpuKernel | None] = []


def load() -> CpuKernel | None:
    """The CPU kernel, built or loaded on the first call (thread-safe); ``None`` without a compiler."""
    if not _KERNEL:
        with _LOCK:
            if not _KERNEL:
                _KERNEL.append(_build())
    return _KERNEL[0]
