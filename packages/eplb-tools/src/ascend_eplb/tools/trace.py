"""Real routing traces for the simulator: the compact trace format, its converter, and load matrices.

The embedded default is the world's (:func:`ascend_eplb.world.esft.embedded_trace_path`: ESFT's
"translation" task on DeepSeek-V2-Lite, 26 MoE layers, 64 experts, top-6; provenance in the world's
``data/ORIGIN.md``). :func:`convert` turns ESFT's ``expert_weights_<layer>.txt`` files (one line per
sequence, ``<ids>\t\t<gate weights>``) into one compact ``.npz`` (``numpy.savez_compressed``, lossless);
:func:`load_trace` reads it back. Its arrays: ``topk_ids`` uint8 ``[L, trace_tokens, K]`` (logical ids,
tokens in processing order); ``topk_weights_e4`` uint16 ``[L, trace_tokens, K]`` (gate weights x 10,000:
the text has 4 decimals); ``seq_offsets`` int64 ``[sequences + 1]`` (``seq_offsets[-1] ==
trace_tokens``); ``layer_ids`` int64 ``[L]`` (the model's layer number of each MoE layer);
``num_logical_experts`` int64 scalar.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ascend_eplb.integration.events.reader import RecordedLoad, read_events
from ascend_eplb.integration.regular_files import (
    EVENTS_FILE,
    LOAD_FILE,
    ROUTING_TRACE,
    RegularFileError,
    read_regular_file,
    write_regular_file,
)
from ascend_eplb.tools.files import InputFileError, InputFileWarning, check_load_values, read_input
from ascend_eplb.tools.host_memory import check_sampling
from ascend_eplb.world.esft import embedded_trace_path

__all__ = [
    "DEFAULT_SAMPLE_TOP_K",
    "RoutingTrace",
    "convert",
    "load_esft_expert_weights",
    "load_load_matrix",
    "load_recorded",
    "load_recorded_models",
    "load_routing_source",
    "load_sampled_load",
    "load_trace",
    "sample_trace_from_load",
    "samples_routing",
]

_WEIGHT_SCALE = 10_000


@dataclass(frozen=True)
class RoutingTrace:
    """Per-token top-k routing of ``L`` MoE layers, in processing order.

    ``topk_ids``: int64 ``[L, trace_tokens, K]`` logical ids in ``[0, E)``; ``topk_weights``: float32
    ``[L, trace_tokens, K]`` router weights; ``seq_offsets``: int64 ``[sequences + 1]``;
    ``num_logical_experts``: ``E``; ``name``: where it came from (for the report).
    """

    topk_ids: np.ndarray
    topk_weights: np.ndarray
    seq_offsets: np.ndarray
    num_logical_experts: int
    name: str

    @property
    def num_moe_layers(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[2])

    def load(self) -> np.ndarray:
        """int64 ``[L, E]``: selections per (layer, logical expert) over the whole trace."""
        out = np.zeros((self.num_moe_layers, self.num_logical_experts), dtype=np.int64)
        for layer in range(self.num_moe_layers):
            out[layer] = np.bincount(self.topk_ids[layer].ravel(), minlength=self.num_logical_experts)
        return out

    def prefix(self, num_moe_layers: int) -> RoutingTrace:
        """The first ``num_moe_layers`` layers; ``ValueError`` unless ``1 <= num_moe_layers <= L``."""
        if not 1 <= num_moe_layers <= self.num_moe_layers:
            raise ValueError(
                f"layers={num_moe_layers}: must be in [1, {self.num_moe_layers}] for trace {self.name}"
            )
        return RoutingTrace(
            self.topk_ids[:num_moe_layers],
            self.topk_weights[:num_moe_layers],
            self.seq_offsets,
            self.num_logical_experts,
            self.name,
        )


def _parse_line(line: str, path: Path, lineno: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    ids_text, sep, weights_text = line.rstrip("\n").partition("\t\t")
    if not sep:
        raise ValueError(f"{path}:{lineno}: expected '<ids>\\t\\t<weights>', found no double tab")
    ids = np.array(ids_text.split("\t"), dtype=np.int64)
    weights = np.array(weights_text.split("\t"), dtype=np.float64)
    if ids.size != weights.size or ids.size % top_k:
        raise ValueError(
            f"{path}:{lineno}: {ids.size} ids and {weights.size} weights; both must be equal and a multiple "
            f"of top_k={top_k}"
        )
    return ids.reshape(-1, top_k), weights.reshape(-1, top_k)


def convert(
    source_dir: str | Path, out_path: str | Path, *, top_k: int = 6, num_logical_experts: int = 64
) -> Path:
    """Convert ESFT ``expert_weights_<layer>.txt`` files into the compact ``.npz`` described above.

    ``source_dir`` holds ``expert_weights_1.txt`` .. ``expert_weights_<L>.txt`` (layers numbered from 1,
    contiguous). Raises ``ValueError`` naming the file and line if a file is missing, a line is malformed,
    an id is outside ``[0, num_logical_experts)``, or the layers disagree on sequences or token counts.
    Returns ``out_path``.
    """
    source_dir = Path(source_dir)
    files = sorted(source_dir.glob("expert_weights_*.txt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    if not files:
        raise ValueError(f"{source_dir}: no expert_weights_<layer>.txt files")
    layer_ids = [int(p.stem.rsplit("_", 1)[1]) for p in files]
    if layer_ids != list(range(layer_ids[0], layer_ids[0] + len(layer_ids))):
        raise ValueError(f"{source_dir}: layer numbers {layer_ids} are not contiguous")
    all_ids, all_weights, offsets = [], [], None
    for path in files:
        seq_ids, seq_weights, lengths = [], [], []
        for lineno, line in enumerate(_text_lines(path), 1):
            ids, weights = _parse_line(line, path, lineno, top_k)
            if ids.size and (ids.min() < 0 or ids.max() >= num_logical_experts):
                raise ValueError(f"{path}:{lineno}: expert id outside [0, {num_logical_experts})")
            seq_ids.append(ids)
            seq_weights.append(weights)
            lengths.append(ids.shape[0])
        layer_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        if offsets is None:
            offsets = layer_offsets
        elif not np.array_equal(offsets, layer_offsets):
            raise ValueError(
                f"{path}: sequence lengths differ from {files[0].name}; "
                "every layer must route the same tokens"
            )
        all_ids.append(np.concatenate(seq_ids))
        all_weights.append(np.concatenate(seq_weights))
    weights_e4 = np.rint(np.stack(all_weights) * _WEIGHT_SCALE)
    if weights_e4.min() < 0 or weights_e4.max() > np.iinfo(np.uint16).max:
        raise ValueError(f"{source_dir}: gate weights outside [0, 6.5535]")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    archive = io.BytesIO()
    np.savez_compressed(
        archive,
        topk_ids=np.stack(all_ids).astype(np.uint8),
        topk_weights_e4=weights_e4.astype(np.uint16),
        seq_offsets=offsets,
        layer_ids=np.array(layer_ids, dtype=np.int64),
        num_logical_experts=np.array(num_logical_experts, dtype=np.int64),
    )
    write_regular_file(out_path, archive.getvalue(), [(f"the source file {f.name}", f) for f in files])
    return out_path


def _text_lines(file: Path) -> list[str]:
    """The lines of the text file ``file`` (an ESFT ``expert_weights_<layer>.txt``), read by the one reader
    (up to a load file's cap), each with its newline.

    Raises:
        ValueError: the file cannot be read, or is not UTF-8 (naming it).
    """
    try:
        raw = read_regular_file(file, LOAD_FILE)
    except RegularFileError as e:
        raise InputFileError(f"{file}: {e.reason} (ESFT expert_weights text)") from None
    try:
        return raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as e:
        raise InputFileError(
            f"{file}: not UTF-8 text (byte {e.start}), not ESFT expert_weights text"
        ) from None


def load_trace(path: str | Path | None = None) -> RoutingTrace:
    """Load a compact trace written by :func:`convert`; ``None`` loads the embedded ESFT trace (the
    world's, :func:`ascend_eplb.world.esft.embedded_trace_path`).

    Raises :class:`~ascend_eplb.tools.files.InputFileError` (a ``ValueError``) naming the file when it
    is missing, empty, not an ``.npz`` archive, corrupt or truncated, a key is missing or shapes
    disagree.
    """
    path = embedded_trace_path() if path is None else Path(path)
    return read_input(path, "a compact routing trace .npz", _read_trace, ROUTING_TRACE)


def _read_trace(path: Path, data: bytes) -> RoutingTrace:
    if data[:4] != b"PK\x03\x04":
        raise ValueError(f"{path}: not a compact routing trace .npz (no zip archive signature)")
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        missing = {"topk_ids", "topk_weights_e4", "seq_offsets", "num_logical_experts"} - set(z.files)
        if missing:
            raise ValueError(f"{path}: not a readable routing trace .npz (missing keys {sorted(missing)})")
        ids = z["topk_ids"].astype(np.int64)
        weights = z["topk_weights_e4"].astype(np.float32) / _WEIGHT_SCALE
        offsets = z["seq_offsets"].astype(np.int64)
        declared = z["num_logical_experts"]
    if declared.shape != () or declared.dtype.kind not in "iu":
        raise ValueError(f"{path}: num_logical_experts must be an integer scalar, got {declared.dtype} "
                         f"{declared.shape}")  # fmt: skip
    num_experts = int(declared)
    if ids.ndim != 3 or ids.shape != weights.shape or offsets.ndim != 1 or offsets.size < 2:
        raise ValueError(
            f"{path}: topk_ids {ids.shape} must be [L, T, K] like weights {weights.shape}, with "
            f"seq_offsets {offsets.shape} a 1-D array of at least 2 offsets"
        )
    if offsets[-1] != ids.shape[1] or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        raise ValueError(
            f"{path}: seq_offsets must rise from 0 to the token count {ids.shape[1]}, got "
            f"first {offsets[0]}, last {offsets[-1]}"
        )
    if ids.size == 0 or ids.min() < 0 or ids.max() >= num_experts:
        raise ValueError(
            f"{path}: expert ids must lie in [0, num_logical_experts={num_experts}), got "
            f"{'none' if ids.size == 0 else f'[{ids.min()}, {ids.max()}]'}"
        )
    return RoutingTrace(ids, weights, offsets, num_experts, path.name)


def _matrix(value: object, source: str, *, text: bool = False) -> np.ndarray:
    arr = _matrix_values(value, source, text=text)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{source}: load must be a [L, E] matrix, got shape {arr.shape}")
    return check_load_values(arr, source)


def load_esft_expert_weights(path: str | Path, *, top_k: int = 6) -> np.ndarray:
    """Selections per (layer, logical expert), float64 ``[L, E]``, from ESFT's per-token routing text
    (``expert_weights_<layer>.txt``, one line per sequence, ``<ids>\\t\\t<gate weights>``, top-``k``
    per token): a folder of them (layers in numeric order) or one file (``L = 1``).

    ``E`` is the largest id + 1 over all files (ESFT's DeepSeek-V2-Lite: 64). Raises ``ValueError``
    naming the file and line of a malformed line, or the folder when it holds no such file.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("expert_weights_*.txt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        if not files:
            raise ValueError(f"{path}: no expert_weights_<layer>.txt files")
    else:
        files = [path]
    per_layer = []
    for file in files:
        lines = _text_lines(file)
        ids = [_parse_line(line, file, n, top_k)[0] for n, line in enumerate(lines, 1) if line.strip()]
        flat = np.concatenate(ids).ravel() if ids else np.zeros(0, dtype=np.int64)
        if flat.size and flat.min() < 0:
            raise ValueError(f"{file}: negative expert id {flat.min()}")
        per_layer.append(flat)
    num_experts = max((int(a.max()) + 1 for a in per_layer if a.size), default=0)
    if num_experts == 0:
        raise ValueError(f"{path}: no routed token in the ESFT expert_weights files")
    return np.stack([np.bincount(a, minlength=num_experts) for a in per_layer]).astype(np.float64)


def load_recorded(path: str | Path) -> RecordedLoad | None:
    """A serving events file's (``.jsonl``, ``ASCEND_EPLB_EVENTS``) windows, read once
    (:meth:`ascend_eplb.integration.events.reader.EventsFile.recorded_load`: one model's windows in the
    last run that has any); None for any other file.

    A truncated last line that was skipped, and what else the file holds that is not read (other runs,
    other models), are each one :class:`~ascend_eplb.tools.files.InputFileWarning`.

    Raises:
        InputFileError: the file cannot be read as an events file, or holds no window (naming it).
    """
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        return None
    return read_input(
        path, "a serving events file (.jsonl)", lambda p, data: _read_recorded(p, data, False)[0], EVENTS_FILE
    )


def load_recorded_models(path: str | Path) -> tuple[RecordedLoad, ...]:
    """As :func:`load_recorded`, the windows of each model one server balanced
    (:meth:`ascend_eplb.integration.events.reader.EventsFile.recorded_loads`: the target and, when it recorded
    one, its MoE draft, each its own windows and configuration); ``()`` for any other file.

    Raises:
        InputFileError: as :func:`load_recorded`.
    """
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        return ()
    return read_input(
        path, "a serving events file (.jsonl)", lambda p, data: _read_recorded(p, data, True), EVENTS_FILE
    )


def _read_recorded(path: Path, data: bytes, every_model: bool) -> tuple[RecordedLoad, ...]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = read_events(path, text=data)
    # refused without a window: the skipped line is in its reason
    recorded = events.recorded_loads() if every_model else (events.recorded_load(),)
    for w in caught:
        # What the reader skipped, as the tools' own warning: one line under every command.
        category = InputFileWarning if issubclass(w.category, UserWarning) else w.category
        warnings.warn_explicit(str(w.message), category, w.filename, w.lineno)
    for note in dict.fromkeys(r.note for r in recorded if r.note):  # the models read together: one note
        warnings.warn(note, InputFileWarning, stacklevel=5)
    return recorded


def load_load_matrix(
    path: str | Path, *, last: int | None = None, recorded: RecordedLoad | None = None
) -> np.ndarray:
    """Read recorded expert load as float64 ``[L, E]`` (any non-negative unit: counts or shares).

    Accepted: ESFT per-token routing (a folder of ``expert_weights_*.txt`` or one such ``.txt``:
    :func:`load_esft_expert_weights`); a compact routing trace ``.npz`` (:func:`load_trace`: its
    selections); a serving events file ``.jsonl`` (``ASCEND_EPLB_EVENTS``): the
    sum of the ``window`` loads :func:`load_recorded` reads (``recorded``, when read already), or of the
    ``last`` ones; ``.npy``; ``.csv`` (one row per layer, no
    header); ``.json`` holding a ``[L, E]`` list, an
    SGLang expert-distribution dump ``{"logical_count": [[...]]}`` (``[L, E]``, or ``[steps, L, E]``
    summed over steps), or an ESFT ``summary.json`` (``{"token_scores": {layer: {expert: share}}}``,
    layers and experts sorted numerically). Raises ``ValueError`` naming the file and the rule.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if path.is_dir() or suffix == ".txt":
        if last is not None:
            raise ValueError(f"last={last}: is only for an events file (.jsonl)")
        return load_esft_expert_weights(path)
    if last is not None and (last < 1 or suffix != ".jsonl"):
        raise ValueError(f"last={last}: must be >= 1 and is only for an events file (.jsonl)")
    if suffix == ".npz":  # a routing trace: its selections per (layer, logical expert)
        return load_trace(path).load().astype(np.float64)
    if suffix not in (".jsonl", ".npy", ".csv", ".json"):
        raise ValueError(
            f"{path}: unsupported load file type {suffix!r}; use .jsonl (events), .npz (a routing trace), "
            ".json, .npy or .csv"
        )
    if suffix == ".jsonl":
        recorded = load_recorded(path) if recorded is None else recorded
        chosen = recorded.windows[-last:] if last is not None else recorded.windows
        total = np.zeros(tuple(chosen[0].shape), dtype=np.float64)
        for window in chosen:
            total += window.numpy()
        try:
            return _matrix(total, str(path))
        except ValueError as e:
            raise InputFileError(str(e)) from None
    return read_input(path, "an [L, E] load matrix", lambda p, data: _read_load(p, data, suffix), LOAD_FILE)


def _read_load(path: Path, raw: bytes, suffix: str) -> np.ndarray:
    source = str(path)
    if suffix == ".npy":
        if raw[:6] != b"\x93NUMPY":
            raise ValueError(f"{source}: not an [L, E] load matrix (no .npy signature)")
        return _matrix(np.load(io.BytesIO(raw), allow_pickle=False), source)
    if suffix == ".csv":
        text = raw.decode("utf-8")
        rows = [row for row in csv.reader(io.StringIO(text, newline="")) if row]
        return _matrix(rows, source, text=True)
    try:
        data = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    if isinstance(data, dict) and "token_scores" in data:
        return _matrix(_esft_scores(data["token_scores"], source), source)
    if isinstance(data, dict) and "logical_count" in data:
        arr = _matrix_values(data["logical_count"], source)
        if arr.ndim == 3:
            arr = arr.sum(axis=0)
        return _matrix(arr, source)
    if isinstance(data, dict):
        raise ValueError(f"{source}: JSON object must hold 'token_scores' (ESFT) or 'logical_count' (SGLang)")
    return _matrix(data, source)


def _matrix_values(value: object, source: str, *, text: bool = False) -> np.ndarray:
    """``value`` as float64. Numbers only (ints, unsigned ints, floats): a bool, complex, date, string or
    null array is refused, except the number strings of a CSV file (``text``)."""
    try:
        if not text:
            numbers = np.asarray(value)
            if numbers.dtype.kind not in "iuf":
                raise ValueError(f"values of dtype {numbers.dtype}, not numbers")
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{source}: load must be a numeric [L, E] matrix ({e})") from None


def _esft_scores(scores: object, source: str) -> list[list[float]]:
    """ESFT ``token_scores``: ``{layer: {expert: share}}``, layer and expert keys integers written as
    Python writes them (``"1"``, never ``"01"``: two spellings of one expert would lose a share), shares
    numbers."""
    rule = f"{source}: token_scores must map layer numbers to {{expert number: share}} objects"
    if not isinstance(scores, dict) or not scores or not all(isinstance(v, dict) for v in scores.values()):
        raise ValueError(rule)
    keys = [*scores, *(e for layer in scores.values() for e in layer)]
    bad = next((k for k in keys if not (k.isdigit() and str(int(k)) == k)), None)
    if bad is not None:
        raise ValueError(f"{rule} (key {bad!r} is not an integer written as 0, 1, 2, ...)")
    for layer in scores.values():
        for share in layer.values():
            if isinstance(share, bool) or not isinstance(share, (int, float)):
                raise ValueError(f"{rule} (share {share!r} is not a number)")
    layers = sorted(scores, key=int)
    experts = sorted({int(e) for layer in layers for e in scores[layer]})
    if experts != list(range(len(experts))):
        raise ValueError(f"{source}: token_scores experts must be 0..E-1")
    return [[scores[layer].get(str(e), 0.0) for e in experts] for layer in layers]


def sample_trace_from_load(
    load_le: np.ndarray, *, num_tokens: int, top_k: int, seed: int, name: str = "load matrix"
) -> RoutingTrace:
    """Draw a routing trace whose per-layer expert frequencies follow ``load_le`` (float ``[L, E]``).

    Each token picks ``top_k`` distinct experts per layer without replacement, with probability
    proportional to the load (Gumbel top-k); weights are the normalised probabilities of the picks.
    Layers with zero total load are routed uniformly. Raises ``ValueError`` if ``top_k > E``.
    """
    load = _matrix(load_le, name)
    num_moe_layers, num_experts = load.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: must be in [1, E={num_experts}]")
    check_sampling(num_moe_layers, num_tokens, num_experts)
    rng = np.random.default_rng(seed)
    totals = load.sum(axis=1, keepdims=True)
    probs = np.where(totals > 0, load / np.where(totals > 0, totals, 1.0), 1.0 / num_experts)
    logp = np.log(np.maximum(probs, 1e-30))
    gumbel = rng.gumbel(size=(num_moe_layers, num_tokens, num_experts))
    ids = np.argsort(-(logp[:, None, :] + gumbel), axis=-1)[..., :top_k]
    weights = np.take_along_axis(np.broadcast_to(probs[:, None, :], gumbel.shape), ids, axis=-1)
    weights = (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)
    offsets = np.array([0, num_tokens], dtype=np.int64)
    return RoutingTrace(ids.astype(np.int64), weights, offsets, num_experts, name)


#: Top-k drawn when sampling a load matrix and the operator names none: the embedded trace's (ESFT,
#: DeepSeek-V2-Lite routes top-6). DeepSeek-V3/R1 route top-8: pass ``--top-k 8``.
DEFAULT_SAMPLE_TOP_K = 6


def load_sampled_load(path: str | Path) -> tuple[np.ndarray, str]:
    """The load a simulation samples its routing from: any :func:`load_load_matrix` input, on the
    layers that carry load (layers whose load sums to 0, dense layers of a model's full layer list, are
    skipped, as ``plan`` skips them), and its name. Raises ``ValueError`` if no layer carries load."""
    load = load_load_matrix(path)
    loaded = load.sum(axis=1) > 0
    if not loaded.any():
        raise ValueError(f"{path}: all {load.shape[0]} layers have zero load; nothing to route")
    skipped = int((~loaded).sum())
    return load[loaded], Path(path).name + (f" ({skipped} layers without load skipped)" if skipped else "")


def samples_routing(path: str | Path | None) -> bool:
    """Whether ``path`` (``--trace``) is load to sample routing from rather than a routing trace."""
    return path is not None and (Path(path).is_dir() or Path(path).suffix.lower() != ".npz")


def load_routing_source(
    path: str | Path | None,
    *,
    num_tokens: int = 8192,
    top_k: int | None = None,
    seed: int = 0,
    check: Callable[..., None] | None = None,
) -> RoutingTrace:
    """The simulator's routing: ``None`` -> embedded trace; ``.npz`` -> :func:`load_trace` (its own top-k;
    ``top_k`` is not applied); load (:func:`load_sampled_load`) -> :func:`sample_trace_from_load` with
    ``num_tokens`` tokens and ``top_k`` (default :data:`DEFAULT_SAMPLE_TOP_K`).

    ``check(num_trace_moe_layers=, num_logical_experts=, top_k=, num_trace_tokens=, sampled=)`` is
    called with the routing's facts once they are known and, for load, before anything is sampled (the
    simulator validates its options there, the memory of the sampling included)."""
    if not samples_routing(path):
        routing = load_trace(path)
        if check is not None:
            check(
                num_trace_moe_layers=routing.num_moe_layers,
                num_logical_experts=routing.num_logical_experts,
                top_k=routing.top_k,
                num_trace_tokens=routing.num_tokens,
                sampled=False,
            )
        return routing
    load, name = load_sampled_load(path)
    top_k = DEFAULT_SAMPLE_TOP_K if top_k is None else top_k
    if check is not None:
        check(
            num_trace_moe_layers=load.shape[0],
            num_logical_experts=load.shape[1],
            top_k=top_k,
            num_trace_tokens=num_tokens,
            sampled=True,
        )
    return sample_trace_from_load(load, num_tokens=num_tokens, top_k=top_k, seed=seed, name=name)


def main(argv: list[str] | None = None) -> int:
    """``python -m ascend_eplb.tools.trace SOURCE_DIR OUT.npz``: rebuild the embedded trace."""

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("source_dir", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    out = convert(args.source_dir, args.out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
