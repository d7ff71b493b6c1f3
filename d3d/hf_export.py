"""The former home of the AR drafter's transformers export, kept so its importers keep working.

Everything lives in `d3d.export` now (the target, AR drafters and D3D drafters for vLLM); import
from there. This module defines nothing of its own.
"""

from d3d.export import ARCHITECTURES, DTYPE_NAMES, export_hf, hf_config, hf_state

__all__ = ["ARCHITECTURES", "DTYPE_NAMES", "export_hf", "hf_config", "hf_state"]
