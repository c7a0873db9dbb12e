"""Qwen3 checkpoints in the Hugging Face folder format: load, validate, save, quantize, inspect.

A checkpoint folder holds

- ``config.json``: the architecture (``fp8lab.engine.config.Qwen3Config``); an FP8 checkpoint has a
  ``quantization_config`` (``quant_method: fp8``, ``fmt: e4m3``, ``weight_block_size``);
- ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` listed by
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name: shard}}``);
- optionally ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
  other small files (this module copies those but does not read the tokenizer).

The tensors it must hold are ``fp8lab.engine.layout.expected_tensors(config)``, each of a kind:
``fp8`` (E4M3 projection weights, stored ``F8_E4M3``), ``scale`` (their ``weight_scale_inv``,
stored ``F32``, ``BF16`` or ``F16``) and ``float`` (embeddings, norms, ``lm_head``, and all
weights of a BF16 checkpoint; stored ``BF16``, ``F16`` or ``F32``).

Loading contract (``load_checkpoint``): everything is validated before anything is returned,
so nothing is ever half-loaded. Every problem is a ``ValueError`` naming the file and the tensor
(``FileNotFoundError`` for a missing file): corrupt or truncated safetensors, a missing tensor,
an unexpected tensor, a wrong shape, a dtype of the wrong kind (BF16 where FP8 is expected), a
scale shape that does not match the weight and block size, NaN codes in an FP8 weight,
non-finite or non-positive scales, scales so large that ``448 * scale`` overflows float32,
non-finite float weights, a ``config.json`` field of the wrong JSON type or out of range
(``fp8lab.engine.config``), an unknown ``quant_method``. ``num_hidden_layers`` is compared with the
layers in the safetensors headers before anything else, so an absurd count fails at once.

One tolerance: a tied checkpoint (``tie_word_embeddings``) that still stores ``lm_head.weight``
loads with a warning and without it, since exporters sometimes write the tied copy; every other
unexpected tensor is an error, because it almost always means ``config.json`` disagrees with
the weights.

In memory, FP8 weights are uint8 E4M3 codes ``[N, K]`` and every other tensor is float32
(BF16 widens exactly); ``stored_dtypes`` keeps what the file said.

``inspect`` diagnoses rather than refuses: it reports NaN codes and non-finite values (it uses
``load_checkpoint(..., validate_values=False)``'s machinery), while structural problems still
raise, because without a valid structure there is nothing sensible to summarize. It also warns
about weights that load but are so large that a float32 forward pass may overflow
(``magnitude_warning``), and then does not call the checkpoint OK.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
from tqdm import tqdm

from fp8lab.reference import blockwise, e4m3

from .config import FP8QuantConfig, Qwen3Config, read_token_ids
from .layout import TensorSpec, expected_tensors
from .safetensors_io import STORAGE_DTYPES, SafetensorsFile, write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SCALE_SUFFIX = "_scale_inv"
"""``<proj>.weight`` has its scales in ``<proj>.weight_scale_inv``."""

ALLOWED_DTYPES = {"fp8": ("F8_E4M3",), "scale": ("F32", "BF16", "F16"), "float": ("BF16", "F16", "F32")}
"""Stored dtypes accepted for each tensor kind of ``fp8lab.engine.layout``."""
WRITE_DTYPES = {"fp8": "F8_E4M3", "scale": "F32", "float": "BF16"}
"""Stored dtypes written for each kind unless the caller says otherwise (Qwen3-FP8's choice)."""
SAFETENSORS_METADATA = {"format": "pt"}
"""transformers checks this field when it loads a safetensors file."""
MAX_SIDE_FILE_BYTES = 64 * 1024 * 1024
"""``quantize`` copies non-weight files up to this size (Qwen's tokenizer.json is about 11 MB)."""
FLOAT32_MAX = float(np.finfo(np.float32).max)
OUTPUT_WARNING_LIMIT = math.sqrt(FLOAT32_MAX)
"""``inspect`` warns when a projection's outputs can reach this (about 1.8e19): the RMSNorm that
follows squares them, and the squares overflow float32."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


@dataclass
class Checkpoint:
    """A loaded, validated checkpoint (see the module docstring for the contract)."""

    path: Path
    config: Qwen3Config
    tensors: dict[str, np.ndarray]
    stored_dtypes: dict[str, str]
    generation_config: dict = field(default_factory=dict)

    @property
    def is_fp8(self) -> bool:
        return self.config.quantization is not None

    @property
    def block(self) -> tuple[int, int] | None:
        """``weight_block_size`` of an FP8 checkpoint, ``None`` for a BF16 one."""
        return None if self.config.quantization is None else self.config.quantization.weight_block_size


# ----------------------------------------------------------------------------------------------
# Small files


def read_json(path: Path, required: bool = True) -> dict:
    """A JSON object from ``path``; ``{}`` for an absent optional file; a clear error otherwise."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: no such file")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def read_config(folder: Path) -> Qwen3Config:
    """``config.json`` as a ``Qwen3Config``; errors name the file."""
    path = folder / CONFIG_FILE
    d = read_json(path)
    try:
        return Qwen3Config.from_dict(d)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {str(e).removeprefix('config.json: ')}") from None


def scale_name(weight_name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj.weight_scale_inv``."""
    return weight_name + SCALE_SUFFIX


def _weight_of_scale(name: str) -> str:
    return name.removesuffix(SCALE_SUFFIX)


# ----------------------------------------------------------------------------------------------
# Validation, shared by the loader (from safetensors headers) and the writer (from arrays)


def _first_names(names, limit: int = 3) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _unexpected_hint(config: Qwen3Config, name: str) -> str:
    if name.endswith(SCALE_SUFFIX) and config.quantization is None:
        return " (an FP8 scale, but config.json has no quantization_config)"
    if name.startswith("model.layers."):
        return f" (config.json has num_hidden_layers={config.num_hidden_layers})"
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return " (config.json ties lm_head to the embeddings)"
    return ""


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def check_layer_count(config: Qwen3Config, present, where: str) -> None:
    """``num_hidden_layers`` is no more than the layers the files hold. Checked from the tensor
    names before ``expected_tensors`` lists every tensor: an absurd count (10,000,000) would
    otherwise cost minutes and gigabytes before the "missing tensor" error."""
    held = {m.group(1) for name in present if (m := _LAYER_NAME.match(name))}
    if config.num_hidden_layers > len(held):
        raise ValueError(
            f"{where}: config.json has num_hidden_layers={config.num_hidden_layers}, but the weights hold "
            f"tensors of only {len(held)} layers"
        )


def check_names(config: Qwen3Config, present, where: str) -> None:
    """Every expected tensor is present and nothing else is (``where`` names the file(s))."""
    specs = expected_tensors(config)
    missing = [n for n in specs if n not in present]
    if missing:
        raise ValueError(f"{where}: missing tensor {_first_names(missing)} (expected by config.json)")
    unexpected = [n for n in present if n not in specs]
    if unexpected:
        first = sorted(unexpected)[0]
        raise ValueError(
            f"{where}: unexpected tensor {_first_names(unexpected)}{_unexpected_hint(config, first)}; "
            "it is not part of a Qwen3 checkpoint with this config.json"
        )


def check_entry(config: Qwen3Config, name: str, spec: TensorSpec, dtype: str, shape: tuple, where: str) -> None:
    """One tensor's stored dtype and shape against its spec."""
    if dtype not in ALLOWED_DTYPES[spec.kind]:
        hint = {
            "fp8": "config.json quantizes this projection to FP8 (quantization_config), so it must be stored F8_E4M3",
            "scale": "a weight_scale_inv is stored F32, BF16 or F16",
            "float": "this tensor is not quantized, so it must be stored BF16, F16 or F32",
        }[spec.kind]
        raise ValueError(f"{where}: tensor {name!r} is stored as {dtype}; {hint}")
    if tuple(shape) != tuple(spec.shape):
        if spec.kind == "scale":
            weight_shape = expected_tensors(config)[_weight_of_scale(name)].shape
            raise ValueError(
                f"{where}: tensor {name!r} has shape {tuple(shape)}, which does not match weight "
                f"{weight_shape} with weight_block_size {config.quantization.weight_block_size}: "
                f"expected {spec.shape} = (ceil(N/BN), ceil(K/BK))"
            )
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, expected {spec.shape}")


def value_problem(kind: str, array: np.ndarray) -> str | None:
    """Why the values of one tensor are unusable, or ``None``: NaN codes in an FP8 weight
    (they decode to a finite number in the bit-placement kernels, so they would go unnoticed),
    non-finite or non-positive scales, non-finite float weights."""
    if kind == "fp8":
        positions = blockwise.nan_code_positions(array)
        if len(positions):
            return f"{len(positions)} NaN codes (0x7F/0xFF), the first at {list(map(int, positions[0]))}"
    elif kind == "scale":
        bad = ~(np.isfinite(array) & (array > 0))
        if bad.any():
            return f"{int(bad.sum())} scales that are not finite and positive, the first at {list(map(int, np.argwhere(bad)[0]))}"
        # The largest code (448) times its scale is a weight; beyond float32's range it is infinite.
        huge = array.astype(np.float64) * e4m3.MAX > FLOAT32_MAX
        if huge.any():
            return (
                f"{int(huge.sum())} scales so large that 448 * scale overflows float32 (max {FLOAT32_MAX:.3g}), "
                f"the first at {list(map(int, np.argwhere(huge)[0]))}"
            )
    else:
        bad = ~np.isfinite(array)
        if bad.any():
            return f"{int(bad.sum())} NaN or infinite values, the first at {list(map(int, np.argwhere(bad)[0]))}"
    return None


def largest_weight(kind: str, array: np.ndarray) -> float | None:
    """The largest weight magnitude a 2-D tensor can hold: ``448 * scale`` for an FP8 weight's
    scales (an upper bound: the codes are not read), ``max |w|`` for a float matrix; ``None`` for
    norms and FP8 codes, which are not checked this way."""
    if array.ndim != 2 or array.size == 0 or kind == "fp8":
        return None
    if kind == "scale":
        return float(array.max()) * e4m3.MAX
    return float(np.abs(array).max())


def magnitude_warning(largest: float, k: int) -> str | None:
    """Why weights of magnitude up to ``largest`` in rows of length ``k`` may overflow float32 at
    run time, or ``None``. Against ``k`` activations of RMS 1 such a row gives a dot product of
    about ``largest * sqrt(k)`` (random signs); ``inspect`` warns above ``OUTPUT_WARNING_LIMIT``."""
    typical = largest * math.sqrt(k)
    if typical <= OUTPUT_WARNING_LIMIT:
        return None
    return (
        f"weights up to {largest:.3g}: a dot product of {k} activations of RMS 1 is about {typical:.3g}, "
        f"beyond sqrt(float32 max) = {OUTPUT_WARNING_LIMIT:.3g}, where the RMSNorm that follows overflows float32"
    )


# ----------------------------------------------------------------------------------------------
# Opening: locate files and check every safetensors header against the layout (no data read)


@dataclass
class OpenCheckpoint:
    """A checkpoint whose structure is validated; tensors are read on demand with ``read``."""

    path: Path
    config: Qwen3Config
    generation_config: dict
    files: list[SafetensorsFile]
    sources: dict[str, SafetensorsFile]
    """Tensor name -> the file that holds it, in ``expected_tensors`` order."""
    specs: dict[str, TensorSpec]

    @property
    def stored_dtypes(self) -> dict[str, str]:
        return {name: f.info(name).dtype for name, f in self.sources.items()}

    def read(self, name: str, validate_values: bool = True) -> np.ndarray:
        """One tensor as the engine holds it (uint8 codes or float32), values checked unless told not to."""
        f = self.sources[name]
        array = f.read(name)
        if validate_values:
            problem = value_problem(self.specs[name].kind, array)
            if problem:
                raise ValueError(f"{f.path}: tensor {name!r}: {problem}")
        return array


def _shard_paths(folder: Path) -> tuple[list[Path], dict[str, str] | None, Path]:
    """The weight files of ``folder``, the index's weight_map (None when unsharded) and the file
    that describes them (the index or ``model.safetensors``), for error messages."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path}: expected a 'weight_map' object mapping tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard:
                raise ValueError(f"{index_path}: shard {shard!r} must be a file name inside the checkpoint folder")
            if not (folder / shard).is_file():
                tensor = next(n for n, s in weight_map.items() if s == shard)
                raise FileNotFoundError(f"{index_path}: shard {shard!r} (holding tensor {tensor!r}) does not exist")
        return [folder / s for s in shards], weight_map, index_path
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no {WEIGHTS_FILE} and no {INDEX_FILE}")
    return [single], None, single


def _map_tensors_to_files(files: list[SafetensorsFile], weight_map: dict[str, str] | None, index_path: Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> file; with an index, each tensor must be in exactly the shard it names."""
    sources: dict[str, SafetensorsFile] = {}
    for f in files:
        for name in f.names():
            if name in sources:
                raise ValueError(f"{f.path}: tensor {name!r} is also in {sources[name].path.name}")
            if weight_map is not None and weight_map.get(name) != f.path.name:
                raise ValueError(f"{f.path}: tensor {name!r} is not listed for this shard in {index_path.name}")
            sources[name] = f
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in sources:
                raise ValueError(f"{index_path}: tensor {name!r} is listed for {shard!r}, which does not hold it")
    return sources


def read_generation_config(folder: Path, vocab_size: int) -> dict:
    """``generation_config.json`` (``{}`` when absent), its token ids checked like config.json's: an
    integer in ``[0, vocab_size)`` each (``eos_token_id`` may be a list), never coerced."""
    path = folder / GENERATION_CONFIG_FILE
    generation_config = read_json(path, required=False)  # a JSON object, or {}
    for key, many in (("bos_token_id", False), ("eos_token_id", True), ("pad_token_id", False)):
        read_token_ids(generation_config, key, vocab_size, many, where=str(path))
    return generation_config


def open_checkpoint(path) -> OpenCheckpoint:
    """Read the configs and every safetensors header of a checkpoint folder and validate the
    structure (names, shapes, dtype kinds) against ``expected_tensors``; no tensor data is read."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such checkpoint folder")
    config = read_config(folder)
    generation_config = read_generation_config(folder, config.vocab_size)
    paths, weight_map, described_by = _shard_paths(folder)
    files = [SafetensorsFile(p) for p in paths]
    sources = _map_tensors_to_files(files, weight_map, described_by)
    check_layer_count(config, sources, str(described_by))
    specs = expected_tensors(config)
    if config.tie_word_embeddings and "lm_head.weight" in sources and "lm_head.weight" not in specs:
        warnings.warn(f"{sources['lm_head.weight'].path}: ignoring lm_head.weight, tied to the embeddings by config.json")
        del sources["lm_head.weight"]
    check_names(config, sources, str(described_by))
    for name, spec in specs.items():
        info = sources[name].info(name)
        check_entry(config, name, spec, info.dtype, info.shape, str(sources[name].path))
    ordered = {name: sources[name] for name in specs}
    return OpenCheckpoint(folder, config, generation_config, files, ordered, specs)


# ----------------------------------------------------------------------------------------------
# Loading


def _progress(iterable, progress: bool, desc: str, total: int | None = None):
    return tqdm(iterable, desc=desc, total=total, unit="tensor", file=sys.stderr, disable=not progress, leave=False)


def load_checkpoint(path, progress: bool = True, validate_values: bool = True) -> Checkpoint:
    """Load and validate a checkpoint folder (see the module docstring).

    ``validate_values=False`` skips the value checks (NaN codes, non-finite scales and floats)
    but never the structural ones; ``inspect`` uses it to report such problems instead of failing.
    """
    opened = open_checkpoint(path)
    tensors = {}
    for name in _progress(opened.sources, progress, f"loading {opened.path.name}"):
        tensors[name] = opened.read(name, validate_values=validate_values)
    return Checkpoint(opened.path, opened.config, tensors, opened.stored_dtypes, opened.generation_config)


# ----------------------------------------------------------------------------------------------
# Saving


def _dtypes_to_write(config: Qwen3Config, tensors: Mapping[str, np.ndarray], stored_dtypes: dict | None) -> dict[str, str]:
    """Validate ``tensors`` against the layout and choose each one's stored dtype."""
    stored_dtypes = stored_dtypes or {}
    check_names(config, tensors, "tensors to save")
    dtypes = {}
    for name, spec in expected_tensors(config).items():
        dtype = stored_dtypes.get(name) or WRITE_DTYPES[spec.kind]
        array = np.asarray(tensors[name])
        check_entry(config, name, spec, dtype, array.shape, "tensors to save")
        if (spec.kind == "fp8") != (array.dtype == np.uint8):
            want = "uint8 E4M3 codes" if spec.kind == "fp8" else "a float array"
            raise ValueError(f"tensors to save: tensor {name!r} must be {want}, got dtype {array.dtype}")
        problem = value_problem(spec.kind, array)
        if problem:
            raise ValueError(f"tensors to save: tensor {name!r}: {problem}")
        dtypes[name] = dtype
    return dtypes


def _shard_groups(names: list[str], sizes: dict[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    """Split ``names`` (in order) into shards of at most ``max_shard_bytes`` each; a tensor larger
    than the limit gets a shard of its own (as transformers does)."""
    if max_shard_bytes is None:
        return [names]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        if groups[-1] and used + sizes[name] > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += sizes[name]
    return groups


def _refuse_to_mix(folder: Path) -> None:
    """Never write over (or beside) another checkpoint's weights: a stale shard or index would be
    read together with the new files."""
    if not folder.exists():
        return
    clashes = [p.name for p in folder.iterdir() if p.name in (CONFIG_FILE, INDEX_FILE) or p.suffix == ".safetensors"]
    if clashes:
        raise FileExistsError(f"{folder}: already holds checkpoint files ({', '.join(sorted(clashes))}); choose a new folder")


def save_checkpoint(path, config: Qwen3Config, tensors: Mapping[str, np.ndarray], stored_dtypes: dict | None = None,
                    generation_config: dict | None = None, max_shard_bytes: int | None = None) -> Path:  # fmt: skip
    """Write a checkpoint folder: ``config.json``, ``model.safetensors`` (or, when the tensors do
    not fit in one ``max_shard_bytes`` shard, ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``) and ``generation_config.json`` when given.

    ``tensors`` are validated like a loaded checkpoint (names, shapes, kinds, values); stored
    dtypes by kind: FP8 weights ``F8_E4M3``, scales ``F32``, everything else ``BF16``, unless
    ``stored_dtypes`` names another allowed dtype. The folder may exist (with a tokenizer, say)
    but must not hold checkpoint files yet. Returns the folder.
    """
    folder = Path(path)
    dtypes = _dtypes_to_write(config, tensors, stored_dtypes)
    _refuse_to_mix(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / CONFIG_FILE, config.to_dict())
    names = list(dtypes)
    sizes = {n: int(np.prod(np.shape(tensors[n]))) * STORAGE_DTYPES[dtypes[n]].itemsize for n in names}
    groups = _shard_groups(names, sizes, max_shard_bytes)
    if len(groups) == 1:
        write_safetensors(folder / WEIGHTS_FILE, {n: tensors[n] for n in names}, dtypes, SAFETENSORS_METADATA)
    else:
        weight_map = {}
        for i, group in enumerate(groups, start=1):
            shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            write_safetensors(folder / shard, {n: tensors[n] for n in group}, dtypes, SAFETENSORS_METADATA)
            weight_map.update({n: shard for n in group})
        write_json(folder / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    if generation_config is not None:
        write_json(folder / GENERATION_CONFIG_FILE, generation_config)
    return folder


def build_atomically(dst, build: Callable[[Path], object]) -> Path:
    """Run ``build(tmp)`` in a fresh temporary folder beside ``dst``, then rename it to ``dst``.

    A crash or error leaves no half-written ``dst``. ``dst`` must not exist or be an empty folder.
    """
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst}: already exists and is not an empty folder")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
        build(tmp)
        if dst.is_dir():
            dst.rmdir()
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


# ----------------------------------------------------------------------------------------------
# Quantizing


def fp8_config_for(config: Qwen3Config, block=(128, 128)) -> Qwen3Config:
    """``config`` with Qwen3-FP8's ``quantization_config`` (dynamic activations, E4M3, ``block``)."""
    if config.quantization is not None:
        raise ValueError("config.json already has a quantization_config: the checkpoint is FP8 already")
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block sizes must be positive, got {(bn, bk)}")
    return dataclasses.replace(config, quantization=FP8QuantConfig(weight_block_size=(bn, bk)))


def quantize_tensors(config: Qwen3Config, tensors: Mapping[str, np.ndarray], block=(128, 128), progress: bool = False):
    """Quantize a BF16 checkpoint's tensors in memory; returns ``(fp8_config, tensors, stored_dtypes)``.

    Every projection ``w`` becomes ``fp8lab.reference.blockwise.quantize(w, block)``: E4M3 codes and F32
    ``weight_scale_inv``; all other tensors are kept as they are and written BF16. ``tensors``
    may be any mapping (``quantize_checkpoint`` passes one that reads each tensor on demand).
    """
    fp8_config = fp8_config_for(config, block)
    out, dtypes = {}, {}
    specs = expected_tensors(fp8_config)
    for name in _progress(specs, progress, "quantizing"):
        kind = specs[name].kind
        if kind == "fp8":
            out[name], out[scale_name(name)] = blockwise.quantize(tensors[name], fp8_config.quantization.weight_block_size)
        elif kind == "float":
            out[name] = tensors[name]
        dtypes[name] = WRITE_DTYPES[kind]
    return fp8_config, out, dtypes


class _TensorReader(Mapping):
    """A read-on-demand mapping over an ``OpenCheckpoint`` (values validated as they are read)."""

    def __init__(self, opened: OpenCheckpoint):
        self._opened = opened

    def __getitem__(self, name):
        return self._opened.read(name)

    def __iter__(self):
        return iter(self._opened.sources)

    def __len__(self):
        return len(self._opened.sources)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the small non-weight files of ``src`` (tokenizer, generation config, README, ...)
    to ``dst``; ``config.json`` and weights are not copied. Returns the copied names."""
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in (CONFIG_FILE, INDEX_FILE) or p.suffix in WEIGHT_SUFFIXES:
            continue
        if p.stat().st_size > MAX_SIDE_FILE_BYTES:
            warnings.warn(f"{p}: not copied, larger than {MAX_SIDE_FILE_BYTES} bytes")
            continue
        shutil.copyfile(p, dst / p.name)
        copied.append(p.name)
    return copied


def quantize_checkpoint(src, dst, block=(128, 128), progress: bool = True, max_shard_bytes: int | None = None) -> Path:
    """Read a BF16 checkpoint ``src`` and write its FP8 blockwise version to ``dst`` in the
    Qwen3-FP8 format: the seven projections of every layer as ``F8_E4M3`` plus ``F32``
    ``weight_scale_inv``; embeddings, norms and ``lm_head`` ``BF16``; ``quantization_config``
    ``{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: block}``.
    Tokenizer files, ``generation_config.json`` and other small files are copied unchanged.

    ``dst`` must not exist (or be empty); it appears only once complete. Returns ``dst``.
    """
    opened = open_checkpoint(src)
    if opened.config.quantization is not None:
        raise ValueError(f"{opened.path / CONFIG_FILE}: already an FP8 checkpoint (it has a quantization_config)")

    def build(tmp: Path) -> None:
        fp8_config, tensors, dtypes = quantize_tensors(opened.config, _TensorReader(opened), block, progress)
        save_checkpoint(tmp, fp8_config, tensors, dtypes, max_shard_bytes=max_shard_bytes)
        copy_side_files(opened.path, tmp)

    return build_atomically(dst, build)


# ----------------------------------------------------------------------------------------------
# Inspecting


@dataclass
class KindStats:
    count: int = 0
    params: int = 0
    bytes: int = 0
    dtypes: Counter = field(default_factory=Counter)


@dataclass
class CheckpointSummary:
    """What ``inspect`` found; ``problems`` lists value problems (NaN codes, non-finite values)."""

    path: Path
    config: Qwen3Config
    files: list[tuple[str, int]]
    kinds: dict[str, KindStats]
    fp8_projections: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]
    """Projection suffix (``self_attn.q_proj``) -> (weight shape, scale shape, number of layers)."""
    scale_inv: np.ndarray
    """All ``weight_scale_inv`` values, flattened (empty for a BF16 checkpoint)."""
    code_histogram: np.ndarray
    """Count of each of the 256 E4M3 codes over all FP8 weights."""
    problems: list[tuple[str, str, str]]
    """(file, tensor, problem) for every tensor whose values ``load_checkpoint`` would reject."""
    warnings: list[tuple[str, str, str]] = field(default_factory=list)
    """(file, tensor, warning) for tensors that load but whose magnitudes may overflow float32
    at run time (``magnitude_warning``)."""

    @property
    def ok(self) -> bool:
        """No value ``load_checkpoint`` would reject (warnings do not count: the checkpoint loads)."""
        return not self.problems


def summarize_checkpoint(path, progress: bool = False) -> CheckpointSummary:
    """Validate a checkpoint's structure and gather the statistics ``inspect`` prints.

    Structural problems raise as in ``load_checkpoint``; value problems (NaN codes...) are
    collected in ``problems`` instead. One tensor is in memory at a time.
    """
    opened = open_checkpoint(path)
    kinds = {kind: KindStats() for kind in ALLOWED_DTYPES}
    projections: dict[str, tuple] = {}
    histogram = np.zeros(256, dtype=np.int64)
    scales, problems, warnings_found = [], [], []
    for name in _progress(opened.sources, progress, f"inspecting {opened.path.name}"):
        spec, f = opened.specs[name], opened.sources[name]
        info = f.info(name)
        array = opened.read(name, validate_values=False)
        stats = kinds[spec.kind]
        stats.count, stats.params, stats.bytes = stats.count + 1, stats.params + array.size, stats.bytes + info.nbytes
        stats.dtypes[info.dtype] += 1
        problem = value_problem(spec.kind, array)
        if problem:
            problems.append((str(f.path), name, problem))
        elif (warning := _magnitude_warning_of(opened, name, array)) is not None:
            warnings_found.append((str(f.path), name, warning))
        if spec.kind == "fp8":
            histogram += np.bincount(array.ravel(), minlength=256)
            suffix = name.split(".", 3)[-1].removesuffix(".weight")
            scale_shape = opened.specs[scale_name(name)].shape
            layers = projections.get(suffix, (None, None, 0))[2] + 1
            projections[suffix] = (spec.shape, scale_shape, layers)
        elif spec.kind == "scale":
            scales.append(array.ravel())
    files = [(f.path.name, f.path.stat().st_size) for f in opened.files]
    scale_inv = np.concatenate(scales) if scales else np.zeros(0, np.float32)
    return CheckpointSummary(opened.path, opened.config, files, kinds, projections, scale_inv, histogram, problems,
                             warnings_found)  # fmt: skip


def _magnitude_warning_of(opened: OpenCheckpoint, name: str, array: np.ndarray) -> str | None:
    """``magnitude_warning`` for one tensor of ``opened`` (a scale speaks for its FP8 weight)."""
    kind = opened.specs[name].kind
    largest = largest_weight(kind, array)
    if largest is None:
        return None
    weight = _weight_of_scale(name) if kind == "scale" else name
    return magnitude_warning(largest, opened.specs[weight].shape[1])


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _format_histogram(histogram: np.ndarray) -> list[str]:
    """E4M3 codes by exponent field (sign ignored), plus zeros, subnormals, +-448 and NaN codes."""
    total = int(histogram.sum())
    magnitudes = histogram[:128] + histogram[128:]
    exponent_counts = magnitudes.reshape(16, 8).sum(axis=1)  # code = E << 3 | M
    lines = [f"E4M3 codes over {total:,} FP8 weights (by exponent field; value range of the field):"]
    widest = max(int(exponent_counts.max()), 1)
    for exponent, count in enumerate(exponent_counts):
        lo = e4m3.VALUES[exponent << 3 | (1 if exponent == 0 else 0)]
        hi = e4m3.VALUES[exponent << 3 | (7 if exponent < 15 else 6)]
        bar = "#" * round(40 * int(count) / widest)
        lines.append(f"  E={exponent:2d}  [{lo:<9.4g}, {hi:>5.4g}]  {int(count):>12,}  {100 * count / max(total, 1):6.2f}%  {bar}")
    zeros = int(magnitudes[0])
    subnormals = int(magnitudes[1:8].sum())
    saturated = int(magnitudes[e4m3.MAX_CODE])
    nans = int(magnitudes[0x7F])
    lines.append(f"  zeros {zeros:,}, subnormals {subnormals:,}, +-448 {saturated:,}, NaN codes {nans:,}")
    return lines


def format_summary(s: CheckpointSummary) -> str:
    """The human-readable report of ``fp8lab inspect``."""
    c = s.config
    q = c.quantization
    fmt = f"FP8 blockwise E4M3, weight_block_size {list(q.weight_block_size)}" if q else "not quantized (BF16 or other floats)"
    lines = [
        f"checkpoint   {s.path}",
        f"format       {fmt}",
        "files        " + ", ".join(f"{name} ({_human_bytes(size)})" for name, size in s.files),
        f"config       {c.num_hidden_layers} layers, hidden {c.hidden_size}, intermediate {c.intermediate_size}, "
        f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads, head_dim {c.head_dim}, "
        f"vocab {c.vocab_size}, tied embeddings {'yes' if c.tie_word_embeddings else 'no'}, rope_theta {c.rope_theta:g}",
        "",
        f"{'kind':<8}{'tensors':>8}{'params':>14}{'bytes':>12}  stored as",
    ]
    for kind, st in s.kinds.items():
        if st.count:
            dtypes = ", ".join(f"{d} x{n}" for d, n in sorted(st.dtypes.items()))
            lines.append(f"{kind:<8}{st.count:>8}{st.params:>14,}{_human_bytes(st.bytes):>12}  {dtypes}")
    lines.append("")
    if s.fp8_projections:
        lines.append("FP8 weights (per projection):")
        for suffix, (shape, sshape, layers) in s.fp8_projections.items():
            lines.append(f"  {suffix:<18} {str(list(shape)):<12} scales {str(list(sshape)):<10} in {layers} layers")
        sc = s.scale_inv
        lines.append(f"scale_inv    min {sc.min():.4g}, median {np.median(sc):.4g}, max {sc.max():.4g} over {sc.size:,} blocks")
        lines.extend(_format_histogram(s.code_histogram))
    else:
        lines.append("FP8 weights: none")
    lines.append("")
    if s.problems:
        lines.append(f"PROBLEMS ({len(s.problems)} tensors; load_checkpoint would refuse this checkpoint):")
        lines.extend(f"  {file}: {name}: {problem}" for file, name, problem in s.problems)
    if s.warnings:
        lines.append(f"WARNINGS ({len(s.warnings)} tensors; they load, but may overflow float32 at run time):")
        lines.extend(f"  {file}: {name}: {warning}" for file, name, warning in s.warnings)
    if not s.problems and not s.warnings:
        lines.append("NaN codes: none; all scales finite and positive; all float weights finite. Checkpoint OK.")
    elif not s.problems:
        lines.append("The checkpoint loads, but is not OK: see the warnings.")
    return "\n".join(lines)


def inspect_checkpoint(path, progress: bool = False) -> str:
    """Validate and summarize a checkpoint folder (``format_summary(summarize_checkpoint(path))``)."""
    return format_summary(summarize_checkpoint(path, progress=progress))
