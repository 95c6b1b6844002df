"""GPU-hour prices: a documented default table, overridable by `--prices FILE`.

The defaults are on-demand list prices per GPU-hour in US dollars, the middle of the
"specialty provider" range (Lambda, CoreWeave, Crusoe, RunPod and the like) of Mercatus'
"Cloud GPU pricing" guide of May 2026 (https://www.mercatus-ai.com/blog/cloud-gpu-pricing):
A100 80GB $1.10-1.50, H100 SXM5 $2.50-3.50, H200 SXM5 $3.50-4.50. That guide prices the
A100 80GB without telling PCIe from SXM; the table sets PCIe $0.20 below SXM (an
assumption, said here). Prices change: give your own with `--prices FILE` (JSON or YAML,
`{"<gpu>": usd_per_gpu_hour, ...}`, every GPU of the search space), which then becomes the
table's source.
"""

from __future__ import annotations

import json
from pathlib import Path

from twin.errors import ConfigError
from twin.hardware import GPUS
from twin.inputs import read_text

DEFAULT_PRICES = {"a100-pcie-80gb": 1.10, "a100-sxm-80gb": 1.30, "h100-sxm-80gb": 3.00,
                  "h200-sxm-141gb": 4.00}
DEFAULT_SOURCE = ("on-demand USD per GPU-hour, mid specialty-provider range of "
                  "https://www.mercatus-ai.com/blog/cloud-gpu-pricing (May 2026); "
                  "A100 PCIe set $0.20 below SXM (assumption); experiments/plan/prices.py")


def load_prices(path: str | Path | None, gpus: list[str]) -> tuple[dict[str, float], str]:
    """(price per GPU-hour by GPU, source); every GPU in `gpus` must have a price."""
    if path is None:
        prices, source = dict(DEFAULT_PRICES), DEFAULT_SOURCE
    else:
        prices, source = _read(Path(path)), f"{path} (--prices)"
    missing = [g for g in gpus if g not in prices]
    if missing:
        where = f"--prices {path}" if path else "the default price table"
        raise ConfigError(f"{where}: no price for {', '.join(missing)}; give "
                          f"{{\"<gpu>\": usd_per_gpu_hour}} for each")
    return {g: prices[g] for g in sorted(prices)}, source


def _read(path: Path) -> dict[str, float]:
    import yaml

    if not path.is_file():
        raise ConfigError(f"--prices {path}: no such file")
    text = read_text(path, "--prices")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"--prices {path}: not valid JSON/YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--prices {path}: expected a mapping {{gpu: usd_per_gpu_hour}}")
    out = {}
    for gpu, price in data.items():
        if gpu not in GPUS:
            raise ConfigError(f"--prices {path}: key {gpu!r}: not a GPU; allowed: "
                              f"{', '.join(sorted(GPUS))}")
        if isinstance(price, bool) or not isinstance(price, int | float) or not price > 0:
            raise ConfigError(f"--prices {path}: key {gpu!r}: {price!r}: must be a price "
                              "per GPU-hour > 0")
        out[gpu] = float(price)
    return out
