"""Training data: real text corpora tokenised at the byte level."""
from cfp.corpus import ByteCorpus

__all__ = ["ByteCorpus"]
