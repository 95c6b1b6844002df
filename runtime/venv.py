"""Where one of servetwin's isolated environments lives (the SGLang and vLLM CPU harnesses,
the router): a prefix with its Python and the install marker the installer writes last."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VenvPrefix:
    prefix: Path
    marker_name = "servetwin-env.json"  # each kind names its own marker

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.prefix / self.marker_name

    @property
    def install_log(self) -> Path:
        return self.prefix / "install.log"
