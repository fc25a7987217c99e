"""flamia_pack: packed variable-length documents for long-context LLM training.

The public API is re-exported here; nothing is defined in this file. See README.md and
DESIGN.md (shared) for the layout: sources -> pack -> formats -> loaders -> scheduler -> kernels.
"""
from flamia_pack.errors import FlamiaError, FormatError, MetadataError, SourceError

__all__ = ["FlamiaError", "FormatError", "MetadataError", "SourceError"]
__version__ = "0.1.0"
