"""The one dtype table: numpy/JAX dtype name -> (XLA HLO type name, bytes per element)."""
from __future__ import annotations

DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("pred", 1),
    "int8": ("s8", 1), "uint8": ("u8", 1),
    "int16": ("s16", 2), "uint16": ("u16", 2), "float16": ("f16", 2), "bfloat16": ("bf16", 2),
    "int32": ("s32", 4), "uint32": ("u32", 4), "float32": ("f32", 4),
    "int64": ("s64", 8), "uint64": ("u64", 8), "float64": ("f64", 8),
}
_HLO_BYTES = {hlo: n for hlo, n in DTYPES.values()}
_DEFAULT_BYTES = 4     # a dtype outside the table (float8 variants, say) is counted as 4 bytes


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name ("float32", "bfloat16", ...)."""
    entry = DTYPES.get(dtype)
    return entry[1] if entry else _DEFAULT_BYTES


def hlo_name(dtype: str) -> str:
    """XLA's short type name ("f32", "bf16", ...); a dtype outside the table keeps its own name."""
    entry = DTYPES.get(dtype)
    return entry[0] if entry else dtype


def hlo_itemsize(hlo_type: str) -> int:
    """Bytes per element of an HLO type name ("f32", "pred", ...)."""
    return _HLO_BYTES.get(hlo_type, _DEFAULT_BYTES)
