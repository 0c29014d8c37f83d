"""Serving engine: host-side bookkeeping of the paged KV pool and of shared affixes (block_manager, affix_index)."""
