"""An uncalibrated step-time guess for the CPU harness: the roofline model on a CPU.

The twin's `roofline` backend needs a device's compute rate and memory bandwidth; for the
CPU SGLang server (the tiny float32 Llama on a few x86 cores) they come from nominal
numbers, not from measurements: `cores x clock x FLOP/cycle` (AVX2 FMA: two 8-lane fp32
FMA units, 32 FLOP/cycle) and a guessed memory bandwidth, with the roofline's default
efficiencies and per-step overheads (which are a GPU's). It is the starting point that
calibration against the live server will replace; `benchmarks/live_vs_twin.py` shows how
far off it is.

Use it by passing the model to `twin.sim.simulate(..., step_time=cpu_step_time(cap, args))`
with a capacity derived for any GPU (the KV pool is fixed by `--max-total-tokens` on the
CPU server); the GPU in the capacity is swapped for `CpuSpec.as_device()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from twin.config import Capacity, ServerArgs
from twin.hardware import GpuSpec
from twin.perf.roofline import RooflineParams, RooflineStepTime


@dataclass(frozen=True)
class CpuSpec:
    cores: int = 2
    clock_hz: float = 2.6e9
    flop_per_cycle: float = 32.0  # fp32, AVX2: 2 FMA units x 8 lanes x 2
    mem_bw: float = 20e9  # bytes/s, a guess for a small VM's share of DDR4

    @classmethod
    def this_machine(cls) -> CpuSpec:
        """Core count and clock of the machine this runs on (Linux), else the defaults."""
        cores = os.cpu_count() or cls.cores
        clock = cls.clock_hz
        try:
            with open("/proc/cpuinfo") as fh:
                for line in fh:
                    if line.startswith("cpu MHz"):
                        clock = float(line.split(":")[1]) * 1e6
                        break
        except (OSError, ValueError):
            pass
        return cls(cores=cores, clock_hz=clock)

    @property
    def flops(self) -> float:
        return self.cores * self.clock_hz * self.flop_per_cycle

    def as_device(self) -> GpuSpec:
        """The CPU in the shape the roofline reads (rates only; no links, no graphs)."""
        return GpuSpec(f"cpu-{self.cores}core-{self.clock_hz / 1e9:.1f}ghz", 24 * 2**30,
                       self.mem_bw, self.flops, None, self.mem_bw, "pcie", self.mem_bw, None)


def cpu_step_time(capacity: Capacity, args: ServerArgs, cpu: CpuSpec | None = None,
                  params: RooflineParams | None = None) -> RooflineStepTime:
    """The roofline step time of `capacity`'s model on `cpu` (CUDA graphs off)."""
    cpu = cpu or CpuSpec.this_machine()
    cap = replace(capacity, gpu=cpu.as_device(), cuda_graph_max_bs=0)
    model = RooflineStepTime(cap, replace(args, disable_cuda_graph=True), params)
    model.name = "roofline-cpu-guess"
    return model
