"""The layered-model contract (`LayeredModel`): any JAX model as ``first -> layer x L -> last``."""
from cfp.layered.model import LayeredModel

__all__ = ["LayeredModel"]
