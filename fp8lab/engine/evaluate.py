"""Perplexity, KL divergence and greedy agreement of the engine's numeric formats (``fp8lab eval``).

**Perplexity** (the protocol of the published tables; ``evaluate`` with one row, ``perplexity``):

- The whole text is tokenized once (``Tokenizer.encode``: no BOS, no chat template), and with
  ``max_tokens`` cut to its first ``max_tokens`` tokens.
- The ids are cut into non-overlapping chunks of ``chunk`` tokens (``split_chunks``). A last
  partial chunk counts when it has at least 2 tokens; a 1-token tail predicts nothing and is dropped.
- Each chunk runs from an empty KV cache (a new sequence at position 0) as a prefill with
  ``all_logits=True``. Within a chunk of ``n`` tokens, token ``i + 1`` is predicted from tokens
  ``0 .. i`` of the same chunk, ``i = 0 .. n - 2``: the first token of a chunk is never predicted and
  no chunk sees another's tokens, so a chunk contributes ``n - 1`` predictions.
- The NLL of a prediction is ``-log_softmax(logits[i])[ids[i + 1]]`` with the log-softmax computed in
  float64 from the model's float32 logits, summed in float64; ``ppl = exp(total NLL / predictions)``.
  A NaN or infinite logit makes its position's NLL NaN and so the perplexity NaN, never a number.
- A model that must not see more than ``max_tokens_per_forward`` tokens at once (the GPU model with
  float32 GEMM inputs: its SIMT GEMV takes at most 16 rows) gets each chunk as consecutive prefill
  pieces of the same sequence; the logits of the pieces, concatenated, are the chunk's logits.
- Speed: tokens of the chunks / wall time of the model's ``forward`` calls.

**Comparisons** (``evaluate`` with several ``CompareRow``; ``default_rows``): every row is an
``EvalConfig`` (weights BF16 or FP8, KV cache BF16 or FP8, GEMM inputs float32 or BF16, backend)
and names the row it is compared with (``vs``); row 0 is the baseline (all BF16, float32 inputs).
All models are loaded at once and run chunk by chunk in lock-step, so that no logits are kept
beyond the chunk at hand. For every row, against its ``vs`` row and against the baseline:

- **KL divergence** at each predicted position: ``KL(p_ref || p) = sum_v p_ref(v) (log p_ref(v) -
  log p(v))`` in nats, ``p_ref`` the comparison row's next-token distribution and ``p`` this row's
  (float64 log-softmax of each one's logits): the information lost by using this row in place of
  the reference. Reported as the mean over all predicted positions, and per position in the chunk
  (position ``i`` predicts token ``i + 1``), averaged over the chunks that reach it.
- **Greedy agreement**: ``N`` prompts of ``P`` tokens cut from the same (capped) token ids at evenly
  spaced offsets ``j * (L - P) // (N - 1)`` (``greedy_prompts``); every row generates ``T`` tokens
  greedily from each (argmax, the lowest index among equal maxima; no stop tokens, so all ``T`` are
  produced): each prompt prefilled on its own (in pieces as above), then decode steps of all prompts
  together (in groups of at most ``max_seqs_per_forward``). Reported: the share of prompts whose
  ``T`` tokens are identical to the reference row's, and the mean number of tokens before the first
  difference (``T`` for identical ones).
- The perplexity's **deviation**: ``ppl / ppl_ref - 1``.

Models: a BF16 checkpoint as loaded is the BF16-weights model; its FP8 twin is
``fp8lab.engine.checkpoint.quantize_tensors`` of it (128 x 128 blocks, what ``fp8lab quantize`` writes),
made in memory (``fp8_checkpoint``). GEMM inputs: ``ReferenceBackend(gemm_input=...)``; on the GPU
model ``"bf16"`` is ``f32_max_rows=0`` and ``"float32"`` is ``f32_max_rows=16`` with at most 16
tokens per forward (``fp8lab.engine.loading.load_model``).
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from fp8lab.reference.kv_cache import KV_CACHE_FORMATS

from .backend import GEMM_INPUTS
from .kv_manager import KVCacheManager, blocks_for
from .loading import load_model
from .model import make_batch

WEIGHTS = ("bf16", "fp8")
KV_CACHE_DTYPES = tuple(KV_CACHE_FORMATS)
BACKENDS = ("reference", "cuda", "cudasim")
F32_GEMM_ROWS = 16
"""Most rows a GPU FP8 GEMM takes in float32 (``fp8lab.numba_kernels.gemv_simt.MAX_ROWS``; not imported here,
because importing Numba fixes the choice of its CUDA simulator)."""
FP8_BLOCK = (128, 128)
BLOCK_SIZE = 16
"""Tokens per KV cache block."""
SCORE_ROWS = 64
"""Positions whose float64 log-softmax is held at once while scoring a chunk (bounds the memory)."""
DEFAULT_TEXT = Path(__file__).parent / "data" / "demo_heldout.txt"


# ---------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class EvalConfig:
    """One numeric configuration of the engine: weight format, KV cache format, format of the
    activations entering the FP8 GEMMs and the lm_head, backend."""

    weights: str = "fp8"
    kv_cache_dtype: str = "fp8"
    gemm_input: str = "float32"
    backend: str = "reference"

    def __post_init__(self):
        for name, value, choices in (("weights", self.weights, WEIGHTS), ("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
                                     ("gemm_input", self.gemm_input, GEMM_INPUTS), ("backend", self.backend, BACKENDS)):
            if value not in choices:
                raise ValueError(f"EvalConfig.{name}: expected one of {', '.join(choices)}, got {value!r}")

    @property
    def label(self) -> str:
        """E.g. ``FP8 weights / BF16 KV / bf16 inputs / reference``."""
        return f"{self.weights.upper()} weights / {self.kv_cache_dtype.upper()} KV / {self.gemm_input} inputs / {self.backend}"

    def as_dict(self) -> dict:
        return {"weights": self.weights, "kv_cache_dtype": self.kv_cache_dtype, "gemm_input": self.gemm_input,
                "backend": self.backend}


@dataclass(frozen=True)
class CompareRow:
    """A row of the comparison table: ``config``, compared with row ``vs`` (an index; row 0, the
    baseline, is compared with itself); ``what`` says what the row isolates."""

    what: str
    config: EvalConfig
    vs: int = 0


def default_rows(backend: str = "reference", kernel_backend: str | None = None) -> list[CompareRow]:
    """The comparison of ``fp8lab eval --compare`` on ``backend``:

    ====  ================================  =======  ====  =========  ==========
    row   what                              weights  KV    GEMM in    vs
    ====  ================================  =======  ====  =========  ==========
    0     BF16 baseline                     bf16     bf16  float32    0 (itself)
    1     FP8 weights                       fp8      bf16  float32    0
    2     FP8 KV cache                      bf16     fp8   float32    0
    3     FP8 weights, BF16 GEMM inputs     fp8      bf16  bf16       1
    4     FP8 weights + FP8 KV              fp8      fp8   float32    0
    5     FP8 weights + FP8 KV, BF16 in     fp8      fp8   bf16       4
    ====  ================================  =======  ====  =========  ==========

    Rows 3 and 5 are compared with the same configuration on float32 inputs, which isolates the
    input format. With ``kernel_backend`` (``cuda`` or ``cudasim``) the same six follow on that
    backend, each compared with its twin on ``backend``, so those rows isolate the kernels.
    """
    base = [("BF16 baseline", "bf16", "bf16", "float32", 0), ("FP8 weights", "fp8", "bf16", "float32", 0),
            ("FP8 KV cache", "bf16", "fp8", "float32", 0), ("FP8 weights, BF16 GEMM inputs", "fp8", "bf16", "bf16", 1),
            ("FP8 weights + FP8 KV", "fp8", "fp8", "float32", 0),
            ("FP8 weights + FP8 KV, BF16 GEMM inputs", "fp8", "fp8", "bf16", 4)]
    rows = [CompareRow(what, EvalConfig(w, kv, gi, backend), vs) for what, w, kv, gi, vs in base]
    if kernel_backend is not None:
        rows += [CompareRow(f"{r.what} ({kernel_backend} vs {backend})",
                            EvalConfig(r.config.weights, r.config.kv_cache_dtype, r.config.gemm_input, kernel_backend), i)
                 for i, r in enumerate(rows[: len(base)])]
    return rows


def check_rows(rows: Sequence[CompareRow]) -> None:
    """Raise ``ValueError`` unless every ``vs`` names an existing row."""
    if not rows:
        raise ValueError("rows: expected at least one row")
    for i, row in enumerate(rows):
        if not 0 <= row.vs < len(rows):
            raise ValueError(f"row {i} ({row.what}): vs={row.vs} is not a row index (0 .. {len(rows) - 1})")


# ---------------------------------------------------------------------------- the text


def default_eval_text() -> Path:
    """The shipped held-out text (``fp8lab/engine/data/demo_heldout.txt``); ``FileNotFoundError`` when absent."""
    if not DEFAULT_TEXT.is_file():
        raise FileNotFoundError(f"no default evaluation text ({DEFAULT_TEXT} is not shipped in this install); "
                                "pass --text FILE")
    return DEFAULT_TEXT


@dataclass(frozen=True)
class EvalText:
    """The token ids evaluated (``ids``, after the cap) and where they came from."""

    path: Path
    sha256: str
    total_tokens: int
    ids: np.ndarray


def read_eval_text(path, tokenizer, max_tokens: int | None = None) -> EvalText:
    """Tokenize the UTF-8 text file ``path`` whole and keep its first ``max_tokens`` ids (all: ``None``)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    kept = ids if max_tokens is None else ids[: int(max_tokens)]
    return EvalText(path, hashlib.sha256(data).hexdigest(), len(ids), kept)


def split_chunks(ids, chunk: int) -> list[np.ndarray]:
    """Non-overlapping chunks of ``chunk`` tokens; a last partial chunk is kept if it has >= 2 tokens."""
    if int(chunk) < 2:
        raise ValueError(f"chunk: expected at least 2 tokens (one to condition on, one to predict), got {chunk}")
    ids = np.asarray(ids, dtype=np.int64)
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    return [c for c in chunks if len(c) >= 2]


def greedy_prompts(ids, num_prompts: int, prompt_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """``num_prompts`` prompts of ``prompt_tokens`` ids at evenly spaced offsets ``j * (L - P) // (N - 1)``
    (offset 0 for one prompt); returns ``(offsets, prompts)``."""
    ids = np.asarray(ids, dtype=np.int64)
    n, p = int(num_prompts), int(prompt_tokens)
    if n < 1 or p < 1:
        raise ValueError(f"greedy prompts: expected >= 1 prompts of >= 1 tokens, got {n} of {p}")
    if len(ids) < p:
        raise ValueError(f"greedy prompts of {p} tokens: the text has only {len(ids)} tokens")
    span = len(ids) - p
    offsets = [j * span // (n - 1) if n > 1 else 0 for j in range(n)]
    return offsets, [ids[o : o + p] for o in offsets]


# ---------------------------------------------------------------------------- scoring logits


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis in float64; a NaN or infinite logit makes its row NaN."""
    x = np.asarray(logits, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        shifted = x - m  # inf - inf = NaN: an infinite logit poisons its row, as NaN does
        out = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    bad = ~np.all(np.isfinite(x), axis=-1)
    out[bad] = np.nan
    return out


def token_nll(logp: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``-logp[i, targets[i]]`` (float64): the NLL of each target under its row's log-probabilities."""
    return -logp[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]


def kl_divergence(logp_ref: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """``KL(p_ref || p)`` in nats for each row (float64): ``sum_v p_ref(v) (log p_ref(v) - log p(v))``.

    Terms with ``p_ref(v) = 0`` are 0 (``log p_ref = -inf``); a NaN row gives NaN."""
    p_ref = np.exp(logp_ref)
    with np.errstate(invalid="ignore"):
        terms = np.where(p_ref > 0, p_ref * (logp_ref - logp), 0.0)
    kl = np.sum(terms, axis=-1)
    kl[np.isnan(logp_ref).any(axis=-1) | np.isnan(logp).any(axis=-1)] = np.nan
    return kl


class PositionMeans:
    """Running sums of a per-position quantity over chunks: the mean over everything, and per
    position the mean over the chunks that reach it."""

    def __init__(self, length: int):
        self.sums = np.zeros(int(length), np.float64)
        self.counts = np.zeros(int(length), np.int64)

    def add(self, values: np.ndarray) -> None:
        n = len(values)
        self.sums[:n] += values
        self.counts[:n] += 1

    @property
    def total(self) -> float:
        return float(np.sum(self.sums))

    @property
    def count(self) -> int:
        return int(np.sum(self.counts))

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else float("nan")

    @property
    def per_position(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.sums / self.counts


def agreement(ref_tokens: np.ndarray, tokens: np.ndarray) -> tuple[float, float, list[int]]:
    """Greedy agreement of ``tokens [N, T]`` with ``ref_tokens [N, T]``: the share of prompts whose
    ``T`` tokens are identical, the mean number of tokens before the first difference (``T`` when
    identical), and that number per prompt."""
    ref_tokens, tokens = np.asarray(ref_tokens), np.asarray(tokens)
    same = ref_tokens == tokens
    t = same.shape[1]
    first_diff = [int(np.argmin(row)) if not row.all() else t for row in same]
    return float(np.mean([d == t for d in first_diff])), float(np.mean(first_diff)), first_diff


# ---------------------------------------------------------------------------- running a configuration


def pieces(ids: np.ndarray, size: int | None) -> list[np.ndarray]:
    """``ids`` in consecutive pieces of at most ``size`` (``None``: one piece)."""
    if size is None or len(ids) <= size:
        return [ids]
    return [ids[i : i + size] for i in range(0, len(ids), size)]


class ModelRunner:
    """A configuration's model with a KV cache of its own: the logits of a chunk, greedy continuations.

    ``max_tokens_per_forward`` / ``max_seqs_per_forward``: most tokens / sequences one ``forward``
    may take (``None``: any). Each chunk and each greedy run starts a fresh ``KVCacheManager`` over the
    same cache storage: a new sequence whose slots are all written before they are read.
    ``nonfinite`` collects a note for every chunk or greedy run that produced a NaN or infinite logit.
    """

    def __init__(self, config: EvalConfig, model, num_blocks: int, block_size: int = BLOCK_SIZE,
                 max_tokens_per_forward: int | None = None, max_seqs_per_forward: int | None = None):
        self.config, self.model = config, model
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.max_tokens_per_forward, self.max_seqs_per_forward = max_tokens_per_forward, max_seqs_per_forward
        self.cache = model.allocate_kv_cache(self.num_blocks, self.block_size, config.kv_cache_dtype)
        self.chunk_seconds = 0.0
        self.chunk_tokens = 0
        self.greedy_seconds = 0.0
        self.nonfinite: list[str] = []

    def warm_up(self, ids: np.ndarray) -> None:
        """One untimed chunk (on a GPU the first calls compile the kernels), then the counters reset."""
        self.chunk_logits(ids)
        self.chunk_seconds, self.chunk_tokens, self.nonfinite = 0.0, 0, []

    def _forward(self, manager: KVCacheManager, chunks, all_logits: bool = False) -> np.ndarray:
        return self.model.forward(make_batch(manager, chunks), self.cache, all_logits=all_logits)

    def chunk_logits(self, ids: np.ndarray, where: str = "") -> np.ndarray:
        """float32 logits ``[n, vocab]`` of every position of ``ids``, one sequence from an empty cache."""
        manager = KVCacheManager(self.num_blocks, self.block_size)
        manager.add_sequence(0)
        start = time.perf_counter()
        logits = [self._forward(manager, [(0, piece)], all_logits=True) for piece in pieces(ids, self.max_tokens_per_forward)]
        self.chunk_seconds += time.perf_counter() - start
        self.chunk_tokens += len(ids)
        out = np.concatenate(logits)
        if not np.all(np.isfinite(out)):
            self.nonfinite.append(f"NaN or infinite logits in {where or 'a chunk'}")
        return out

    def greedy(self, prompts: Sequence[np.ndarray], new_tokens: int) -> np.ndarray:
        """``new_tokens`` greedy tokens after each prompt: int64 ``[len(prompts), new_tokens]``."""
        manager = KVCacheManager(self.num_blocks, self.block_size)
        out = np.zeros((len(prompts), int(new_tokens)), np.int64)
        finite = True
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            manager.add_sequence(i)
            for piece in pieces(np.asarray(prompt, np.int64), self.max_tokens_per_forward):
                logits = self._forward(manager, [(i, piece)])
            finite &= bool(np.all(np.isfinite(logits)))
            out[i, 0] = np.argmax(logits[0])
        group = self.max_seqs_per_forward or len(prompts)
        for step in range(1, int(new_tokens)):
            for first in range(0, len(prompts), group):
                seqs = range(first, min(first + group, len(prompts)))
                logits = self._forward(manager, [(i, [int(out[i, step - 1])]) for i in seqs])
                finite &= bool(np.all(np.isfinite(logits)))
                out[first : first + len(seqs), step] = np.argmax(logits, axis=1)
        self.greedy_seconds += time.perf_counter() - start
        if not finite:
            self.nonfinite.append("NaN or infinite logits in the greedy runs")
        return out


def fp8_checkpoint(checkpoint):
    """The FP8 twin of a BF16 ``Checkpoint``, in memory: ``quantize_tensors`` with 128 x 128 blocks."""
    from .checkpoint import Checkpoint, quantize_tensors

    if checkpoint.is_fp8:
        raise ValueError(f"{checkpoint.path}: already an FP8 checkpoint; the comparison needs the BF16 checkpoint "
                         "it was quantized from")
    config, tensors, dtypes = quantize_tensors(checkpoint.config, checkpoint.tensors, block=FP8_BLOCK)
    return Checkpoint(checkpoint.path, config, tensors, dtypes, checkpoint.generation_config)


def build_runners(checkpoints: dict[str, object], configs: Iterable[EvalConfig], *, max_len: int, num_seqs: int = 1,
                  max_cached_tokens: int | None = None, f32_rows: int = F32_GEMM_ROWS) -> dict[EvalConfig, ModelRunner]:
    """A ``ModelRunner`` per distinct config; configs that differ only in the KV cache share one model.

    ``checkpoints``: ``{"bf16": ..., "fp8": ...}`` (the formats the configs need). ``max_len``: the
    longest token run fed at once (a chunk, a prompt); ``num_seqs``: sequences decoded together (the
    greedy prompts); ``max_cached_tokens``: most tokens the greedy runs hold per sequence. The GPU
    model with FP8 weights and float32 inputs gets at most ``f32_rows`` tokens and sequences per
    forward (and ``f32_max_rows = f32_rows``), every other GPU model whole chunks and prompts.
    """
    num_blocks = max(blocks_for(max_len, BLOCK_SIZE), num_seqs * blocks_for(max_cached_tokens or 1, BLOCK_SIZE))
    models: dict[tuple, object] = {}
    runners: dict[EvalConfig, ModelRunner] = {}
    for cfg in configs:
        if cfg in runners:
            continue
        limit = seqs = None
        options = {}
        if cfg.backend != "reference":
            limit = f32_rows if (cfg.weights == "fp8" and cfg.gemm_input == "float32") else max(max_len, num_seqs)
            # max_num_seqs = max_num_tokens: all_logits runs the lm_head in blocks of max_num_seqs rows
            seqs = limit
            options = dict(max_num_tokens=limit, max_num_seqs=seqs)
            if cfg.gemm_input == "float32":
                options["f32_max_rows"] = min(f32_rows, limit)
        key = (cfg.weights, cfg.gemm_input, cfg.backend)
        if key not in models:
            models[key] = load_model(checkpoints[cfg.weights], cfg.backend, gemm_input=cfg.gemm_input, **options)
        runners[cfg] = ModelRunner(cfg, models[key], num_blocks, BLOCK_SIZE, limit, seqs)
    return runners


# ---------------------------------------------------------------------------- evaluating


@dataclass
class RowResult:
    """What one row measured (see the module docstring for each quantity)."""

    row: CompareRow
    nll: PositionMeans
    chunk_nll: list[float] = field(default_factory=list)
    """Summed NLL of each chunk."""
    kl: dict[int, PositionMeans] = field(default_factory=dict)
    """Row index -> KL(p_that_row || p_this_row) per position."""
    greedy_tokens: np.ndarray | None = None
    greedy: dict[int, tuple[float, float, list[int]]] = field(default_factory=dict)
    """Row index -> ``agreement(that row's tokens, this row's tokens)``."""
    tokens_per_s: float = float("nan")
    forward_seconds: float = 0.0
    nonfinite: list[str] = field(default_factory=list)

    @property
    def mean_nll(self) -> float:
        return self.nll.mean

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll) if math.isfinite(self.mean_nll) else float("nan")

    @property
    def predicted_tokens(self) -> int:
        return self.nll.count


@dataclass
class Evaluation:
    """The result of ``evaluate``: one ``RowResult`` per row, plus the chunk and prompt layout."""

    rows: list[RowResult]
    max_chunk_len: int
    chunk_lengths: list[int]
    prompt_offsets: list[int]
    prompt_tokens: int
    new_tokens: int

    def deviation(self, i: int, j: int) -> float:
        """``ppl_i / ppl_j - 1`` (NaN when either is NaN)."""
        a, b = self.rows[i].ppl, self.rows[j].ppl
        return a / b - 1 if math.isfinite(a) and math.isfinite(b) else float("nan")

    @property
    def ok(self) -> bool:
        """No row saw a NaN or infinite logit (so every number is a number)."""
        return not any(r.nonfinite for r in self.rows)


def _pairs(rows: Sequence[CompareRow]) -> list[tuple[int, int]]:
    """(row, reference row) pairs to score: each row against its ``vs`` row and against row 0."""
    return sorted({(i, j) for i, row in enumerate(rows) for j in (row.vs, 0)})


def _score_chunk(results: list[RowResult], logits: list[np.ndarray], ids: np.ndarray, pairs) -> None:
    """Add one chunk's NLL and KL to every row, ``SCORE_ROWS`` positions at a time."""
    n = len(ids) - 1  # predicted positions 0 .. n - 1
    nll = [np.empty(n) for _ in results]
    kl = {pair: np.empty(n) for pair in pairs}
    for a in range(0, n, SCORE_ROWS):
        b = min(a + SCORE_ROWS, n)
        logp = [log_softmax64(x[a:b]) for x in logits]
        for i in range(len(results)):
            nll[i][a:b] = token_nll(logp[i], ids[a + 1 : b + 1])
        for i, j in pairs:
            kl[i, j][a:b] = kl_divergence(logp[j], logp[i])
    for i, r in enumerate(results):
        r.nll.add(nll[i])
        r.chunk_nll.append(float(np.sum(nll[i])))
    for (i, j), values in kl.items():
        results[i].kl.setdefault(j, PositionMeans(len(results[i].nll.sums))).add(values)


def evaluate(rows: Sequence[CompareRow], runners: dict[EvalConfig, ModelRunner], chunks: Sequence[np.ndarray],
             prompts: Sequence[np.ndarray] = (), prompt_offsets: Sequence[int] = (), new_tokens: int = 0,
             progress: bool = False) -> Evaluation:
    """Run every row over ``chunks`` in lock-step, then the greedy prompts (skipped without prompts or
    with ``new_tokens=0``); see the module docstring for what is measured."""
    check_rows(rows)
    if not chunks:
        raise ValueError("no chunk of at least 2 tokens to evaluate")
    chunk = max(len(c) for c in chunks)
    results = [RowResult(row, PositionMeans(chunk - 1)) for row in rows]
    pairs = _pairs(rows) if len(rows) > 1 else []
    configs = list(dict.fromkeys(r.config for r in rows))
    for cfg in configs:
        if cfg.backend == "cuda":
            runners[cfg].warm_up(chunks[0])
    for index, ids in enumerate(tqdm(chunks, desc=f"eval ({len(configs)} config{'s' * (len(configs) > 1)})",
                                     unit="chunk", file=sys.stderr, disable=not progress, leave=False)):
        by_config = {cfg: runners[cfg].chunk_logits(ids, f"chunk {index}") for cfg in configs}
        _score_chunk(results, [by_config[r.config] for r in rows], ids, pairs)
    if len(prompts) and new_tokens > 0:
        tokens = {cfg: runners[cfg].greedy(prompts, new_tokens)
                  for cfg in tqdm(configs, desc="greedy", unit="config", file=sys.stderr, disable=not progress, leave=False)}
        for r in results:
            r.greedy_tokens = tokens[r.row.config]
        for i, j in pairs or [(0, 0)]:
            results[i].greedy[j] = agreement(results[j].greedy_tokens, results[i].greedy_tokens)
    for r in results:
        runner = runners[r.row.config]
        r.forward_seconds = runner.chunk_seconds
        r.tokens_per_s = runner.chunk_tokens / runner.chunk_seconds if runner.chunk_seconds > 0 else float("nan")
        r.nonfinite = list(runner.nonfinite)
    return Evaluation(results, chunk, [len(c) for c in chunks], list(prompt_offsets),
                      len(prompts[0]) if len(prompts) else 0, int(new_tokens) if len(prompts) else 0)


def perplexity(runner: ModelRunner, chunks: Sequence[np.ndarray], progress: bool = False) -> RowResult:
    """The perplexity protocol with one configuration: ``evaluate`` of a single row, no greedy runs."""
    row = CompareRow("perplexity", runner.config, 0)
    return evaluate([row], {runner.config: runner}, chunks, progress=progress).rows[0]


# ---------------------------------------------------------------------------- reporting


def _finite(x):
    """``x`` as a JSON value: NaN and infinities become ``None`` (JSON has no NaN)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def evaluation_json(result: Evaluation, settings: dict) -> dict:
    """Every number of ``result`` as a JSON-ready dict (NaN as ``null``), with ``settings`` (model,
    text, sha256, token counts...) at the top level. Deviations are fractions (0.01 = 1%)."""
    out = dict(settings)
    out.update(num_chunks=len(result.chunk_lengths), chunk_lengths=result.chunk_lengths,
               predicted_tokens=result.rows[0].predicted_tokens,
               greedy={"prompts": len(result.prompt_offsets), "prompt_tokens": result.prompt_tokens,
                       "new_tokens": result.new_tokens, "offsets": result.prompt_offsets},
               rows=[])
    for i, r in enumerate(result.rows):
        row = {"index": i, "what": r.row.what, "label": r.row.config.label, **r.row.config.as_dict(), "vs": r.row.vs,
               "ppl": r.ppl, "mean_nll": r.mean_nll, "predicted_tokens": r.predicted_tokens,
               "tokens_per_s": r.tokens_per_s, "forward_seconds": r.forward_seconds,
               "chunk_nll": r.chunk_nll, "position_mean_nll": r.nll.per_position.tolist(),
               "nonfinite": r.nonfinite}
        if r.greedy_tokens is not None:
            row["greedy_tokens"] = r.greedy_tokens.tolist()
        if len(result.rows) > 1:
            for key, j in (("vs", r.row.vs), ("baseline", 0)):
                row[f"ppl_deviation_{key}"] = result.deviation(i, j)
                row[f"kl_{key}"] = r.kl[j].mean
                row[f"position_mean_kl_{key}"] = r.kl[j].per_position.tolist()
                if j in r.greedy:
                    share, mean_diff, per_prompt = r.greedy[j]
                    row[f"greedy_identical_{key}"] = share
                    row[f"greedy_tokens_to_first_diff_{key}"] = mean_diff
                    row[f"greedy_first_diff_per_prompt_{key}"] = per_prompt
        out["rows"].append(row)
    return _finite(out)


def _kl_cell(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def _greedy_cell(r: RowResult, j: int) -> str:
    if j not in r.greedy:
        return "-"
    share, mean_diff, _ = r.greedy[j]
    return f"{share:.2f} / {mean_diff:.1f}"


def format_table(result: Evaluation) -> str:
    """The comparison table, with a legend."""
    header = ["#", "weights", "kv", "gemm in", "backend", "vs", "ppl", "dppl vs", "dppl BF16", "KL vs", "KL BF16",
              "greedy vs", "greedy BF16", "tok/s"]
    lines = []
    for i, r in enumerate(result.rows):
        c, vs = r.row.config, r.row.vs
        lines.append([str(i), c.weights, c.kv_cache_dtype, c.gemm_input, c.backend, str(vs), f"{r.ppl:.4f}",
                      f"{100 * result.deviation(i, vs):+.3f}%", f"{100 * result.deviation(i, 0):+.3f}%",
                      _kl_cell(r.kl[vs].mean), _kl_cell(r.kl[0].mean), _greedy_cell(r, vs), _greedy_cell(r, 0),
                      f"{r.tokens_per_s:.1f}"])
    widths = [max(len(h), *(len(line[k]) for line in lines)) for k, h in enumerate(header)]
    left = {1, 2, 3, 4}

    def fmt(cells):
        return "  ".join(cell.ljust(w) if k in left else cell.rjust(w) for k, (cell, w) in enumerate(zip(cells, widths)))

    n, p, t = len(result.prompt_offsets), result.prompt_tokens, result.new_tokens
    legend = [
        "",
        f"ppl over {result.rows[0].predicted_tokens} predicted tokens in {len(result.chunk_lengths)} non-overlapping "
        f"chunks of up to {result.max_chunk_len} tokens, each from an empty KV cache.",
        "vs: the row each row is compared with (row 0: the all-BF16 baseline); dppl: ppl / ppl_ref - 1;",
        "KL: mean KL(p_ref || p) of the next-token distributions over all predicted positions, in nats;",
        f"greedy: share of {n} prompts of {p} tokens whose {t} greedy tokens equal the reference's / mean tokens "
        "before the first difference;" if n else "greedy: not run;",
        "tok/s: chunk tokens per second of forward passes.",
        "rows:",
    ] + [f"{i:>3}  {r.row.what}" for i, r in enumerate(result.rows)]
    return "\n".join([fmt(header)] + [fmt(line) for line in lines] + legend)


def format_perplexity(result: Evaluation, settings: dict) -> str:
    """The report of a single-configuration run (``result`` has one row)."""
    r = result.rows[0]
    tokens = sum(result.chunk_lengths)
    used = (f"{settings['text_tokens']} tokens" if settings["eval_tokens"] == settings["text_tokens"]
            else f"the first {settings['eval_tokens']} of {settings['text_tokens']} tokens")
    return "\n".join([
        f"model       {settings['model']}",
        f"text        {settings['text']} (sha256 {settings['text_sha256'][:16]}..., {used})",
        f"config      {r.row.config.label}",
        f"chunks      {len(result.chunk_lengths)} of up to {result.max_chunk_len} tokens, non-overlapping, each from an "
        f"empty KV cache: {r.predicted_tokens} predicted tokens",
        f"ppl         {r.ppl:.4f}",
        f"mean NLL    {r.mean_nll:.6f} nats per predicted token",
        f"speed       {r.tokens_per_s:.1f} tokens/s ({tokens} tokens in {r.forward_seconds:.3f} s of forward passes)",
    ])
