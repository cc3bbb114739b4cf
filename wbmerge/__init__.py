"""wbmerge: log W&B offline on every rank of a distributed job; merge and upload afterwards."""

from .training import detect_rank, init, rank_config, rank_metadata

__version__ = "0.1.0"
__all__ = ["__version__", "detect_rank", "init", "rank_config", "rank_metadata"]
