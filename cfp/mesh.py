"""Logical device meshes: a typed description (`MeshSpec`) and its JAX `Mesh`."""
from __future__ import annotations

import dataclasses
import math
import re

from cfp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A logical mesh: its shape and axis names ("axis" always means a mesh axis in cfp)."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s <= 0 for s in shape):
            raise ConfigError(f"mesh shape {self.shape!r} must be 1-D or 2-D with positive sizes, e.g. (8,) or (2, 4)")
        if len(shape) > 2:
            raise ConfigError(f"mesh shape {self.shape!r} has {len(shape)} axes; cfp supports 1-D and 2-D meshes")
        names = tuple(self.axis_names) or tuple(f"x{i}" for i in range(len(shape)))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise ConfigError(f"axis names {self.axis_names!r} must be distinct, one per mesh axis of {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def parse(cls, text: str, num_devices: int | None = None) -> "MeshSpec":
        """Parse "8" or "2x4"; with `num_devices`, the mesh must use a divisor of it."""
        if not re.fullmatch(r"\s*\d+(\s*x\s*\d+)?\s*", str(text)):
            raise ConfigError(f"mesh {text!r} is not of the form N or AxB (e.g. 8 or 2x4)")
        spec = cls(tuple(int(s) for s in str(text).split("x")))
        if num_devices is not None and (spec.size > num_devices or num_devices % spec.size):
            raise ConfigError(f"mesh {text!r} needs {spec.size} devices, which does not divide the "
                              f"{num_devices} devices available")
        return spec

    @classmethod
    def of(cls, mesh) -> "MeshSpec":
        """The MeshSpec of a MeshSpec, a string such as "2x4", or a `jax.sharding.Mesh`."""
        if isinstance(mesh, MeshSpec):
            return mesh
        if isinstance(mesh, str):
            return cls.parse(mesh)
        if hasattr(mesh, "devices") and hasattr(mesh, "axis_names"):
            return cls(tuple(mesh.devices.shape), tuple(mesh.axis_names))
        raise ConfigError(f"mesh {mesh!r} is not a MeshSpec, a string like '2x4' or a jax Mesh")

    @staticmethod
    def auto(mesh):
        """`mesh` (a jax Mesh of any axis types: Explicit, as `jax.make_mesh` makes by default, Auto, mixed)
        with every axis Auto over the same devices: cfp places tensors with `with_sharding_constraint`, which
        only names Auto axes, and the plan depends on the mesh's shape, never on its axis types."""
        from jax.sharding import AxisType, Mesh

        types = getattr(mesh, "axis_types", None)
        if types is not None and all(t == AxisType.Auto for t in types):
            return mesh
        return Mesh(mesh.devices, tuple(mesh.axis_names), axis_types=(AxisType.Auto,) * len(mesh.axis_names))

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))

    def make(self, devices=None):
        """The JAX mesh (axis types Auto, so `with_sharding_constraint` applies) on the first devices."""
        import jax
        import numpy as np
        from jax.sharding import AxisType, Mesh

        devs = list(devices if devices is not None else jax.devices())
        if len(devs) < self.size:
            raise ConfigError(f"mesh {self} needs {self.size} devices, only {len(devs)} are available")
        arr = np.array(devs[: self.size], dtype=object).reshape(self.shape)
        return Mesh(arr, self.axis_names, axis_types=(AxisType.Auto,) * self.ndim)
