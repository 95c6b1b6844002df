"""Chunks of an in-flight prompt enter the radix cache as they are done.

SGLang 0.5.23 caches a chunked request's computed prefix at the next pass
(`tree_cache.cache_unfinished_req(chunked_req, chunked=True)`), so a request with the same
document that arrives meanwhile matches the part already computed, not only finished
prompts. The twin's cache holds whole segments, so what enters is the run of whole
segments the chunks so far have covered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twin.replica import Replica
    from twin.request_state import SimRequest


def cache_chunk(rep: Replica, req: SimRequest, now: float) -> None:
    """Insert the whole segments of `req`'s prompt computed so far; the request's KV for
    them passes to the cache (duplicates of what another request cached meanwhile are
    freed) and the request locks the deeper path instead of the old one."""
    tree = rep.tree
    if tree is None:
        return
    segs, end = [], 0
    for seg in req.req.segments:
        if end + seg[1] > req.computed:
            break
        segs.append(seg)
        end += seg[1]
    if end <= req.prefix_len:
        return
    node, created = tree.insert(segs, now)
    for new in created:
        rep.alloc.transfer(req.index, -new.nid, new.tokens)
    own = end - req.prefix_len
    dup = own - sum(n.tokens for n in created)
    if dup:
        rep.alloc.free_tokens(req.index, dup)
    req.private -= own
    old = req.node
    tree.lock(node)
    req.node = node
    if old is not None:
        tree.unlock(old)
    req.prefix_len = end  # the rest of the prompt is the request's own
