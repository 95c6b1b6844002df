"""What the scheduling environment simulates: a deployment, a workload family, the SLO.

`EnvConfig` is frozen and validated; `PRESETS` holds the users' (`finance-qa`: 2x
A100-80GB PCIe at TP 2, the default run's model, finance-qa shapes at 50-200 % load with
bursts) and a small, fast one for tests (`tiny`). An episode's workload is drawn from the
family by `draw_workload(family, capacity_rps, rng)`: open-loop gamma arrivals (a burst CV
drawn per episode) at a load drawn per episode, finance-qa's request shapes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from twin.config import ServerArgs
from twin.policy.features import K_SLOTS, SloTargets, check_feature_set
from twin.policy.menu import MENU, check_chunk_answer, check_menu
from twin.sim import SimConfig
from twin.workload import Request, SegmentIds, Workload


@dataclass(frozen=True)
class DeploymentSpec:
    gpu: str = "a100-pcie-80gb"
    model_path: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
    tp_size: int = 2
    step_time_backend: str | None = None  # None: the best with data (opdb here)
    max_total_tokens: int | None = None
    disable_overlap_schedule: bool = False  # SGLang's overlap loop, on by default on GPUs
    #: SGLang's --chunked-prefill-size (None: its default for the GPU) and
    #: --enable-mixed-chunk: deployment settings, not policy decisions (what-ifs)
    chunked_prefill_size: int | None = None
    enable_mixed_chunk: bool = False

    def sim_config(self, horizon_s: float | None = None) -> SimConfig:
        args = ServerArgs(model_path=self.model_path, tp_size=self.tp_size,
                          max_total_tokens=self.max_total_tokens,
                          disable_overlap_schedule=self.disable_overlap_schedule,
                          chunked_prefill_size=self.chunked_prefill_size,
                          enable_mixed_chunk=self.enable_mixed_chunk)
        return SimConfig(args=args, gpu=self.gpu, step_time_backend=self.step_time_backend,
                         horizon_s=horizon_s, sample_every_s=1e9)


@dataclass(frozen=True)
class FamilySpec:
    """finance-qa's shapes (twin/workload.py `finance_qa`), open loop: 90 % short
    questions, 8 % documents, 2 % long documents, 60 % of documents opening with one of 20
    shared 2,048-token clauses, VIP tiers 0/10/20 at 80/15/5 %; `n` requests at a load drawn
    uniformly from `load` (a multiple of `capacity_rps`) with gamma gaps of a CV drawn from
    `burst_cv` (1: Poisson; above: bursts)."""

    n: int = 200
    load: tuple[float, float] = (0.5, 2.0)
    burst_cv: tuple[float, float] = (1.0, 3.0)
    system_tokens: int = 256
    short_median: float = 250.0
    short_output_median: float = 150.0
    doc_output_median: float = 300.0
    doc_tokens: tuple[int, int] = (10_000, 32_000)
    long_tokens: tuple[int, int] = (64_000, 128_000)
    p_doc: float = 0.08
    p_long: float = 0.02
    template_tokens: int = 2048
    tiers: tuple[tuple[int, float], ...] = ((0, 0.80), (10, 0.15), (20, 0.05))

    def __post_init__(self) -> None:
        lo, hi = self.load
        if not 0 < lo <= hi or not 0 < self.burst_cv[0] <= self.burst_cv[1]:
            raise ValueError(f"family load {self.load} / burst_cv {self.burst_cv}: need "
                             f"0 < low <= high")
        if self.n < 2 or not 0 <= self.p_doc + self.p_long <= 1:
            raise ValueError(f"family n {self.n} (>= 2), p_doc + p_long in [0, 1]")


@dataclass(frozen=True)
class EnvConfig:
    deployment: DeploymentSpec = field(default_factory=DeploymentSpec)
    family: FamilySpec = field(default_factory=FamilySpec)
    targets: SloTargets = field(default_factory=SloTargets)
    menu: tuple[str, ...] = MENU
    k_slots: int = K_SLOTS
    #: the observation's feature set (twin/policy/features.py: pass-v1, pass-v2)
    features: str = "pass-v1"
    #: SGLang's shortest-prefill-first chunk cap on top of every order (live: a server
    #: started with --schedule-policy shortest-prefill-first)
    chunk_cap: bool = False
    #: the chunk answer on top of every choice, (chunk_tokens, park_steps): while short
    #: questions wait or run a document's chunk is capped, and while they decode that many
    #: decode-only passes run before each chunk (twin/policy/deadline.py
    #: `short_question_chunks`; live through the plugin on any --schedule-policy)
    chunk_answer: tuple[int, int] | None = None
    #: the plan rules' prefill model [s_per_chunk, s_per_token, s_per_token_ctx, chunk]
    #: (twin/policy/deadline.py; None: fitted to the users' deployment)
    prefill: tuple[float, float, float, int] | None = None
    #: requests per second at 100 % load; None: measured (saturated closed loop, fcfs)
    capacity_rps: float | None = None
    #: passes sooner than this after the agent's last decision keep its last choice
    min_gap_s: float = 0.0
    #: the episode ends at last arrival + drain_factor x (n / capacity); the rest abort
    drain_factor: float = 1.5

    def __post_init__(self) -> None:
        check_feature_set(self.features)
        if self.chunk_answer is not None:
            check_chunk_answer(self.chunk_answer, "chunk_answer")
        check_menu(self.menu)

    def to_json(self) -> dict:
        d = asdict(self)
        d["targets"] = self.targets.to_json()
        dep = d["deployment"]  # the what-if flags only when set: older runs' configs match
        for key, default in (("chunked_prefill_size", None), ("enable_mixed_chunk", False)):
            if dep[key] == default:
                del dep[key]
        if d["chunk_answer"] is None:  # older runs' configs match
            del d["chunk_answer"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> EnvConfig:
        fam = {k: tuple(map(tuple, v)) if k == "tiers" else tuple(v) if isinstance(v, list)
               else v for k, v in d["family"].items()}
        return cls(deployment=DeploymentSpec(**d["deployment"]), family=FamilySpec(**fam),
                   targets=SloTargets.from_json(d["targets"]), menu=tuple(d["menu"]),
                   k_slots=d["k_slots"], features=d.get("features", "pass-v1"),
                   chunk_cap=d.get("chunk_cap", False),
                   chunk_answer=tuple(d["chunk_answer"]) if d.get("chunk_answer") else None,
                   prefill=tuple(d["prefill"]) if d.get("prefill") else None,
                   capacity_rps=d["capacity_rps"],
                   min_gap_s=d["min_gap_s"], drain_factor=d["drain_factor"])


TINY = EnvConfig(
    deployment=DeploymentSpec(gpu="a100-pcie-80gb", model_path="Qwen/Qwen3-8B", tp_size=1,
                              step_time_backend="roofline", max_total_tokens=60_000,
                              # the plain loop: its load scale and the tests' training
                              # budgets were set before the twin modelled the overlap one
                              disable_overlap_schedule=True),
    family=FamilySpec(n=60, doc_tokens=(4_000, 12_000), long_tokens=(16_000, 30_000),
                      template_tokens=1024),
    targets=SloTargets(ttft_s=0.5, tpot_s=0.05, doc_tokens=3000,
                       doc_ttft_s_per_token=1e-4))
#: the menu with admission control: spf's order and the deadline policy's four modes
HOLD_MENU = ("spf", "deadline", "hold-hopeless", "laxity", "hold-documents")
#: the withholding modes alone: when to hold which documents back
ADMIT_MENU = ("laxity", "hold-documents", "hold-hopeless")
#: every deadline variant (the four withholding modes) and spf's plain order
DEADLINE_MENU = ("hold-documents", "laxity", "hold-hopeless", "deadline", "spf")
#: two orders, each with three chunk answers: short questions first (256 tokens, 4
#: decode-only passes per chunk), balanced (512 x 4), documents first (1024 x 8)
CHUNK_MENU = tuple(f"{rule}@{answer}" for rule in ("hold-hopeless", "deadline")
                   for answer in ("256x4", "512x4", "1024x8"))
#: the chunk answer as a time budget (docs/rl.md "The chunk answer as a time"): the rules
#: with the best SLO and return at 150 % and two budgets beside the chosen 0.3 s
BUDGET_MENU = ("hold-hopeless@0.3sx8", "deadline@0.3sx8", "hold-hopeless@0.2sx8",
               "hold-hopeless@0.4sx8")
PRESETS = {"finance-qa": EnvConfig(), "finance-qa-capped": EnvConfig(chunk_cap=True),
           "finance-qa-hold": EnvConfig(menu=HOLD_MENU, chunk_cap=True),
           "finance-qa-admit": EnvConfig(menu=ADMIT_MENU, chunk_cap=True),
           "finance-qa-admit-v2": EnvConfig(menu=ADMIT_MENU, chunk_cap=True,
                                            features="pass-v2"),
           "finance-qa-deadline": EnvConfig(menu=DEADLINE_MENU, chunk_cap=True),
           "finance-qa-deadline-v2": EnvConfig(menu=DEADLINE_MENU, chunk_cap=True,
                                               features="pass-v2"),
           "finance-qa-chunks": EnvConfig(menu=DEADLINE_MENU, chunk_cap=True,
                                          features="pass-v2", chunk_answer=(512, 8)),
           # the chunk answer chosen per pass with the order (menu entries RULE@TOKENSxPARK)
           "finance-qa-chunks-v2": EnvConfig(menu=CHUNK_MENU, chunk_cap=True,
                                             features="pass-v2"),
           "finance-qa-budget-v2": EnvConfig(menu=BUDGET_MENU, chunk_cap=True,
                                             features="pass-v2"),
           "tiny": TINY, "tiny-hold": replace(TINY, menu=HOLD_MENU, chunk_cap=True),
           "tiny-v2": replace(TINY, menu=DEADLINE_MENU, chunk_cap=True, features="pass-v2"),
           "tiny-chunks": replace(TINY, menu=DEADLINE_MENU, chunk_cap=True, features="pass-v2",
                                  chunk_answer=(1024, 4))}


def preset(name: str, **changes) -> EnvConfig:
    if name not in PRESETS:
        raise ValueError(f"environment preset {name!r}: allowed values: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **changes)


def draw_shapes(f: FamilySpec, rng: np.random.Generator) -> list[Request]:
    """`f.n` requests with finance-qa's shapes, all at time 0 (arrivals come next)."""
    ids = SegmentIds()
    kind = rng.choice(3, size=f.n, p=[1 - f.p_doc - f.p_long, f.p_doc, f.p_long])
    tiers = np.array([t for t, _ in f.tiers])
    weights = np.array([w for _, w in f.tiers])
    tier = rng.choice(tiers, size=f.n, p=weights / weights.sum())
    out = []
    for i in range(f.n):
        segs = [(1, f.system_tokens)]
        if kind[i] == 0:
            body = int(max(8, round(f.short_median * np.exp(0.5 * rng.standard_normal()))))
            n_out = int(max(8, round(f.short_output_median
                                     * np.exp(0.5 * rng.standard_normal()))))
        else:
            lo, hi = f.doc_tokens if kind[i] == 1 else f.long_tokens
            body = int(rng.integers(lo, hi + 1)) - f.system_tokens
            n_out = int(max(8, round(f.doc_output_median * np.exp(0.5 * rng.standard_normal()))))
            if rng.random() < 0.6:
                segs.append((2000 + int(rng.integers(0, 20)), f.template_tokens))
                body -= f.template_tokens
        segs.append((ids.unique(), max(body, 1)))
        out.append(Request.make(f"r{i}", 0.0, segs, n_out, int(tier[i])))
    return out


def draw_workload(f: FamilySpec, capacity_rps: float,
                  rng: np.random.Generator) -> tuple[Workload, float, float]:
    """One episode's workload, its load (x capacity) and its burst CV."""
    load = float(rng.uniform(*f.load))
    cv = float(rng.uniform(*f.burst_cv))
    reqs = draw_shapes(f, rng)
    rate = load * capacity_rps
    shape = 1.0 / (cv * cv)
    times = np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=f.n))
    reqs = [replace(r, arrival_s=float(t)) for r, t in zip(reqs, times, strict=True)]
    wl = Workload(f"finance-qa-family(load={load:.3f},cv={cv:.3f})", tuple(reqs),
                  description=f"finance-qa shapes, gamma arrivals at {rate:.4f} req/s, cv {cv:.3f}")
    return wl, load, cv


def draw_episode(cfg: EnvConfig, capacity_rps: float, rng: np.random.Generator,
                 options: dict | None = None) -> tuple[Workload, float, float]:
    """An episode's workload; `options` may fix `load` and `burst_cv`."""
    fam = cfg.family
    opts = dict(options or {})
    if "load" in opts or "burst_cv" in opts:
        load = float(opts.pop("load", fam.load[0]))
        cv = float(opts.pop("burst_cv", fam.burst_cv[0]))
        fam = replace(fam, load=(load, load), burst_cv=(cv, cv))
    if opts:
        raise ValueError(f"reset options {sorted(opts)}: allowed: load, burst_cv")
    return draw_workload(fam, capacity_rps, rng)
