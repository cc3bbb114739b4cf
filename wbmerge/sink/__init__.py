"""A local W&B-compatible sink: the built-in default upload target and the test backend."""

from .client import SinkClient, local_api_key
from .store import Store

__all__ = ["SinkClient", "Store", "local_api_key"]
