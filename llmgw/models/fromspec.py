"""
The bridge between the catalog's L{llmgw.sourcespec.ModelSource} (what the
control plane and the wire carry) and the cache's L{llmgw.models.source}
sources: both ends name a model's copy by the same L{cache_key}, so the
control plane can tell which nodes hold what a deployment needs.
"""

from __future__ import annotations

from llmgw.models.errors import SourceInvalid
from llmgw.models.source import LocalSource, Source, cache_key, parse_source
from llmgw.sourcespec import ModelSource


def from_spec(spec: ModelSource) -> Source:
    """
    The cache's source for C{spec}.

    @raise SourceInvalid: C{spec} is not a source the cache accepts.
    """
    return parse_source(spec.uri, file=spec.file or None, sha256=spec.sha256 or None)


def spec_key(spec: ModelSource | None) -> str:
    """
    The cache key of C{spec}'s copy on a node; "" where nothing is cached
    for it (no source, a path on the node, or one the cache refuses).
    """
    if spec is None:
        return ""
    try:
        source = from_spec(spec)
    except SourceInvalid:
        return ""
    if isinstance(source, LocalSource):
        return ""
    return cache_key(source)
