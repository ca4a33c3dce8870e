"""How large the SSD tree's buffers and CUDA graphs are, from the speculative config:
the scratch rows the branches write, the rows a branch sees beyond its sequence's
prefix, and the (sequences, branches) shapes of the tree-step graphs."""

from __future__ import annotations

from spec_runtime.config import pow2_at_least


def scratch_rows_needed(spec_cfg, num_slots: int) -> int:
    return num_slots * spec_cfg.max_branches() * spec_cfg.k


def branches_per_seq(spec_cfg, num_seqs: int) -> int:
    """Branches each sequence gets when `num_seqs` work ahead together (SpeculativeConfig.branches_per_seq)."""
    return spec_cfg.branches_per_seq(num_seqs)


def tree_shapes(spec_cfg, max_seqs: int) -> list[tuple[int, int]]:
    """(sequences, branches per sequence) of the tree-step CUDA graphs: one per power of
    two up to max_seqs (and max_seqs), branches padded to a power of two; unless the
    tree is pinned, also every smaller level of the ladder the round policy picks from."""
    sizes, b = [], 1
    while b < max_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_seqs)
    shapes = []
    for s in sizes:
        shapes += [(s, pow2_at_least(q)) for q in spec_cfg.tree_levels(s)]
    return sorted(set(shapes))


def tree_local_rows(spec_cfg) -> int:
    """Rows a branch sees beyond its sequence's prefix: up to K accepted drafts, then K scratch rows."""
    return 2 * spec_cfg.k
