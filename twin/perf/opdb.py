"""Step time from aiconfigurator-core's per-operation latencies measured on real GPUs
under SGLang (the `opdb` backend).

A step is composed from measured ops for the actual heterogeneous batch:
- token-major groups (GEMMs/MoE, norms and embedding, TP all-reduce) at the step's token
  count (context-phase ops when the step has prefill, decode-phase ops otherwise; a
  decode-only step under a CUDA graph runs padded to SGLang's next captured batch size);
- the LM head for the rows that emit a token (one per prefill chunk and decode request);
- context attention per prefill chunk at (new tokens, cached prefix);
- decode attention for the decode set at (batch size, mean KV length). Folding variable
  KV lengths in by their mean is what lets `decode_times` advance runs of decode steps
  vectorised; its error against per-request evaluation is measured in docs/perf.md;
- a per-step overhead: SGLang's scheduler CPU work, a part per step and a part per
  request in the batch (measured: twin/perf/step_cpu.py), plus kernel launches (smaller
  under a CUDA graph), the same constants as the roofline backend (`RooflineParams`).

Everything is tabulated at start-up on grids (tokens: every integer to 256, then ratio
2^(1/8); chunk and prefix lengths: ratio 2^(1/2); decode batch: every integer to 64 then
2^(1/8); mean KV: ratio 2^(1/4)) and interpolated linearly, so a step costs a few array
lookups and no aiconfigurator call. Smoothing (so step time is non-decreasing in batch
size and KV length): each token-major table is replaced by its isotonic (least-squares
non-decreasing) fit; the attention grids by their running maximum along both axes.
Linear interpolation of a monotone grid is monotone.

A100 PCIe has no data: kernel times are A100 SXM's scaled by the HBM bandwidth ratio
2039/1935 (same 1410 MHz boost clock), and TP all-reduce is re-priced for PCIe 4.0 x16.
"""

from __future__ import annotations

import bisect
import copy
import functools
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from twin.config import Capacity, ServerArgs
from twin.errors import ConfigError
from twin.perf import PrefillChunk, register_backend
from twin.perf.roofline import RooflineParams

log = logging.getLogger("twin.perf.opdb")

# GPUs without data, derived from a measured one: (system, kernel-time scale, why).
DERIVED = {
    "a100-pcie-80gb": ("a100_sxm", 2039 / 1935,
                       "A100 SXM data x 1.054 (HBM 2039/1935 GB/s; same 1410 MHz boost "
                       "clock); TP all-reduce re-priced for PCIe 4.0 x16"),
}
# SGLang's captured CUDA-graph batch sizes (cuda_graph_runner, no speculative decoding).
_GRAPH_BS = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, 4097, 32)]


@dataclass(frozen=True)
class OpdbParams:
    smooth: bool = True
    overhead: RooflineParams = RooflineParams()


def system_for(gpu_name: str, native: str | None) -> tuple[str | None, float, str]:
    """(aiconfigurator system, kernel-time scale, provenance note) for a GPU."""
    if native:
        return native, 1.0, f"measured on {native}"
    if gpu_name in DERIVED:
        return DERIVED[gpu_name]
    return None, 1.0, "no data"


def _grid(lo: int, hi: int, ratio: float, dense_to: int = 0) -> np.ndarray:
    pts = set(range(lo, min(dense_to, hi) + 1))
    x = float(max(lo, 1))
    while x < hi:
        pts.add(int(round(x)))
        x *= ratio
    pts.add(hi)
    return np.array(sorted(p for p in pts if lo <= p <= hi), dtype=np.int64)


_TOKEN_GROUPS = ("gemm", "norms", "allreduce")


def _dense(dense: np.ndarray, grid: np.ndarray, vals: np.ndarray) -> np.ndarray:
    out = np.interp(dense, grid, vals)
    out[0] = 0.0  # no tokens, no work
    return out


def _quant(c: Capacity, quantization: str | None) -> dict:
    from twin.perf import aic

    kv_dtype_bytes = c.kv_bytes_per_token / c.model.kv_bytes_per_token(c.tp_size, 1.0)
    return aic.quant_modes(c.model, kv_dtype_bytes, quantization)


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """The table-building code itself is part of the key: an edit rebuilds."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("opdb.py", "aic.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _version(module: str) -> str | None:
    """An installed package's version, from its dist-info directory's name when there is
    one beside it (importlib.metadata costs ~40 ms of start-up), else from its metadata."""
    from importlib import metadata, util

    spec = util.find_spec(module)
    if spec is None:
        return None
    for where in spec.submodule_search_locations or ():
        for info in sorted(Path(where).parent.glob(f"{module}-*.dist-info")):
            return info.name[len(module) + 1:-len(".dist-info")]
    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def _model_key(m) -> dict:
    key = {f.name: getattr(m, f.name) for f in fields(m) if f.name != "hf_config"}
    cfg = json.dumps(dict(m.hf_config), sort_keys=True, default=str)
    key["hf_config"] = hashlib.sha256(cfg.encode()).hexdigest()[:16]
    return key


def _isotonic(y: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (running maximum where scipy < 1.12)."""
    try:
        from scipy.optimize import isotonic_regression
    except ImportError:
        return np.maximum.accumulate(y)
    return np.asarray(isotonic_regression(y).x)


class OpdbStepTime:
    name = "opdb"

    @property
    def quiet_kv_mean(self) -> float:
        """`decode_times` warns (once) beyond this mean KV length, never below it
        (twin/perf/step_cache.py computes ahead only below it)."""
        return float(self.extents.decode_kv)

    def __init__(self, capacity: Capacity, args: ServerArgs,
                 params: OpdbParams | None = None, framework: str = "sglang") -> None:
        self.framework = framework
        self.params = p = params or OpdbParams()
        self.capacity = c = capacity
        m = c.model
        system, self._scale, self.provenance = system_for(c.gpu.name, c.gpu.aiconfigurator_system)
        if system is None:
            raise ConfigError(f"--step-time-backend opdb: aiconfigurator-core has no data for "
                              f"{c.gpu.name}; use --step-time-backend roofline")
        self._system = system
        self._quant = _quant(c, args.quantization)
        self._warned: set[str] = set()
        self._graph_bs = 0 if args.disable_cuda_graph else c.cuda_graph_max_bs
        self._eager, self._graph, self._per_request = p.overhead.overheads(m.num_layers)
        chunk = c.chunked_prefill_size or c.max_prefill_tokens
        self.max_tokens = max(chunk, c.max_prefill_tokens, c.context_len) + c.max_running_requests
        self.max_batch = max(c.max_running_requests, 1)
        self.from_cache = self._load_tables()
        self._decode_const: dict[int, tuple[float, np.ndarray]] = {}

    # -- tables: built from aiconfigurator once, then read from the disk cache ----------
    def cache_key(self) -> dict:
        """Everything the tables depend on (twin/perf/table_cache.py)."""
        c = self.capacity
        return {"code": _code_digest(), "aiconfigurator_core": _version("aiconfigurator_core"),
                "scipy": _version("scipy"), "numpy": np.__version__,
                "framework": self.framework, "system": self._system, "scale": self._scale,
                "gpu": asdict(c.gpu), "model": _model_key(c.model), "tp": c.tp_size,
                "kv_bytes_per_token": c.kv_bytes_per_token, "quant": self._quant,
                "max_tokens": self.max_tokens, "max_batch": self.max_batch,
                "context_len": c.context_len, "params": asdict(self.params)}

    def _load_tables(self) -> bool:
        """Tables from the disk cache (True), else built and stored (False)."""
        from twin.perf import table_cache

        key = self.cache_key()
        hit = table_cache.load("opdb", key)
        if hit is not None:
            try:
                self._set_tables(hit)
                return True
            except (KeyError, ValueError, IndexError):
                log.info("opdb table cache entry incomplete; rebuilding")
        arrays = self._build_tables()
        table_cache.store("opdb", key, arrays)
        self._set_tables(arrays)
        return False

    def _build_tables(self) -> dict[str, np.ndarray]:
        from twin.perf import aic

        c = self.capacity
        self.ops = aic.compile_model(c.model, self._system, c.tp_size, self._quant,
                                     self.framework)
        out = self._token_tables()
        out.update(self._context_attention())
        out.update(self._decode_attention())
        e = self.ops.extents
        out["extents"] = np.array([e.gemm_tokens, e.context_tokens, e.decode_batch,
                                   e.decode_kv], dtype=np.int64)
        out["fill_ins"] = np.array(sorted(self.ops.provenance), dtype=str)
        return out

    def _set_tables(self, t: dict[str, np.ndarray]) -> None:
        from twin.perf.aic import Extents

        # the token tables are stored on their grid and made dense here (a tenth the bytes)
        grid, dense = t["tok_grid"], np.arange(self.max_tokens + 1)
        self.tok = {ph: {g: _dense(dense, grid, t[f"{ph}_{g}"]) for g in _TOKEN_GROUPS}
                    for ph in ("ctx", "gen")}
        self.head = _dense(dense, grid, t["head"])
        self.tok_ctx = sum(self.tok["ctx"].values())
        self.tok_gen = sum(self.tok["gen"].values())
        self.cn, self.cp, self.ctx_table = t["cn"], t["cp"], t["ctx_table"]
        self._cn_list, self._cp_list = self.cn.tolist(), self.cp.tolist()
        self.db, self.ds, self.dec_table = t["db"], t["ds"], t["dec_table"]
        self.extents = Extents(*(int(x) for x in t["extents"]))
        self.fill_ins = tuple(str(x) for x in t["fill_ins"])

    def _token_tables(self) -> dict[str, np.ndarray]:
        grid = _grid(1, self.max_tokens, 2 ** (1 / 8), dense_to=256)
        out = {"tok_grid": grid}
        for group in _TOKEN_GROUPS:
            ctx = np.array([self.ops.ctx(group, int(t)) for t in grid])
            gen = np.array([self.ops.gen(group, int(t), 1) for t in grid])
            if group == "allreduce":
                ctx, gen = self._reprice_allreduce(grid, ctx), self._reprice_allreduce(grid, gen)
            for phase, vals in (("ctx", ctx), ("gen", gen)):
                out[f"{phase}_{group}"] = self._smooth(vals, group != "allreduce")
        head = np.array([self.ops.gen("lm_head", int(t), 1) for t in grid])
        out["head"] = self._smooth(head, True)
        return out

    def _smooth(self, vals: np.ndarray, kernel: bool) -> np.ndarray:
        if kernel:
            vals = vals * self._scale
        return _isotonic(vals) if self.params.smooth else vals

    def _reprice_allreduce(self, grid: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """A100 PCIe: the measured NVLink all-reduce plus the extra ring time over PCIe."""
        c = self.capacity
        if c.gpu.link != "pcie" or c.tp_size == 1:
            return vals * self._scale
        eff = self.params.overhead.link_efficiency
        ring = grid * c.model.hidden * 2 * 2 * (c.tp_size - 1) / c.tp_size
        nvlink_bw = 300e9  # the A100 SXM the data was measured on
        extra = 2 * c.model.num_layers * ring * (1 / c.gpu.link_bw - 1 / nvlink_bw) / eff
        return vals * self._scale + extra

    def _context_attention(self) -> dict[str, np.ndarray]:
        cn = _grid(1, self.max_tokens, 2 ** 0.5, dense_to=4)
        cp = np.concatenate([[0], _grid(64, max(self.capacity.context_len, 64), 2 ** 0.5)])
        table = np.array([[self.ops.ctx("attention", int(n), int(pre)) for pre in cp]
                          for n in cn]) * self._scale
        if self.params.smooth:
            table = np.maximum.accumulate(np.maximum.accumulate(table, axis=0), axis=1)
        return {"cn": cn, "cp": cp, "ctx_table": table}

    def _decode_attention(self) -> dict[str, np.ndarray]:
        db = _grid(1, self.max_batch, 2 ** (1 / 8), dense_to=64)
        ds = _grid(1, max(self.capacity.context_len, 2), 2 ** 0.25, dense_to=4).astype(float)
        table = np.array([[self.ops.gen("attention", int(b), int(s)) for s in ds]
                          for b in db]) * self._scale
        if self.params.smooth:
            table = np.maximum.accumulate(np.maximum.accumulate(table, axis=0), axis=1)
        return {"db": db, "ds": ds, "dec_table": table}

    # -- lookups --------------------------------------------------------------------
    def _tokens(self, table: np.ndarray, m: int, what: str) -> float:
        if m < len(table):
            return float(table[m])
        self._warn(what, f"{what} at {m} tokens beyond the tabulated {len(table) - 1}; "
                   "extrapolated linearly")
        last = len(table) - 1
        return float(table[last] + (table[last] - table[last - 1]) * (m - last))

    def _ctx_attention(self, n: int, pre: int) -> float:
        if n + pre > self.extents.context_tokens:
            self._warn("ctx", f"context attention at {n + pre} tokens is beyond "
                       f"aiconfigurator's measured {self.extents.context_tokens}: "
                       "its values there are extrapolated")
        i = min(max(bisect.bisect_right(self._cn_list, n) - 1, 0), len(self._cn_list) - 2)
        j = min(max(bisect.bisect_right(self._cp_list, pre) - 1, 0), len(self._cp_list) - 2)
        n0, n1 = self._cn_list[i], self._cn_list[i + 1]
        p0, p1 = self._cp_list[j], self._cp_list[j + 1]
        fx, fy = (n - n0) / (n1 - n0), (pre - p0) / (p1 - p0)
        t = self.ctx_table
        lo = t[i, j] + (t[i + 1, j] - t[i, j]) * fx  # lo + (hi - lo) * f: exact on flats
        hi = t[i, j + 1] + (t[i + 1, j + 1] - t[i, j + 1]) * fx
        return float(lo + (hi - lo) * fy)

    def _decode_row(self, b: int) -> np.ndarray:
        db = self.db
        k = int(np.searchsorted(db, b))
        if k < len(db) and db[k] == b:
            return self.dec_table[k]
        if k >= len(db):
            self._warn("batch", f"decode batch {b} beyond the tabulated {db[-1]}; scaled")
            return self.dec_table[-1] * (b / db[-1])
        f = (b - db[k - 1]) / (db[k] - db[k - 1])
        return self.dec_table[k - 1] * (1 - f) + self.dec_table[k] * f

    def _decode_parts(self, b: int) -> tuple[float, np.ndarray]:
        """(constant seconds of a decode-only step of batch b, attention row over KV)."""
        hit = self._decode_const.get(b)
        if hit is None:
            graph = b <= self._graph_bs
            rows = _GRAPH_BS[bisect.bisect_left(_GRAPH_BS, b)] if graph else b
            rows = min(rows, max(self._graph_bs, b))
            const = (self._tokens(self.tok_gen, rows, "decode tokens")
                     + self._tokens(self.head, rows, "lm head")
                     + (self._graph if graph else self._eager) + self._per_request * b)
            if b > self.extents.decode_batch:
                self._warn("dbatch", f"decode batch {b} is beyond aiconfigurator's measured "
                           f"{self.extents.decode_batch}: extrapolated")
            hit = self._decode_const[b] = (const, self._decode_row(b))
        return hit

    def _check_kv(self, mean_kv: float) -> None:
        if mean_kv > self.extents.decode_kv:
            self._warn("dkv", f"decode KV length {mean_kv:.0f} is beyond aiconfigurator's "
                       f"measured {self.extents.decode_kv}: extrapolated")

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("opdb (%s): %s", self.capacity.model.name, message)

    def decode_kernel(self, b: int) -> tuple[float, np.ndarray, np.ndarray] | None:
        """`decode_times(b, ...)` as numbers compiled code can evaluate: (c, xp, fp) with
        `decode_times(b, kv) == c + np.interp(kv / b, xp, fp)` element by element, bit
        for bit (twin/_corec.pyx `Kernel`, which replays np.interp); None for b < 1."""
        if b < 1:
            return None
        const, row = self._decode_parts(b)
        return float(const), self.ds, row

    def prefill_kernel(self) -> tuple:
        """`step_time(chunks, [])` as numbers compiled code can evaluate (twin/_corec.pyx
        `PrefillKernel`, which replays this class's arithmetic and declines wherever a
        lookup here would warn): (eager, per-request seconds, the context-attention grid's
        new-token and prefix axes and table, the measured context length, the step-token
        and LM-head tables, and the set of warnings given: beyond a table the kernel
        computes the same extrapolation once the warning has been given here)."""
        return (self._eager, self._per_request, self.cn, self.cp, self.ctx_table,
                self.extents.context_tokens, self.tok_ctx, self.head, self._warned)

    # -- the contract ---------------------------------------------------------------
    def decode_times(self, batch_size: int, kv_sums: np.ndarray) -> np.ndarray:
        kv = np.asarray(kv_sums, dtype=float)
        if batch_size == 0:
            return np.full(kv.shape, self._graph)
        const, row = self._decode_parts(batch_size)
        mean = kv / batch_size
        if mean.size:
            self._check_kv(float(mean.max()))
        return const + np.interp(mean, self.ds, row)

    def with_step_cpu(self, cpu) -> OpdbStepTime:
        """This model with SGLang's scheduler CPU part set to `cpu` (the tables shared)."""
        out = copy.copy(self)
        out.params = replace(self.params, overhead=self.params.overhead.with_step_cpu(cpu))
        out._eager, out._graph, out._per_request = out.params.overhead.overheads(
            self.capacity.model.num_layers)
        out._decode_const = {}  # memoised decode constants hold the old CPU part
        return out

    def step_time(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> float:
        n_dec = len(decode_kv_lens)
        if not prefill_chunks:
            return float(self.decode_times(n_dec, np.array([sum(decode_kv_lens)]))[0])
        tokens = n_dec
        t = self._eager + self._per_request * (n_dec + len(prefill_chunks))
        for n, pre in prefill_chunks:
            tokens += n
            t += self._ctx_attention(n, pre)
        t += self._tokens(self.tok_ctx, tokens, "step tokens")
        t += self._tokens(self.head, len(prefill_chunks) + n_dec, "lm head")
        if n_dec:
            mean = sum(decode_kv_lens) / n_dec
            self._check_kv(mean)
            t += float(np.interp(mean, self.ds, self._decode_row(n_dec)))
        return t

    def breakdown(self, prefill_chunks: Sequence[PrefillChunk],
                  decode_kv_lens: Sequence[int]) -> dict[str, float]:
        n_dec = len(decode_kv_lens)
        has_prefill = bool(prefill_chunks)
        tokens = sum(n for n, _ in prefill_chunks) + n_dec
        rows = len(prefill_chunks) + n_dec
        if not has_prefill and 0 < n_dec <= self._graph_bs:  # padded graph batch
            tokens = rows = min(_GRAPH_BS[bisect.bisect_left(_GRAPH_BS, n_dec)],
                                max(self._graph_bs, n_dec))
        phase = self.tok["ctx" if has_prefill else "gen"]
        parts = {g: self._tokens(phase[g], tokens, g) for g in ("gemm", "norms", "allreduce")}
        parts["lm_head"] = self._tokens(self.head, rows, "lm head")
        parts["prefill_attention"] = sum((self._ctx_attention(n, p) for n, p in prefill_chunks), 0.0)
        mean = sum(decode_kv_lens) / n_dec if n_dec else 0.0
        parts["decode_attention"] = (float(np.interp(mean, self.ds, self._decode_row(n_dec)))
                                     if n_dec else 0.0)
        parts["overhead"] = self.overhead(prefill_chunks, decode_kv_lens)
        return parts

    def overhead(self, prefill_chunks: Sequence[PrefillChunk],
                 decode_kv_lens: Sequence[int]) -> float:
        """`breakdown(...)["overhead"]` alone: the CPU's launch and scheduling part (the
        overlap loop asks for it at every prefill step)."""
        n_dec = len(decode_kv_lens)
        graph = not prefill_chunks and n_dec <= self._graph_bs
        return ((self._graph if graph else self._eager)
                + self._per_request * (len(prefill_chunks) + n_dec))

    def describe(self) -> str:
        c = self.capacity
        extra = f"; {', '.join(self.fill_ins)} fill-ins" if self.fill_ins else ""
        engine = "SGLang" if self.framework == "sglang" else "vLLM"
        return (f"opdb (aiconfigurator-core per-op data, {engine}) on {c.gpu.name} x{c.tp_size} "
                f"({c.model.name}): {self.provenance}{extra}; decode KV folded by its mean; "
                f"graph max bs {self._graph_bs or 'off'}")


@register_backend("opdb")
def _make(capacity: Capacity, args: ServerArgs) -> OpdbStepTime:
    return OpdbStepTime(capacity, args)


def covers(capacity: Capacity, quantization: str | None = None) -> str | None:
    """None when aiconfigurator-core's data covers this model, GPU and dtypes; otherwise
    the reason it does not."""
    from twin.perf import aic

    c = capacity
    system, _, _ = system_for(c.gpu.name, c.gpu.aiconfigurator_system)
    if system is None:
        return f"no aiconfigurator-core data for {c.gpu.name}"
    kv_dtype_bytes = c.kv_bytes_per_token / c.model.kv_bytes_per_token(c.tp_size, 1.0)
    if quantization is None and c.model.weight_bytes_per_param < 2 and not c.model.hf_config.get(
            "quantization_config"):
        quantization = "fp8" if c.model.weight_bytes_per_param == 1 else "awq"
    try:
        aic.compile_model(c.model, system, c.tp_size,
                          aic.quant_modes(c.model, kv_dtype_bytes, quantization))
    except ConfigError as exc:
        return str(exc)
    return None
