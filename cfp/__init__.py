"""cfp: automatic intra-operator parallelism and heterogeneous 3D parallelism for JAX."""
