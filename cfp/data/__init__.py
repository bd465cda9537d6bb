"""Training data: real text corpora tokenised at the byte level."""
from cfp.data.corpus import ByteCorpus

__all__ = ["ByteCorpus"]
