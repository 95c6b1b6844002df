"""GPU specifications by name, from vendor datasheets (see docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

from twin.errors import ConfigError

GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One GPU. Rates are per GPU; `link_bw` is the per-direction bandwidth between the
    GPUs of one tensor-parallel group (NVLink, or PCIe when there is no NVLink)."""

    name: str
    mem_bytes: int
    hbm_bw: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None  # dense FLOP/s; None when the GPU has no FP8 tensor cores
    link_bw: float  # bytes/s per direction between TP peers
    link: str  # "nvlink" or "pcie"
    host_link_bw: float  # bytes/s per direction to host memory (swap, offload)
    aiconfigurator_system: str | None  # aiconfigurator-core system name with measured data

    @property
    def mem_gib(self) -> float:
        return self.mem_bytes / GIB


PCIE4_X16 = 31.5 * GB  # per direction, theoretical
PCIE5_X16 = 63.0 * GB

GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("a100-sxm-80gb", 80 * GIB, 2039 * GB, 312e12, None, 300 * GB, "nvlink",
                PCIE4_X16, "a100_sxm"),
        # The users' machines: two A100-80GB PCIe cards talking over PCIe 4.0 x16.
        GpuSpec("a100-pcie-80gb", 80 * GIB, 1935 * GB, 312e12, None, PCIE4_X16, "pcie",
                PCIE4_X16, None),
        GpuSpec("h100-sxm-80gb", 80 * GIB, 3350 * GB, 989e12, 1979e12, 450 * GB, "nvlink",
                PCIE5_X16, "h100_sxm"),
        GpuSpec("h200-sxm-141gb", 143771 * 2**20, 4800 * GB, 989e12, 1979e12, 450 * GB, "nvlink",
                PCIE5_X16, "h200_sxm"),
    )
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ConfigError(
            f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(GPUS))}"
        ) from None
